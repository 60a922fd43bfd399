"""The data position a checkpoint keeps, for an exact resume: ``epoch``,
``batch`` (the next batch to run, as ``batches(..., start=batch)``),
``data_key``, the mesh's ``data`` size and ``per_device_batch_size`` (what
turn a batch index into an example), and each process's data iterator
position. `position` gives the fields `CheckpointManager.save` writes;
`warn_moved_position` and `restore_position` read them back."""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
from jax.sharding import Mesh

from .._json import state_from_json, state_to_json
from ..mesh import DATA
from .._typing import positive_int
from ._format import all_processes


def data_shards_of(state) -> int | None:
    """The ``data`` axis size of the mesh ``state`` lives on (what turns a
    batch index into a position in the data), if its arrays say."""
    for x in jax.tree.leaves(state):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if mesh is not None and DATA in getattr(mesh, "axis_names", ()):
            return int(mesh.shape[DATA])
    return None


def warn_moved_position(meta: dict, mesh: Mesh, path: Path, per_device_batch_size: int | None) -> None:
    """A mid-epoch position is a batch index, and a batch is
    ``per_device_batch_size * data`` examples: with another global batch,
    ``batches(..., start=batch)`` starts at another example. When both runs
    said their ``per_device_batch_size`` the global batches are compared (a
    scaled one that keeps the global batch is quiet); otherwise only the
    ``data`` sizes can be, and the warning says what it could not check."""
    batch, saved, now = meta.get("batch", 0), meta.get("data_shards"), mesh.shape[DATA]
    saved_pdbs = meta.get("per_device_batch_size")
    if not batch or saved is None:
        return
    if saved_pdbs is not None and per_device_batch_size is not None:
        before, after = saved_pdbs * saved, per_device_batch_size * now
        if before == after:
            return
        first = batch * before
        exact = f"batches(..., start={first // after})" if first % after == 0 else "no start (it falls mid-batch)"
        warnings.warn(
            f"redeqx.CheckpointManager: {path.name} was saved mid-epoch (next batch {batch}) with a global batch of "
            f"{before} examples (per_device_batch_size={saved_pdbs} x data={saved}); here it is {after} "
            f"(per_device_batch_size={per_device_batch_size} x data={now}), so batches(..., start={batch}) would "
            f"start at example {batch * after}, not {first}, skipping or repeating examples of this epoch. "
            f"Example {first} starts {exact}; or keep the global batch ({before}), or restart the epoch (start=0).",
            stacklevel=5,  # warn_moved_position, read, first_readable, restore, its caller
        )
        return
    if saved != now:
        warnings.warn(
            f"redeqx.CheckpointManager: {path.name} was saved mid-epoch (next batch {batch}) on a mesh with "
            f"data={saved}, and this mesh has data={now}: with the same per_device_batch_size a batch is "
            f"{now}/{saved} as many examples, so batches(..., start={batch}) would skip or repeat examples "
            "of this epoch. Resume on the same data size to finish the epoch, scale per_device_batch_size by "
            f"{saved}/{now}, or restart the epoch (start=0). (Pass per_device_batch_size= to save() and restore() "
            "and this is checked exactly, quiet when the global batch is the same.)",
            stacklevel=5,  # warn_moved_position, read, first_readable, restore, its caller
        )


DATA_ITERATOR = "data_iterator"  # the metadata entry: one saved position per process, in process order


def restore_position(data_iterator, meta: dict, path: Path) -> None:
    """Sets ``data_iterator`` to this process's position saved in ``meta``."""
    saved = meta.get(DATA_ITERATOR)
    if saved is None:
        raise ValueError(
            f"restore(..., data_iterator=...): {path.name} holds no data iterator position (it was saved without "
            "save(..., data_iterator=...)). Restore without data_iterator= and start the data where you choose."
        )
    if len(saved) != jax.process_count():
        raise ValueError(
            f"restore(..., data_iterator=...): {path.name} holds the data positions of {len(saved)} processes, and "
            f"this run has {jax.process_count()}: each process's Grain pipeline read its own share of the data, so "
            f"the positions do not carry over. Resume on {len(saved)} processes, or restore without data_iterator= "
            "and start the data again."
        )
    data_iterator.set_state(state_from_json(saved[jax.process_index()]))


def position(state, *, epoch: int, batch: int, data_key, per_device_batch_size: int | None, data_iterator) -> dict:
    """The metadata fields that say where ``state``'s run is in its data.
    With ``data_iterator``, every process's position is gathered (a
    collective: every process calls it)."""
    fields: dict = {"epoch": epoch, "batch": batch}
    if data_key is not None:
        fields["data_key"] = data_key
    if per_device_batch_size is not None:
        fields["per_device_batch_size"] = positive_int(per_device_batch_size, "per_device_batch_size")
    if (n_data := data_shards_of(state)) is not None:
        fields["data_shards"] = n_data
    if data_iterator is not None:  # each process's position, in process order
        fields[DATA_ITERATOR] = [p[0] for p in all_processes([state_to_json(data_iterator.get_state())])]
    return fields
