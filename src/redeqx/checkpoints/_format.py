"""The checkpoint format, and what every part of the package shares: the
names leaves get on disk, the errors, the metadata file (`save_checkpoint`
is in ``_save.py``, `restore_checkpoint` in ``_restore.py``, the checks in
``_integrity.py``; `CheckpointManager`, in ``_manager.py``, keeps a run's
directory of them).

A checkpoint is a directory written by orbax in one atomic commit (orbax
writes into ``<path>.orbax-checkpoint-tmp-*`` and renames it when every
process is done), holding three items:

- ``model/``: the model's arrays as a nested dict keyed by the model's
  attribute path (``layers / 0 / weight``), each device writing its own shards;
- ``train/``: ``opt_state`` (same naming), ``step``, and ``key`` (the PRNG key's
  raw ``uint32`` data) when a `TrainState` was saved;
- ``metadata/metadata``: strict JSON with ``step``, the caller's fields
  (``epoch``, ``batch``, ``metrics``, ...), and a ``redeqx`` section: format
  and its version, redeqx's version, each leaf's shape, dtype, checksum (a
  sum of its words) and content hash (a sum of its words each mixed with its
  place in the array, 64 bits as 16 hex digits), both the same on any
  layout and any number of processes.
  Strict JSON has no NaN: a non-finite number is written as the string
  ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (``float(s)`` reads it back).

A reader checks the format version: a checkpoint written in a newer format
than this redeqx knows is refused with an error, never read half right.

Reading one without redeqx (plain orbax and NumPy)::

    import orbax.checkpoint as ocp, numpy as np, json, jax
    params = ocp.PyTreeCheckpointer().restore(
        f"{path}/model",
        restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                  ocp.PyTreeCheckpointer().metadata(f"{path}/model").item_metadata.tree))
    params["layers"]["0"]["weight"]            # a NumPy array
    json.load(open(f"{path}/metadata/metadata"))
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._trees import is_array_like, path_parts
from ..state import TrainState

FORMAT = "redeqx-checkpoint"
FORMAT_VERSION = 1  # raise it when the layout on disk changes; readers refuse a newer one
TMP_MARKER = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read: the message names its path and the cause."""


class NewerFormatError(CheckpointError):
    """A checkpoint in a format newer than this redeqx reads (never a reason
    to fall back to an older checkpoint: that would drop the newer work)."""


# ----------------------------------------------------------------------------- trees


def array_leaves(tree) -> list[tuple[tuple[str, ...], Any]]:
    """``(attribute path parts, leaf)`` for every array (or abstract array) leaf."""
    return [(tuple(path_parts(kp)), x) for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0] if is_array_like(x)]


def nest(pairs) -> dict:
    """``[(("layers", "0", "weight"), x), ...]`` -> ``{"layers": {"0": {"weight": x}}}``."""
    out: dict = {}
    for parts, x in pairs:
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = x
    return out


def leaf_at(nested: dict, parts: tuple[str, ...]):
    """``nested[parts[0]][parts[1]]...``: the leaf `nest` put at ``parts``."""
    for p in parts:
        nested = nested[p]
    return nested


def train_view(state: TrainState) -> dict:
    """What a TrainState saves besides its model, named as on disk."""
    return {"opt_state": state.opt_state, "model_state": state.model_state, "step": state.step, "key": state.key}


def _train_states(tree) -> list[TrainState]:
    return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, TrainState)) if isinstance(x, TrainState)]


def step_of(state) -> int | None:
    """``state.step``; for a tree of TrainStates their common step; else None."""
    found = {int(s.step) for s in _train_states(state)}
    return found.pop() if len(found) == 1 else None


# ----------------------------------------------------------------------------- files and processes


def metadata_file(path: Path) -> Path:
    return path / "metadata" / "metadata"


def all_processes(local: list) -> list:
    """``local`` (JSON-able, one per process) from every process, in process order."""
    if jax.process_count() == 1:
        return [local]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(local).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([data.size], np.int64)).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    every = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[: int(n)]).decode()) for row, n in zip(every, sizes)]
