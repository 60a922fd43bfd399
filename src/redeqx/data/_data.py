"""Host-side data: examples -> collated NumPy -> global sharded batches (the
`evaluate` / `predict` loops over them are ``_inference.py``'s).

One pipeline serves `batches`, `evaluate` and `predict`: a batch's rows are picked from the (shuffled)
order, this process collates its own rows, and they become global arrays
split over ``data``. A background thread runs that pipeline up to
``prefetch`` batches ahead of the loop, so collating batch ``i + 1`` overlaps
step ``i``.

Examples come in two kinds. A sequence (``len()`` and ``[i]``) is indexed
through an order, a permutation when shuffled. A stream (anything else that
can be iterated: a generator, a reader whose ``__iter__`` reads files, a
Hugging Face ``IterableDataset``) is read in its own order, the same on every
process: each process reads every example and collates only its own rows,
the very rows the sequence path gives for that order, and ``start=b`` reads
past ``b`` global batches without collating them. `shuffled` is a seeded
buffer shuffle for streams.

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
import itertools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, MappingView, Sequence, Set
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from .. import _progress
from ._batch import narrow_64bit
from ._prefetch import DEFAULT_PREFETCH, check_prefetch, prefetched
from ..context import batch_spec, check_seq_keys, check_whole_keys, order_sequences
from ..mesh import DATA, check_mesh
from .._typing import positive_int, typechecked


def fn_name(fn) -> str:
    return getattr(fn, "__name__", repr(fn))


def collate(collate_fn: Callable, examples: list, n_rows: int):
    """Runs ``collate_fn`` and checks it gave a tree of numeric arrays with
    ``n_rows`` rows each."""
    out = collate_fn(examples)
    # a list is one (maybe ragged) array's rows, not a container
    is_leaf = lambda x: isinstance(x, list)  # noqa: E731
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_leaf)
    if not leaves_with_path:
        raise ValueError(f"collate_fn {fn_name(collate_fn)!r} returned no arrays (got {out!r}).")
    checked = []
    for kp, leaf in leaves_with_path:
        where = f"collate_fn {fn_name(collate_fn)!r} output{jax.tree_util.keystr(kp)}"
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
        checked.append(narrow_64bit(arr, where))
    return jax.tree.unflatten(treedef, checked)



def local_rows(mesh: Mesh, global_batch: int) -> tuple[int, int]:
    """The contiguous range of a global batch's rows that this process's
    devices hold when the batch is split over ``data``."""
    n_data = mesh.shape[DATA]
    per = global_batch // n_data
    me = jax.process_index()
    rows = np.moveaxis(mesh.devices, mesh.axis_names.index(DATA), 0)  # data leads (a 'stage' axis may be first)
    mine = [i for i in range(n_data) if any(d.process_index == me for d in rows[i].flat)]
    lo, hi = min(mine), max(mine) + 1
    if hi - lo != len(mine):
        raise ValueError("this process's devices are not contiguous on the mesh's data axis; build it with make_mesh.")
    return lo * per, hi * per


def to_global(local_batch, mesh: Mesh, global_batch: int, seq_keys: tuple[str, ...] = (),
              whole_keys: tuple[str, ...] = ()):
    """This process's rows -> global arrays split over ``data`` (and the
    ``seq_keys`` entries' dim 1 over ``context``, put in its order first;
    ``whole_keys``: as in `batches`)."""
    local_batch = order_sequences(local_batch, seq_keys, mesh, whole_keys)

    def one(kp, x):
        seq = bool(kp) and getattr(kp[0], "key", None) in seq_keys
        sharding = NamedSharding(mesh, batch_spec(x.ndim, mesh, seq))
        return jax.make_array_from_process_local_data(sharding, x, (global_batch, *x.shape[1:]))

    return jax.tree_util.tree_map_with_path(one, local_batch)


def global_batch_size(per_device_batch_size, mesh) -> int:
    per_device_batch_size = positive_int(per_device_batch_size, "per_device_batch_size")
    return per_device_batch_size * mesh.shape[DATA]


def _order(n: int, shuffle: bool, key) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    if key is None:
        raise ValueError("shuffle=True needs key=: pass e.g. key=jax.random.fold_in(key, epoch) for a new order each epoch.")
    return np.asarray(jax.random.permutation(key, n))


def _bar_title(desc: str, per_device_batch_size: int, mesh: Mesh) -> str:
    n_data = mesh.shape[DATA]
    return f"{desc} [global batch {per_device_batch_size * n_data} = {per_device_batch_size} x data {n_data}]"


def _n_batches(n: int, size: int, drop_last: bool) -> int:
    return n // size if drop_last else math.ceil(n / size)


# -- the rows of each batch: (this process's examples, how many of the batch's rows are real)


def _sequence_rows(examples, order, per_device_batch_size, mesh, start, drop_last, wrap) -> Iterator[tuple[list, int]]:
    """Batches ``start, start + 1, ...`` of ``examples[order]``. A short last
    batch is padded to full size (with the order's first examples, cycling
    through them when it holds fewer than the padding, or with copies of its
    own last example) so every step sees one shape."""
    size = global_batch_size(per_device_batch_size, mesh)
    lo, hi = local_rows(mesh, size)
    for b in range(start, _n_batches(len(order), size, drop_last)):
        rows = order[b * size:(b + 1) * size]
        n_real = len(rows)
        if n_real < size:
            fill = np.resize(order, size - n_real) if wrap else np.full(size - n_real, rows[-1])
            rows = np.concatenate([rows, fill])
        yield [examples[int(i)] for i in rows[lo:hi]], n_real  # only the rows this process's devices hold


def _stream_rows(examples, per_device_batch_size, mesh, start, drop_last, wrap) -> Iterator[tuple[list, int]]:
    """`_sequence_rows` for a stream, read once in its own order: the same
    rows, the same padding (the stream's first global batch is kept to fill
    a short last one). The batches before ``start`` are read, not collated.
    What only the end of the stream tells (it was empty, too short for
    ``drop_last``, or ended before ``start``) is raised there."""
    size = global_batch_size(per_device_batch_size, mesh)
    lo, hi = local_rows(mesh, size)
    stream = iter(examples)
    first: list = []
    n = 0
    try:
        for b in itertools.count():
            rows = list(itertools.islice(stream, size))
            n += len(rows)
            if b == 0:
                first = rows
            if len(rows) < size:
                break
            if b >= start:
                yield rows[lo:hi], size
        if n == 0:
            raise ValueError(
                f"examples (a {type(examples).__name__}) gave no examples. A generator or iterator is read once, so "
                "one already read gives nothing: make a new one for every call (batches(read(path), ...)), or pass "
                "an object whose __iter__ starts over (a reader class, a Hugging Face IterableDataset)."
            )
        _check_length(n, size, per_device_batch_size, mesh, drop_last, start)
        if rows and not drop_last and b >= start:
            n_real = len(rows)
            fill = [first[i % len(first)] for i in range(size - n_real)] if wrap else [rows[-1]] * (size - n_real)
            rows = rows + fill
            yield rows[lo:hi], n_real
    finally:
        if hasattr(stream, "close"):  # a reader's open file is closed now, not when collected; a generator
            stream.close()  # passed in is used up, so passing it again is an error, not a resume from a read-ahead


def _check_length(n, size, per_device_batch_size, mesh, drop_last, start) -> None:
    """``n`` examples in batches of ``size`` give at least one batch, and ``start`` is within them."""
    if drop_last and n < size:
        raise ValueError(
            f"examples has {n} examples, fewer than one global batch of {size} (per_device_batch_size="
            f"{per_device_batch_size} x data={mesh.shape[DATA]}), so drop_last=True leaves no batch. "
            "Lower per_device_batch_size or pass drop_last=False."
        )
    n_batches = _n_batches(n, size, drop_last)
    if start > n_batches:
        raise ValueError(
            f"start={start} is past this epoch's {n_batches} batches ({n} examples, global batch {size} = "
            f"{per_device_batch_size} x data {mesh.shape[DATA]}, drop_last={drop_last}); start={n_batches} is an "
            "epoch already done. Resuming a run? Use the dataset, per_device_batch_size and n_model_shards it was "
            "saved with."
        )


def _padded_batches(rows: Iterator[tuple[list, int]], collate_fn, per_device_batch_size, mesh, n_batches, start, desc,
                    prefetch, seq_keys: tuple[str, ...] = (), whole_keys: tuple[str, ...] = ()):
    """Yields ``(global_batch, n_real)`` for each ``(examples, n_real)`` of
    ``rows``: this process's examples collated and made one global batch,
    up to ``prefetch`` batches ahead. ``n_batches`` is the progress bar's
    total (None for a stream: a bar without a total)."""
    size = global_batch_size(per_device_batch_size, mesh)

    def made():  # in the prefetch thread
        with contextlib.closing(rows):
            for local, n_real in rows:
                yield to_global(collate(collate_fn, local, len(local)), mesh, size, seq_keys, whole_keys), n_real

    bar = tqdm(total=n_batches, initial=start if n_batches is None else min(start, n_batches),
               desc=None if desc is None else _bar_title(desc, per_device_batch_size, mesh),
               disable=desc is None or jax.process_index() != 0, leave=False, dynamic_ncols=True)
    if not bar.disable:
        _progress.opened(bar)  # where `Logger.log` shows the loss
    batches = prefetched(made(), prefetch)
    try:
        for item in batches:
            yield item
            bar.update(1)
    finally:
        batches.close()
        _progress.closed(bar)
        bar.close()


_DICT_OF_ARRAYS = (
    "For a dict of arrays (one row per example), make a list of per-example dicts: "
    "{name} = [dict(zip(d, row)) for row in zip(*d.values())]. For a Hugging Face DatasetDict, pick a split: d['train']."
)


def check_examples(examples, name="examples") -> bool:
    """What `batches`, `evaluate` and `predict` accept as examples; returns
    whether they are a sequence (True) or a stream (False).

    A sequence has ``len()`` and integer ``[i]`` giving one example (a list,
    a tuple, a NumPy array's rows, a ``datasets.Dataset``, any
    ``Sequence``). A stream is anything else that iterates over examples in
    one order (a generator, a reader class, a ``datasets.IterableDataset``).
    A set iterates in an order that can differ between processes, so it is
    neither."""
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
    if isinstance(examples, (Set, MappingView)):
        raise TypeError(
            f"{name} is a {kind}, which has no order of its own (it can differ between processes and runs): pass a "
            f"sorted list: {name} = sorted({name})."
        )
    if hasattr(examples, "__len__") and hasattr(examples, "__getitem__"):
        if getattr(examples, "ndim", None) == 0:
            raise TypeError(f"{name} is a 0-d {kind}; an array of examples needs one row per example.")
        if len(examples) == 0:
            raise ValueError(f"{name} is empty (a {kind} of length 0); pass at least one example.")
        return True
    if hasattr(examples, "__iter__"):
        return False
    raise TypeError(
        f"{name} must be a sequence of examples (a list, a tuple, a NumPy array of rows, a datasets.Dataset: "
        "anything with len() and [i]) or a stream of them (a generator, a reader with __iter__, a "
        f"datasets.IterableDataset), got a {kind}."
    )


_STREAM_SHUFFLE = (
    "shuffle=True draws a permutation of the examples, which needs len() and [i]; examples is a {kind}, a stream. "
    "Shuffle it as it is read, with a seeded buffer: batches(redeqx.shuffled(examples, buffer_size=10_000, key=key), "
    "..., drop_last=True), a new key each epoch (jax.random.fold_in(key, epoch)); or with the stream's own shuffle "
    "(a Hugging Face IterableDataset: ds.shuffle(seed=..., buffer_size=...) and ds.set_epoch(epoch)); or make it a "
    "list if it fits in memory."
)


def _fill_warning(n_real: int, size: int) -> str:
    return (
        f"redeqx.batches: the last batch has {n_real} of {size} examples; it is filled up with "
        f"{size - n_real} examples from the start of the order. Pass drop_last=True to drop it instead."
    )


def _only_batches(made, warning: str | None, stream_size: int | None = None):
    """The batches of ``made``, warning (the user's loop is stacklevel 2,
    past any wrapper) at the first one when ``warning`` is given, or at a
    stream's short last batch, known only when it comes."""
    if warning is not None:
        warnings.warn(warning, stacklevel=2)
    with contextlib.closing(made):
        for batch, n_real in made:
            if stream_size is not None and n_real < stream_size:
                warnings.warn(_fill_warning(n_real, stream_size), stacklevel=2)
            yield batch


def _check_batches_args(collate_fn, mesh: Mesh, start, prefetch, seq_keys, whole_keys):
    """`batches`' ``collate_fn`` and ``start`` checked; ``(seq_keys, whole_keys, prefetch)`` as it uses them."""
    if not callable(collate_fn):
        raise TypeError(f"collate_fn must be a function list[example] -> dict of arrays, got {collate_fn!r}.")
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise ValueError(f"start must be a batch index >= 0, got {start!r}.")
    seq_keys = check_seq_keys(seq_keys, mesh)
    return seq_keys, check_whole_keys(whole_keys, seq_keys), check_prefetch(prefetch)


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
    seq_keys: Sequence[str] | str | None = None,
    whole_keys: Sequence[str] | str | None = None,
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

    ``examples`` can also be a stream, for data that does not fit in memory:
    anything iterable without ``len()`` and ``[i]``, such as a generator, a
    reader class whose ``__iter__`` reads files, or a Hugging Face
    ``datasets.IterableDataset``. It is read in its own order, which must be
    the same on every process and in every run (sort file names: a directory
    listing's order is not), since each process reads every example and
    collates only its own rows: the rows a list in that order gives. Make
    reading cheap (file names, raw lines) and do the decoding in
    ``collate_fn``, which runs on this process's rows only. A generator is
    read once (to the end, or closed when the loop stops): make a new one for
    every call, or pass an object whose ``__iter__`` starts over.

    - ``shuffle=True`` orders examples by ``jax.random.permutation(key, n)``;
      the same ``key`` gives the same order on every process and every run.
      A stream has no ``n``: shuffle it with `shuffled` (a seeded buffer) or
      its own shuffle; ``shuffle=True`` on one is an error saying so.
    - ``drop_last`` (default: ``shuffle``) drops a short last batch;
      otherwise it is filled up to full size with examples from the start of
      the order (as distributed samplers do), with a warning (for a stream,
      when that batch comes).
    - ``start=i`` skips the first ``i`` batches without collating them, to
      resume mid-epoch; the first batch yielded is batch ``i``. A stream is
      read past ``i`` global batches (``i * per_device_batch_size * data``
      examples) to get there.
    - ``desc`` shows a progress bar with that title and the global batch size
      (``epoch 0 [global batch 64 = 8 x data 8]``); for a stream, without a
      total.
    - ``prefetch=2``: a background thread collates and sends to the devices
      up to that many batches ahead of the loop, so ``collate_fn`` overlaps
      the step; same batches, same order. ``collate_fn`` (and a stream's
      reading) then runs in that thread (one call at a time, in order) and
      must return new arrays, not a buffer it reuses. Its errors are raised
      here, at the batch that failed. Leaving the loop early stops the
      thread. ``prefetch=0``: collate in the loop's thread, when asked.
    - ``seq_keys``: on a mesh with a ``context`` axis (``make_mesh(...,
      n_context_shards=C)``), the keys of the (dict) batch whose dim 1 is the
      sequence; required there. Their sequences are put in the dual-chunk
      order (`redeqx.context_order`) on the host and split over ``context``;
      other keys stay whole. Every per-token key belongs there (``labels``,
      a loss mask, position ids): a key left out whose dim 1 is as long as
      the sequence is an error, since it would no longer line up. Labels
      must come shifted from ``collate_fn`` (docs/guides/long_context.md).
      Without a ``context`` axis it changes nothing.
    - ``whole_keys``: the keys whose dim 1 only happens to be as long as the
      sequence but is not one entry per token (a ``(batch, 64)`` feature
      vector beside 64-token sequences): kept whole, in their own order.

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

    The same loop over a stream (one JSON example a line, never all in
    memory), shuffled through a buffer:

    ```python
    def read_jsonl(path):
        with open(path) as f:
            yield from map(json.loads, f)

    stream = redeqx.shuffled(read_jsonl("train.jsonl"), 10_000, key=epoch_key)   # a new one each epoch
    for i, batch in enumerate(redeqx.batches(stream, collate_fn, 32, mesh, drop_last=True, start=s), start=s):
        ...
    ```
    """
    mesh = check_mesh(mesh)
    sequence = check_examples(examples)
    seq_keys, whole_keys, prefetch = _check_batches_args(collate_fn, mesh, start, prefetch, seq_keys, whole_keys)
    size = global_batch_size(per_device_batch_size, mesh)
    if drop_last is None:
        drop_last = shuffle
    if not sequence:
        if shuffle:
            raise ValueError(_STREAM_SHUFFLE.format(kind=type(examples).__name__))
        rows = _stream_rows(examples, per_device_batch_size, mesh, start, drop_last, True)
        made = _padded_batches(rows, collate_fn, per_device_batch_size, mesh, None, start, desc, prefetch, seq_keys,
                               whole_keys)
        return _only_batches(made, None, stream_size=size)
    n = len(examples)
    _check_length(n, size, per_device_batch_size, mesh, drop_last, start)
    warning = _fill_warning(n % size, size) if not drop_last and n % size else None
    order = _order(n, shuffle, key)
    rows = _sequence_rows(examples, order, per_device_batch_size, mesh, start, drop_last, True)
    made = _padded_batches(rows, collate_fn, per_device_batch_size, mesh, _n_batches(n, size, drop_last), start, desc,
                           prefetch, seq_keys, whole_keys)
    return _only_batches(made, warning)


def every_example(examples, collate_fn, per_device_batch_size, mesh, desc, prefetch, seq_keys: tuple[str, ...] = (),
                   whole_keys: tuple[str, ...] = ()):
    """``(global_batch, n_real)`` for `evaluate` and `predict`: every example
    once, in order, the last batch padded with copies of its last example;
    ``seq_keys`` and ``whole_keys`` (checked by the caller) as `batches` takes them."""
    if check_examples(examples):
        n = len(examples)
        rows = _sequence_rows(examples, np.arange(n), per_device_batch_size, mesh, 0, False, False)
        n_batches = _n_batches(n, global_batch_size(per_device_batch_size, mesh), False)
    else:
        rows, n_batches = _stream_rows(examples, per_device_batch_size, mesh, 0, False, False), None
    return _padded_batches(rows, collate_fn, per_device_batch_size, mesh, n_batches, 0, desc, check_prefetch(prefetch),
                           seq_keys, whole_keys)


def to_host(tree):
    """Device arrays -> NumPy on every process (gathering across processes)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)
