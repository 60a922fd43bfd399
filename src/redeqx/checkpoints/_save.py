"""Writing with orbax: `encode` turns a state into orbax's items and the
metadata JSON, `write` starts the write (a failure leaves nothing behind),
`save_checkpoint` is the two for one checkpoint."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jaxtyping import PyTree

from .. import _hooks
from .._failures import describe_failure
from .._json import dumps, is_key as _is_key, to_json as _to_json
from ..mesh import refuse_deleted
from ..state import TrainState
from .._version import __version__
from .._typing import floating_dtype, typechecked
from ._format import (
    FORMAT,
    FORMAT_VERSION,
    TMP_MARKER,
    CheckpointError,
    array_leaves,
    metadata_file,
    nest,
    step_of,
    train_view,
)
from ._hashing import HASH, fingerprints
from ._integrity import FIELDS_HASH, fields_hash


def check_dtype(dtype):
    return floating_dtype(dtype, "dtype")


def _cast(x, dtype):
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
        return x
    return x.astype(dtype)


def _items(state) -> dict[str, list[tuple[tuple[str, ...], Any]]]:
    """The arrays to save, per orbax item, with the names they get on disk
    (PRNG keys still as keys: `encode` stores their raw data)."""
    if isinstance(state, TrainState):
        return {"model": array_leaves(state.model), "train": array_leaves(train_view(state))}
    if _is_key(state):
        raise TypeError("state must be a redeqx.TrainState, a model or a pytree of them, got a PRNG key.")
    return {"model": array_leaves(state)}


class Encoded(NamedTuple):
    """A state turned into what orbax writes."""

    args: ocp.args.Composite  # the orbax items
    metadata: dict  # the JSON written with them
    non_finite: list[str]  # floating leaves holding NaN or inf, as ``item/path``


def _arrays(state, dtype) -> tuple[dict[str, list[tuple[tuple[str, ...], jax.Array]]], dict[str, dict[str, str]]]:
    """The arrays to write per orbax item (cast to ``dtype``, PRNG keys as
    their raw data), and the implementation of each key, by item and name."""
    impls: dict[str, dict[str, str]] = {}
    items = {}
    for name, pairs in _items(state).items():
        out = []
        for parts, x in pairs:
            if _is_key(x):
                impls.setdefault(name, {})[".".join(parts)] = str(jax.random.key_impl(x))
                x = jax.random.key_data(x)
            out.append((parts, _cast(x, dtype)))
        items[name] = out
    for name, pairs in items.items():
        for parts, x in pairs:
            if not isinstance(x, jax.Array):
                raise TypeError(
                    f"state leaf {'.'.join(parts)} is a {type(x).__name__}; save concrete arrays (an abstract "
                    "tree from eqx.filter_eval_shape has nothing to save)."
                )
    if not any(items.values()):
        raise ValueError("state has no arrays to save: pass a redeqx.TrainState, a model, or a pytree of them.")
    return items, impls


def encode(state, metadata, dtype, finite: bool = True) -> Encoded:
    """``state`` -> what orbax writes, and the metadata JSON. Blocks only for
    the checksums (and, with ``finite``, the leaves holding NaN or inf, from
    the same pass)."""
    if isinstance(state, TrainState) and not _is_key(state.key):
        raise TypeError("state.key must be a typed PRNG key (jax.random.key(seed)).")
    items, impls = _arrays(state, check_dtype(dtype))
    user = _to_json(dict(metadata or {}), "metadata")
    own_step = step_of(state)
    step = own_step if own_step is not None else user.get("step", 0)
    if "redeqx" in user or ("step" in user and own_step is not None and user["step"] != step):
        raise ValueError(
            f"metadata may not set 'redeqx' or a 'step' other than state.step ({step}); got keys {sorted(user)}."
        )
    named = [(name, ".".join(parts), x) for name, pairs in items.items() for parts, x in pairs]
    sums, hashes, ok = fingerprints([x for _, _, x in named], finite=finite)
    info: dict[str, dict] = {name: {} for name in items}
    for (name, path, x), checksum, digest in zip(named, sums, hashes):
        entry = {"shape": list(x.shape), "dtype": str(x.dtype), "checksum": checksum, HASH: digest}
        impl = impls.get(name, {}).get(path)
        if impl is not None:
            entry["prng_key"] = impl
        info[name][path] = entry
    meta = {
        **user,
        "step": step,
        "redeqx": {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version": __version__,
            "kind": "train_state" if isinstance(state, TrainState) else "model",
            "key_impl": str(jax.random.key_impl(state.key)) if isinstance(state, TrainState) else None,
            "leaves": info,
        },
    }
    meta["redeqx"][FIELDS_HASH] = fields_hash(json.loads(json.dumps(meta, allow_nan=False)))
    args = {name: ocp.args.StandardSave(nest(pairs)) for name, pairs in items.items()}
    args["metadata"] = ocp.args.JsonSave(meta)
    non_finite = [f"{name}/{path}" for (name, path, _), good in zip(named, ok) if not good]
    return Encoded(ocp.args.Composite(**args), meta, non_finite)


_AT_EXIT = ("after shutdown", "after interpreter shutdown", "Event loop is closed")


def write_failed(path: Path, e: BaseException) -> CheckpointError:
    cause = describe_failure(e)
    if any(marker in cause for marker in _AT_EXIT):
        fix = ("Python was exiting and had stopped the writer's threads: call manager.close() (or use `with "
               "redeqx.CheckpointManager(...) as manager:`) before the script ends.")
    else:
        fix = "Free space or fix the permissions of that directory (or give another one) and save again."
    return CheckpointError(
        f"could not write the checkpoint to {path}: {cause}. The checkpoints already in {path.parent} are untouched "
        f"and restorable, and the state in memory is still usable. {fix}"
    )


def _probe(directory: Path) -> None:
    """Writes and deletes a small file in ``directory``: a read-only, full or
    forbidden directory fails here, before orbax starts writer threads that
    would wait minutes for a directory that never appears."""
    probe = directory / f".redeqx-write-probe-{os.getpid()}-{jax.process_index()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


class _OwnWriteErrors(logging.Filter):
    """Drops the records orbax's writer threads log, with their whole
    traceback (~100 lines each, several per failed save), for a failure of
    a save redeqx is making: the same error reaches the caller as one
    `CheckpointError` naming the path and the cause. Any other record, and
    any other save's, passes. Installed on the ``absl`` and ``asyncio``
    loggers by the first `write` (``_hooks.quiet_orbax_echoes``)."""

    def __init__(self):
        super().__init__()
        self.paths: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not self.paths:
            return True
        text = record.getMessage() + (f" {record.exc_info[1]}" if record.exc_info and record.exc_info[1] else "")
        if "_SignalingThread.run() raised" in text and any(m in text for m in _AT_EXIT):
            return False  # a save cut off by Python's exit, which names no path: redeqx's exit hook reports it
        return not any(p in text for p in self.paths)


_OWN_WRITE_ERRORS = _OwnWriteErrors()


def _mute_orbax_errors_for(path: Path) -> None:
    _hooks.quiet_orbax_echoes(_OWN_WRITE_ERRORS)  # the first write installs it
    _OWN_WRITE_ERRORS.paths.add(str(path))  # orbax names the checkpoint or its temporary directory


def write(checkpointer, path: Path, args) -> None:
    """Starts (an async checkpointer) or does the write of ``args`` to ``path``;
    a failure removes what it left and raises a `CheckpointError`."""
    _mute_orbax_errors_for(path)
    _hooks.count_orbax_bytes_without_leaking()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _probe(path.parent)
        checkpointer.save(path, args=args)
    except Exception as e:
        remove_partial(path)
        raise write_failed(path, e) from e


def remove_partial(path: Path) -> None:
    """Deletes what a failed save left in orbax's temporary directory. Its
    writer threads may still be finishing, so look again until it stays gone."""
    if jax.process_index() != 0 or not path.parent.is_dir():
        return
    for _ in range(50):
        try:
            leftovers = [p for p in path.parent.iterdir() if p.name.startswith(path.name + TMP_MARKER)]
        except OSError:
            return
        if not leftovers:
            return
        for p in leftovers:
            shutil.rmtree(p, ignore_errors=True)
        time.sleep(0.05)


@typechecked
def save_checkpoint(
    path: str | os.PathLike,
    state: PyTree,
    *,
    metadata: Mapping[str, Any] | None = None,
    dtype=None,
) -> Path:
    """Save ``state`` (a `TrainState`, or a bare model) to the new directory
    ``path`` with orbax, and return the path.

    Each device writes its own shards (nothing is gathered on one host), and
    the directory appears only once everything is written (orbax writes to a
    temporary directory and renames it), so a save killed midway leaves no
    ``path`` behind. The model's arrays are stored under their attribute paths
    (``layers/0/weight``); the optimizer state, ``step`` and the PRNG key (as its
    raw ``uint32`` data) under ``train/``.

    - ``metadata``: JSON-able fields to keep with it (``epoch``, ``batch``,
      ``metrics``...; arrays become lists and PRNG keys are kept as keys), read
      back with `read_metadata`. ``step`` is added from ``state.step``.
    - ``dtype=jnp.bfloat16`` casts every floating leaf before writing (half
      the bytes); `restore_checkpoint` casts back to the dtypes of ``like``.
    - A write that fails (a full disk, no permission) raises a
      `CheckpointError` naming ``path`` and the cause, and leaves nothing
      behind; ``state`` is untouched. Unlike `CheckpointManager.save`, a state
      holding NaN or inf is written as asked.

    **Example:**

    ```python
    redeqx.save_checkpoint("run/ckpt_100", state, metadata={"epoch": 1, "batch": 0})
    ```
    """
    path = Path(path).absolute()  # orbax refuses relative paths
    if path.exists():
        raise CheckpointError(f"{path} already exists; save to a new path or delete the old checkpoint first.")
    refuse_deleted(state, "state")
    encoded = encode(state, metadata, dtype, finite=False)  # written as asked, NaN or not
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        write(checkpointer, path, encoded.args)
    return path


def rewrite_metadata(path: Path, meta: dict) -> None:
    """Replaces the metadata of the complete checkpoint at ``path`` with
    ``meta`` (process 0 writes), in one atomic rename: the checkpoint is
    complete before and after."""
    if jax.process_index() != 0:
        return
    file = metadata_file(path)
    tmp = file.with_name(file.name + ".redeqx-tmp")
    try:
        tmp.write_text(dumps(meta, "metadata"))
        os.replace(tmp, file)
    except OSError as e:
        raise CheckpointError(f"could not record the metrics of step {meta['step']} in {file}: "
                              f"{describe_failure(e)}; the checkpoint itself is intact.") from e
