"""Grain input: `grain_batches` turns a Grain pipeline that gives each
process its own rows into global batches over the mesh's ``data`` axis, and
keeps the pipeline's position so `CheckpointManager` can save it with the
train state and a resumed run reads exactly the batches an uninterrupted
one reads.

Grain (``pip install grain``) is imported nowhere here: a Grain dataset is
recognised by what it does (``to_iter_dataset()``, an iterator with
``get_state`` / ``set_state``), so redeqx runs without it.

Position and prefetching: a background thread (`_data`'s) reads and places
batches ahead of the loop, so the Grain iterator is ahead of the loop too.
The thread reads the iterator's state right after each batch's rows and
hands it over with the batch; `GrainBatches.get_state` gives the state after
the last batch the loop took, never the read-ahead's.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ._data import collate, fn_name, local_rows, to_global
from ._prefetch import DEFAULT_PREFETCH, check_prefetch, prefetched
from ..mesh import DATA, check_mesh
from .._json import checkpointable, state_from_json, state_to_json
from .._typing import positive_int, short_repr, typechecked

def _grain_iterator(dataset):
    """A checkpointable iterator over ``dataset``: a ``MapDataset`` is read
    in order (``to_iter_dataset()``), a dataset or ``DataLoader`` through
    ``iter()``, an iterator as it is."""
    if callable(getattr(dataset, "to_iter_dataset", None)):
        dataset = dataset.to_iter_dataset()
    if not hasattr(dataset, "__next__") and hasattr(dataset, "__iter__"):
        dataset = iter(dataset)
    return checkpointable(dataset, "dataset")


# ----------------------------------------------------------------------------- the batches


def _own_batch(element, n_rows: int, global_batch: int):
    """``element`` (the dataset's batch of this process's rows) checked to
    hold ``n_rows`` rows, then checked as a collate_fn's output is."""
    for kp, leaf in jax.tree_util.tree_flatten_with_path(element)[0]:
        shape = np.shape(leaf)
        if shape[:1] != (n_rows,):
            raise ValueError(
                f"grain_batches: the dataset's element{jax.tree_util.keystr(kp)} has shape {shape}, but this "
                f"process holds {n_rows} rows of each global batch of {global_batch}: batch the dataset by "
                f"{n_rows} (dataset.batch({n_rows}, drop_remainder=True)), or give collate_fn= and let it give "
                "one example at a time."
            )

    def as_given(_):
        return element

    as_given.__name__ = "the dataset's own batch"
    return collate(as_given, [], n_rows)


class GrainBatches:
    """Global batches from a Grain pipeline; made by `grain_batches`.

    An iterator with ``get_state()`` / ``set_state(state)`` (JSON), as a
    Grain iterator has, so ``CheckpointManager.save(..., data_iterator=it)``
    saves where it is and ``restore(..., data_iterator=it)`` puts it back."""

    def __init__(self, iterator, collate_fn, per_device_batch_size: int, mesh: Mesh, prefetch: int):
        self._it = iterator
        self._collate_fn = collate_fn
        self._size = per_device_batch_size * mesh.shape[DATA]
        lo, hi = local_rows(mesh, self._size)
        self._n_rows = hi - lo
        self._mesh = mesh
        self._prefetch = prefetch
        self._state = iterator.get_state()  # the position after the last batch the loop took
        self._taken = 0
        self._made: Iterator | None = None
        self._ended = False

    def __repr__(self) -> str:
        return (f"grain_batches({type(self._it).__name__}, global batch {self._size}, "
                f"{self._n_rows} rows on this process, {self._taken} taken)")

    def _local_batches(self) -> Iterator[tuple[Any, Any]]:
        """``(this process's rows, collated; the iterator's state after them)``."""
        while True:
            if self._collate_fn is None:
                element = next(self._it, _END)
                if element is _END:
                    return
                local = _own_batch(element, self._n_rows, self._size)
            else:
                rows = list(itertools.islice(self._it, self._n_rows))
                if len(rows) < self._n_rows:
                    if rows:
                        warnings.warn(
                            f"redeqx.grain_batches: the dataset ended with {len(rows)} examples on process "
                            f"{jax.process_index()}, fewer than its {self._n_rows} rows of a batch; they are "
                            "dropped (every process must give the same number of batches).", stacklevel=2)
                    return
                local = collate(self._collate_fn, rows, self._n_rows)
            yield local, self._it.get_state()

    def _made_batches(self) -> Iterator[tuple[Any, Any]]:
        for local, state in self._local_batches():
            yield to_global(local, self._mesh, self._size), state

    def __iter__(self) -> GrainBatches:
        if self._ended:  # a second `for` over it would see no batch: an epoch of nothing, silently
            raise RuntimeError(
                f"{self!r} has ended: it reads its Grain dataset once, so a loop over it again would get no batch. "
                "For several epochs give the dataset .repeat(num_epochs) (and stop after the steps you want), or "
                "make a new grain_batches(...) for each epoch.")
        return self

    def __next__(self):
        if self._made is None:
            self._made = prefetched(self._made_batches(), self._prefetch)
        try:
            batch, self._state = next(self._made)
        except StopIteration:
            self._ended = True
            raise
        self._taken += 1
        return batch

    def close(self) -> None:
        """Stops the read-ahead thread (the batches it made are dropped)."""
        if self._made is not None:
            self._made.close()
            self._made = None

    def get_state(self) -> dict:
        """Where the loop is: the Grain iterator's state after the last batch
        taken (as JSON), and how many batches were taken."""
        return {"grain": state_to_json(self._state, f"{type(self._it).__name__}.get_state()"), "batches": self._taken}

    def set_state(self, state: dict) -> None:
        """Go back (or on) to ``state``, from `get_state`; the next batch is
        the one that followed it."""
        if not (isinstance(state, dict) and "grain" in state and isinstance(state.get("batches"), int)):
            raise ValueError(f"state must come from GrainBatches.get_state(), got {short_repr(state)}.")
        self.close()  # the read-ahead is at the old position
        grain_state = state_from_json(state["grain"])
        self._it.set_state(grain_state)
        self._state, self._taken = grain_state, state["batches"]


_END = object()


@typechecked
def grain_batches(
    dataset: Any,
    collate_fn: Callable[[list], Any] | None,
    per_device_batch_size: int,
    mesh: Mesh,
    *,
    prefetch: int = DEFAULT_PREFETCH,
) -> GrainBatches:
    """Global batches of ``per_device_batch_size * data`` rows from a Grain
    pipeline that gives each process its own rows, split over the mesh's
    ``data`` axis as `batches` splits them; an iterator whose position
    `CheckpointManager` saves and restores, so a resumed run reads exactly
    the batches an uninterrupted run reads.

    ``dataset`` is a ``grain.MapDataset`` (read in order), a
    ``grain.IterDataset`` (``mp_prefetch`` workers included), a
    ``grain.DataLoader``, or an iterator of one of them. Each process passes
    its own pipeline over its own share of the data (shard by
    ``jax.process_index()``: ``ds[jax.process_index()::jax.process_count()]``,
    or ``grain.sharding.ShardByJaxProcess(drop_remainder=True)``), and every
    process must give the same number of batches.

    - With ``collate_fn``, each element is one example: this process's rows of
      a batch are its next ``per_device_batch_size * (its data shards)``
      examples, collated as `batches` does. A short end is dropped, with a
      warning.
    - With ``collate_fn=None``, each element is already this process's rows
      of one batch (a dict of arrays, e.g. from ``ds.batch(n)``, batched in
      Grain's worker processes): its leading dim must be that many rows.
    - ``prefetch``: batches made ahead of the loop by a background thread, as
      in `batches`; the saved position is still the loop's.

    **Example:**

    ```python
    import grain
    ds = grain.MapDataset.source(train)[jax.process_index()::jax.process_count()]
    ds = ds.shuffle(seed=0).repeat().to_iter_dataset()
    it = redeqx.grain_batches(ds, collate_fn, 32, mesh)
    found = manager.restore(state, mesh, specs, data_iterator=it)
    if found is not None:
        state, meta = found
    for batch in it:
        state, metrics = train_step(state, batch)
        manager.save(state, data_iterator=it)
    ```
    """
    mesh = check_mesh(mesh)
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"collate_fn must be a function list[example] -> dict of arrays, or None, got "
                        f"{fn_name(collate_fn)}.")
    per_device_batch_size = positive_int(per_device_batch_size, "per_device_batch_size")
    return GrainBatches(_grain_iterator(dataset), collate_fn, per_device_batch_size, mesh, check_prefetch(prefetch))
