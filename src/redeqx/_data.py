"""Host-side data: examples -> collated NumPy -> global sharded batches, and
the `evaluate` / `predict` loops over them.

One pipeline serves all three: a batch's rows are picked from the (shuffled)
order, this process collates its own rows, and they become global arrays
split over ``data``. A background thread runs that pipeline up to
``prefetch`` batches ahead of the loop, so collating batch ``i + 1`` overlaps
step ``i``.

Threads and JAX: the background thread calls ``collate_fn`` and
``jax.make_array_from_process_local_data``. On one process that is a
``jax.device_put``; on several it is ``make_array_from_callback``, a
``device_put`` of each local shard onto this process's own devices. Neither
compiles or runs a program nor talks to another process, so the thread never
takes part in the cross-process ordering of collectives that multi-controller
JAX requires (steps, all-gathers, barriers stay on the loop's thread, in the
same order on every process); and JAX allows its API, ``device_put``
included, to be called from several Python threads.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from ._mesh import DATA, check_mesh
from ._steps import EvalStep
from ._typing import positive_int, typechecked


# progress bars of the `batches` loops now running, innermost last: `Logger.log`
# shows the loss and learning rate on the innermost one
ACTIVE_BARS: list = []


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", repr(fn))


def collate(collate_fn: Callable, examples: list, n_rows: int):
    """Runs ``collate_fn`` and checks it gave a tree of numeric arrays with
    ``n_rows`` rows each."""
    out = collate_fn(examples)
    # a list is one (maybe ragged) array's rows, not a container
    is_leaf = lambda x: isinstance(x, list)  # noqa: E731
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_leaf)
    if not leaves_with_path:
        raise ValueError(f"collate_fn {_fn_name(collate_fn)!r} returned no arrays (got {out!r}).")
    checked = []
    for kp, leaf in leaves_with_path:
        where = f"collate_fn {_fn_name(collate_fn)!r} output{jax.tree_util.keystr(kp)}"
        try:
            arr = np.asarray(leaf)
        except ValueError as e:  # ragged nested lists
            raise ValueError(
                f"{where} is ragged (rows of different lengths): {e}. Pad every row to one length in collate_fn "
                "and return NumPy arrays."
            ) from None
        if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            raise TypeError(
                f"{where} has dtype {arr.dtype} ({type(leaf).__name__}); collate_fn must return numeric NumPy "
                "arrays (pad ragged rows, map strings to ids)."
            )
        if arr.ndim == 0 or arr.shape[0] != n_rows:
            raise ValueError(
                f"{where} has shape {arr.shape}, but collate_fn got {n_rows} examples: every array needs one row "
                "per example as its leading dim."
            )
        checked.append(arr)
    return jax.tree.unflatten(treedef, checked)


def local_rows(mesh: Mesh, global_batch: int) -> tuple[int, int]:
    """The contiguous range of a global batch's rows that this process's
    devices hold when the batch is split over ``data``."""
    n_data = mesh.shape[DATA]
    per = global_batch // n_data
    me = jax.process_index()
    mine = [i for i in range(n_data) if any(d.process_index == me for d in mesh.devices[i].flat)]
    lo, hi = min(mine), max(mine) + 1
    if hi - lo != len(mine):
        raise ValueError("this process's devices are not contiguous on the mesh's data axis; build it with make_mesh.")
    return lo * per, hi * per


def to_global(local_batch, mesh: Mesh, global_batch: int):
    """This process's rows -> global arrays split over ``data``."""

    def one(x):
        sharding = NamedSharding(mesh, P(DATA, *([None] * (x.ndim - 1))))
        return jax.make_array_from_process_local_data(sharding, x, (global_batch, *x.shape[1:]))

    return jax.tree.map(one, local_batch)


# batches made ahead of the loop by default: one to overlap the running step,
# one to absorb a slow collate; each holds one global batch in device memory
DEFAULT_PREFETCH = 2


def _global_batch_size(per_device_batch_size, mesh) -> int:
    per_device_batch_size = positive_int(per_device_batch_size, "per_device_batch_size")
    return per_device_batch_size * mesh.shape[DATA]


def _order(n: int, shuffle: bool, key) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    if key is None:
        raise ValueError("shuffle=True needs key=: pass e.g. key=jax.random.fold_in(key, epoch) for a new order each epoch.")
    return np.asarray(jax.random.permutation(key, n))


def _check_prefetch(prefetch) -> int:
    if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or prefetch < 0:
        raise ValueError(
            f"prefetch must be an int >= 0 (batches collated and sent to the devices ahead of the loop; "
            f"0 turns that off), got {prefetch!r}."
        )
    return int(prefetch)


_DONE = object()


def _prefetched(make: Callable[[int], Any], indices: range, prefetch: int) -> Iterator:
    """``make(i)`` for each ``i`` of ``indices``, in order, made by a
    background thread up to ``prefetch`` items ahead of the consumer (with
    ``prefetch=0``: in the consumer's thread, when asked for).

    An exception in ``make(i)`` reaches the consumer when it asks for item
    ``i``, after the items before it: the same exception object, whose
    traceback still shows where it was raised. Closing this generator
    (``break``, an exception in the loop, ``close()``, garbage collection)
    stops the thread and waits for it, so no thread outlives the loop.
    """
    if prefetch == 0:
        for i in indices:
            yield make(i)
        return
    ready: queue.SimpleQueue = queue.SimpleQueue()  # (item, error), in order
    slots = threading.Semaphore(prefetch)  # items made and not yet taken <= prefetch
    stop = threading.Event()

    def work():  # refers to no generator, so an abandoned loop can be collected
        for i in indices:
            slots.acquire()
            if stop.is_set():
                return
            try:
                ready.put((make(i), None))
            except BaseException as e:  # raised in the consumer's thread instead
                ready.put((None, e))
                return
        ready.put((_DONE, None))

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


def _bar_title(desc: str, per_device_batch_size: int, mesh: Mesh) -> str:
    n_data = mesh.shape[DATA]
    return f"{desc} [global batch {per_device_batch_size * n_data} = {per_device_batch_size} x data {n_data}]"


def _n_batches(n: int, size: int, drop_last: bool) -> int:
    return n // size if drop_last else math.ceil(n / size)


def _padded_batches(examples, collate_fn, per_device_batch_size, mesh, order, start, desc, drop_last, wrap, prefetch):
    """Yields ``(global_batch, n_real)`` for batches ``start, start + 1, ...``
    of ``order``, made up to ``prefetch`` batches ahead. A short last batch is
    padded to full size (with the following examples, wrapping around, or with
    copies of its own last example) so every step sees one shape."""
    n = len(order)
    size = _global_batch_size(per_device_batch_size, mesh)
    n_batches = _n_batches(n, size, drop_last)
    lo, hi = local_rows(mesh, size)

    def make(b):  # in the prefetch thread
        rows = order[b * size:(b + 1) * size]
        n_real = len(rows)
        if n_real < size:
            fill = order[: size - n_real] if wrap else np.full(size - n_real, rows[-1])
            rows = np.concatenate([rows, fill])
        local = [examples[int(i)] for i in rows[lo:hi]]  # only the rows this process's devices hold
        return to_global(collate(collate_fn, local, hi - lo), mesh, size), n_real

    bar = tqdm(total=n_batches, initial=min(start, n_batches),
               desc=None if desc is None else _bar_title(desc, per_device_batch_size, mesh),
               disable=desc is None or jax.process_index() != 0, leave=False, dynamic_ncols=True)
    if not bar.disable:
        ACTIVE_BARS.append(bar)
    made = _prefetched(make, range(start, n_batches), prefetch)
    try:
        for item in made:
            yield item
            bar.update(1)
    finally:
        made.close()
        if bar in ACTIVE_BARS:
            ACTIVE_BARS.remove(bar)
        bar.close()


_DICT_OF_ARRAYS = (
    "For a dict of arrays (one row per example), make a list of per-example dicts: "
    "{name} = [dict(zip(d, row)) for row in zip(*d.values())]. For a Hugging Face DatasetDict, pick a split: d['train']."
)


def _check_examples(examples, name="examples"):
    """What `batches`, `evaluate` and `predict` accept as examples: anything
    with ``len()`` and integer ``[i]`` giving one example (a list, a tuple, a
    NumPy array's rows, a ``datasets.Dataset``, any ``Sequence``)."""
    kind = type(examples).__name__
    if isinstance(examples, Mapping):
        raise TypeError(
            f"{name} is a {kind} (keys {list(examples)[:5]}), but it must hold one item per example. "
            + _DICT_OF_ARRAYS.format(name=name)
        )
    if isinstance(examples, (str, bytes)):
        raise TypeError(f"{name} is a {kind}, not a sequence of examples: pass a list of examples, e.g. [{examples[:20]!r}].")
    if hasattr(examples, "iloc") and hasattr(examples, "columns"):  # a pandas DataFrame: [i] is a column
        raise TypeError(f"{name} is a {kind}, whose [i] picks a column, not a row: pass {name}.to_dict('records').")
    if not hasattr(examples, "__len__"):
        if hasattr(examples, "__iter__") or hasattr(examples, "__next__"):
            raise TypeError(
                f"{name} is a {kind} with no length (a generator or iterator can be read once, in one order; "
                f"batches needs len() and [i] to shuffle and to resume): wrap it as a list: {name} = list({name})."
            )
        raise TypeError(
            f"{name} must be a sequence of examples (a list, a tuple, a NumPy array of rows, a datasets.Dataset: "
            f"anything with len() and [i]), got a {kind}."
        )
    if not hasattr(examples, "__getitem__"):
        raise TypeError(
            f"{name} is a {kind}, which cannot be indexed with [i]: wrap it as a list: {name} = list({name})"
            " (sorted(...) for a set, so that every process sees one order)."
        )
    if getattr(examples, "ndim", None) == 0:
        raise TypeError(f"{name} is a 0-d {kind}; an array of examples needs one row per example.")
    if len(examples) == 0:
        raise ValueError(f"{name} is empty (a {kind} of length 0); pass at least one example.")


def _only_batches(made, warning: str | None):
    if warning is not None:  # from the loop's first next(): stacklevel 2 is the user's loop, past any wrapper
        warnings.warn(warning, stacklevel=2)
    with contextlib.closing(made):
        for batch, _ in made:
            yield batch


@typechecked
def batches(
    examples: Any,
    collate_fn: Callable[[list], Any],
    per_device_batch_size: int,
    mesh: Mesh,
    *,
    shuffle: bool = False,
    key=None,
    drop_last: bool | None = None,
    start: int = 0,
    desc: str | None = None,
    prefetch: int = DEFAULT_PREFETCH,
) -> Iterator[Any]:
    """Global batches of ``per_device_batch_size * data`` rows, split over the
    mesh's ``data`` axis and replicated over ``model``: one batch per
    optimizer step (``make_train_step(..., accumulate=k)`` splits it into
    ``k`` micro-batches inside the step).

    ``examples`` is anything with ``len()`` and integer ``[i]`` giving one
    example: a list, a tuple, a NumPy array (a row per example), a Hugging
    Face ``datasets.Dataset``. Each process collates only the rows its own
    devices hold (``collate_fn`` gets a list of examples and returns a dict
    of NumPy arrays, one row per example) and the rows become one global
    ``jax.Array`` per entry.

    - ``shuffle=True`` orders examples by ``jax.random.permutation(key, n)``;
      the same ``key`` gives the same order on every process and every run.
    - ``drop_last`` (default: ``shuffle``) drops a short last batch;
      otherwise it is filled up to full size with examples from the start of
      the order (as distributed samplers do), with a warning.
    - ``start=i`` skips the first ``i`` batches without collating them, to
      resume mid-epoch; the first batch yielded is batch ``i``.
    - ``desc`` shows a progress bar with that title and the global batch size
      (``epoch 0 [global batch 64 = 8 x data 8]``).
    - ``prefetch=2``: a background thread collates and sends to the devices
      up to that many batches ahead of the loop, so ``collate_fn`` overlaps
      the step; same batches, same order. ``collate_fn`` then runs in that
      thread (one call at a time, in order) and must return new arrays, not
      a buffer it reuses. Its errors are raised here, at the batch that
      failed. Leaving the loop early stops the thread. ``prefetch=0``:
      collate in the loop's thread, when asked.

    **Example:**

    ```python
    for epoch in range(n_epochs):
        for batch in redeqx.batches(train, collate_fn, 32, mesh, shuffle=True,
                                    key=jax.random.fold_in(key, epoch), desc=f"epoch {epoch}"):
            state, metrics = train_step(state, batch)
    ```

    To resume mid-epoch at batch ``s``, number the batches from ``s`` too, so
    the position you save is absolute:

    ```python
    for i, batch in enumerate(redeqx.batches(train, collate_fn, 32, mesh, shuffle=True, key=epoch_key,
                                             start=s), start=s):
        state, metrics = train_step(state, batch)
        manager.save(state, epoch=epoch, batch=i + 1)    # the next batch to run
    ```
    """
    mesh = check_mesh(mesh)
    _check_examples(examples)
    if not callable(collate_fn):
        raise TypeError(f"collate_fn must be a function list[example] -> dict of arrays, got {collate_fn!r}.")
    size = _global_batch_size(per_device_batch_size, mesh)
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise ValueError(f"start must be a batch index >= 0, got {start!r}.")
    prefetch = _check_prefetch(prefetch)
    if drop_last is None:
        drop_last = shuffle
    n = len(examples)
    if drop_last and n < size:
        raise ValueError(
            f"examples has {n} examples, fewer than one global batch of {size} (per_device_batch_size="
            f"{per_device_batch_size} x data={mesh.shape[DATA]}), so drop_last=True leaves no batch. "
            "Lower per_device_batch_size or pass drop_last=False."
        )
    warning = None
    if not drop_last and n % size:
        warning = (
            f"redeqx.batches: the last batch has {n % size} of {size} examples; it is filled up with "
            f"{size - n % size} examples from the start of the order. Pass drop_last=True to drop it instead."
        )
    n_batches = _n_batches(n, size, drop_last)
    if start > n_batches:
        raise ValueError(
            f"start={start} is past this epoch's {n_batches} batches ({n} examples, global batch {size} = "
            f"{per_device_batch_size} x data {mesh.shape[DATA]}, drop_last={drop_last}); start={n_batches} is an "
            "epoch already done. Resuming a run? Use the dataset, per_device_batch_size and n_model_shards it was "
            "saved with."
        )
    order = _order(n, shuffle, key)
    made = _padded_batches(examples, collate_fn, per_device_batch_size, mesh, order, start, desc, drop_last, True, prefetch)
    return _only_batches(made, warning)


@typechecked
def evaluate(
    eval_step: EvalStep,
    model,
    examples: Any,
    collate_fn: Callable,
    per_device_batch_size: int,
    mesh: Mesh,
    *,
    key,
    desc: str | None = None,
    prefetch: int = DEFAULT_PREFETCH,
    model_state=None,
) -> dict[str, float]:
    """The example-weighted mean of ``eval_step``'s metrics over every example
    (the last batch is padded and the padding gets weight 0). ``examples``,
    ``desc`` and ``prefetch`` are as in `batches`; ``model_state`` is the
    model's ``eqx.nn.State`` (``state.model_state``) for a model that has one.

    **Example:**

    ```python
    metrics = redeqx.evaluate(eval_step, state.model, test, collate_fn, 64, mesh, key=key)
    print(metrics["loss"])
    ```
    """
    if not isinstance(eval_step, EvalStep):
        raise TypeError(f"eval_step must come from redeqx.make_eval_step, got {type(eval_step).__name__}.")
    mesh = check_mesh(mesh)
    _check_examples(examples)
    prefetch = _check_prefetch(prefetch)
    size = _global_batch_size(per_device_batch_size, mesh)
    totals = None
    for i, (batch, n_real) in enumerate(_padded_batches(
        examples, collate_fn, per_device_batch_size, mesh, np.arange(len(examples)), 0, desc, False, False, prefetch
    )):
        weights = np.zeros(size, np.float32)
        weights[:n_real] = 1.0
        weights = to_global(weights[slice(*local_rows(mesh, size))], mesh, size)
        sums = eval_step.sums(model, batch, jax.random.fold_in(key, i), weights, model_state=model_state)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    return {k: float(v) / len(examples) for k, v in jax.device_get(totals).items()}


def to_host(tree):
    """Device arrays -> NumPy on every process (gathering across processes)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


@typechecked
def predict(
    predict_step: Callable,
    model,
    examples: Any,
    collate_fn: Callable,
    per_device_batch_size: int,
    mesh: Mesh,
    *,
    key,
    output_fn: Callable | None = None,
    desc: str | None = None,
    prefetch: int = DEFAULT_PREFETCH,
    model_state=None,
) -> list:
    """One output per example, in the order of ``examples``, on every process.

    The last batch is padded up to full size and the padding's outputs are
    dropped. Without ``output_fn`` each output is the example's row of every
    array ``pred_fn`` returned (NumPy); with it, ``output_fn(preds)`` turns a
    batch of NumPy predictions into a list of per-example outputs (e.g.
    decoded text). ``examples``, ``desc`` and ``prefetch`` are as in `batches`;
    ``model_state`` is passed on to the step for a model with state.

    **Example:**

    ```python
    labels = redeqx.predict(predict_step, state.model, test, collate_fn, 64, mesh, key=key)
    ```
    """
    mesh = check_mesh(mesh)
    _check_examples(examples)
    prefetch = _check_prefetch(prefetch)
    outputs: list = []
    state_kw = {} if model_state is None else {"model_state": model_state}

    def drain(pending):
        preds, n_real = pending
        preds = jax.tree.map(lambda x: np.asarray(x)[:n_real], to_host(preds))
        if output_fn is not None:
            got = list(output_fn(preds))
            if len(got) != n_real:
                raise ValueError(f"output_fn {_fn_name(output_fn)!r} returned {len(got)} outputs for {n_real} examples.")
            outputs.extend(got)
        else:
            outputs.extend(jax.tree.map(lambda x: x[j], preds) for j in range(n_real))

    pending = None
    for i, (batch, n_real) in enumerate(_padded_batches(
        examples, collate_fn, per_device_batch_size, mesh, np.arange(len(examples)), 0, desc, False, False, prefetch
    )):
        preds = predict_step(model, batch, jax.random.fold_in(key, i), **state_kw)
        if pending is not None:
            drain(pending)  # fetch the previous batch while this one computes
        pending = (preds, n_real)
    drain(pending)
    return outputs
