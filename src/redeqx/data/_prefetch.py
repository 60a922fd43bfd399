"""A background thread that makes a loop's items ahead of it: `prefetched`
(what `batches`, `evaluate`, `predict` and `grain_batches` run their
pipelines in) and the check of its ``prefetch`` argument."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator

import numpy as np


# batches made ahead of the loop by default: one to overlap the running step,
# one to absorb a slow collate; each holds one global batch in device memory
DEFAULT_PREFETCH = 2


def check_prefetch(prefetch) -> int:
    if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or prefetch < 0:
        raise ValueError(
            f"prefetch must be an int >= 0 (batches collated and sent to the devices ahead of the loop; "
            f"0 turns that off), got {prefetch!r}."
        )
    return int(prefetch)


_DONE = object()


def prefetched(items: Iterator, prefetch: int) -> Iterator:
    """The items of the generator ``items``, in order, made by a background
    thread up to ``prefetch`` items ahead of the consumer (with
    ``prefetch=0``: in the consumer's thread, when asked for).

    An exception raised while making an item reaches the consumer when it
    asks for that item, after the items before it: the same exception
    object, whose traceback still shows where it was raised. Closing this
    generator (``break``, an exception in the loop, ``close()``, garbage
    collection) stops the thread, waits for it and closes ``items``, so no
    thread outlives the loop and no file a stream opened stays open.
    """
    if prefetch == 0:
        with contextlib.closing(items):
            yield from items
        return
    ready: queue.SimpleQueue = queue.SimpleQueue()  # (item, error), in order
    slots = threading.Semaphore(prefetch)  # items made and not yet taken <= prefetch
    stop = threading.Event()

    def work():  # refers to `items`, never to this generator, so an abandoned loop can be collected
        try:
            while True:
                slots.acquire()
                if stop.is_set():
                    return
                try:
                    item = next(items)
                except StopIteration:
                    break
                except BaseException as e:  # raised in the consumer's thread instead
                    ready.put((None, e))
                    return
                ready.put((item, None))
            ready.put((_DONE, None))
        finally:
            items.close()  # here: a generator is closed by the thread that runs it

    thread = threading.Thread(target=work, name="redeqx-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, error = ready.get()
            slots.release()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        slots.release()  # wakes the thread if it waits for a slot
        if thread is not threading.current_thread():
            thread.join()  # at most the batch it is making
