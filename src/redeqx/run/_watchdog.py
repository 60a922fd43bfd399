"""`StepWatchdog`: a step that hangs ends the job, with every process's
Python stacks, instead of hanging it forever.

A process that stops calling collectives (a deadlock, a stuck read, a
``sleep`` or a breakpoint left in) hangs every other process in its next
collective: no error is raised and no timeout fires (JAX's heartbeat sees
the processes alive). The watchdog is a thread per process that the loop
tells when a step ends (`StepWatchdog.beat`); when the step under way has
run ``factor`` times longer than the median of the steps before it, it
prints which step, how long, and the Python stack of every thread of its
process, then ends the process with status `HUNG_EXIT_CODE`. Every process
runs one, and they are all stuck, so each prints its own stacks: the one
that hung shows where. Nothing is installed by ``import redeqx``: the
thread starts with ``start()`` (or ``with``) and stops with ``close()``.
"""

from __future__ import annotations

import faulthandler
import math
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from .._typing import typechecked

HUNG_EXIT_CODE = 124  # what `timeout` returns for a command that ran too long
"""The exit status (124) of every process when `StepWatchdog` finds a step hung."""
_EXIT_DELAY = 2.0  # seconds between printing and exiting: the other processes print theirs meanwhile


def _positive(name: str, value, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not (
            math.isfinite(value) and value > minimum):
        raise ValueError(f"StepWatchdog: {name} must be a number > {minimum:g}, got {value!r}.")
    return float(value)


class StepWatchdog:
    """Ends a run whose step hangs, naming the step and printing every
    process's Python stacks.

    - ``factor``: a step that has run ``factor`` times the median of the
      steps before it (and at least ``min_seconds``) counts as hung.
    - ``min_seconds``: never sooner than this (a step of milliseconds may
      well take a second now and then: a garbage collection, a slow read).
    - ``warmup``: steps not counted in the median (the first compiles).
      Nothing is judged before there is a median: a hang in the first
      ``warmup + 2`` steps is not caught.
    - A step is the time from one `beat` to the next: the loop's whole body,
      data, logging and checkpoint saves included. Wrap what is not a step
      and may take long (evaluation, a restore) in ``with watchdog.paused():``.
    - On a hang it exits with status 124 (`HUNG_EXIT_CODE`) without waiting
      for anything (the hung collective would never return); the last
      complete checkpoint is intact, and a save still in flight is never
      picked up by `restore` (saves are atomic).

    **Example:**

    ```python
    with redeqx.StepWatchdog(factor=20) as watchdog:
        for batch in redeqx.batches(train, collate_fn, 8, mesh, shuffle=True, key=key):
            state, metrics = train_step(state, batch)
            manager.save(state, epoch=epoch, batch=i + 1)
            watchdog.beat(int(state.step))
        with watchdog.paused():
            metrics = redeqx.evaluate(eval_step, state.model, test, collate_fn, 8, mesh, key=key)
    ```
    """

    @typechecked
    def __init__(self, factor: float = 20.0, *, min_seconds: float = 60.0, warmup: int = 2):
        self.factor = _positive("factor", factor, 1.0)
        self.min_seconds = _positive("min_seconds", min_seconds)
        if isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"StepWatchdog: warmup must be an int >= 0 (steps left out of the median), got {warmup!r}.")
        self.warmup = int(warmup)
        self._durations: deque[float] = deque(maxlen=1000)  # the latest steps: a median that follows the run
        self._beats = 0
        self._last: float | None = None
        self._step: int | None = None
        self._paused = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._process = 0

    def start(self) -> StepWatchdog:
        """Start watching (a daemon thread); the first `beat` starts the clock."""
        if self._thread is None:
            import jax

            self._process = jax.process_index()
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="redeqx-step-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """A step ended; ``step`` is the run's step count now (``int(state.step)``)."""
        now = time.monotonic()
        with self._lock:
            if self._last is not None and not self._paused:
                self._beats += 1
                if self._beats > self.warmup:
                    self._durations.append(now - self._last)
            self._last, self._step = now, int(step)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Not a step: the time inside is not watched, and the clock restarts after it."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._last = time.monotonic()

    def close(self) -> None:
        """Stop watching."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def __enter__(self) -> StepWatchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _limit(self) -> tuple[float, float] | None:
        """``(median step, seconds a step may run)``, once there is a median."""
        if not self._durations:
            return None
        median = statistics.median(self._durations)
        return median, max(self.factor * median, self.min_seconds)

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            with self._lock:
                found = self._limit()
                if found is None or self._paused or self._last is None:
                    continue
                median, limit = found
                elapsed = time.monotonic() - self._last
                step, n = self._step, len(self._durations)
            if elapsed > limit:
                self._fire(step, elapsed, median, limit, n)

    def _fire(self, step: int, elapsed: float, median: float, limit: float, n: int) -> None:
        print(
            f"redeqx.StepWatchdog: process {self._process}: the step after step {step} has run {elapsed:.1f} s, "
            f"{elapsed / max(median, 1e-9):.0f}x the median step ({median:.3f} s) of the {n} before it (limit "
            f"{limit:.1f} s: factor={self.factor:g} x the median, at least min_seconds={self.min_seconds:g}). A "
            "process that stops (a deadlock, a stuck read, a sleep) hangs every other in its collectives without "
            f"an error. This process's Python stacks follow; it exits with status {HUNG_EXIT_CODE}. The last "
            "complete checkpoint is intact.",
            file=sys.stderr, flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stdout.flush()
        sys.stderr.flush()
        # The other processes' watchdogs see the same stall within a poll or two; a launcher or a
        # scheduler stops them all once one exits, so wait a little for theirs to print too (the
        # stack of the process that hung is the one that says where).
        time.sleep(_EXIT_DELAY)
        os._exit(HUNG_EXIT_CODE)  # the main thread is stuck in a collective: nothing else would end it
