"""The checkpoint format: `save_checkpoint`, `restore_checkpoint` and
`read_metadata` for one checkpoint (`CheckpointManager`, in ``_manager.py``,
keeps a run's directory of them).

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

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import xxhash
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from .. import _hooks
from .._failures import describe_failure
from .._json import from_json as _from_json, is_key as _is_key, to_json as _to_json
from ..mesh._mesh import check_mesh, same_devices
from ..state._opt_state import mirror_specs as _mirror_specs
from ..mesh._spec_checks import check_specs_match as _check_specs_match, refuse_deleted
from ..state._state import TrainState
from .._trees import is_array_like, is_none as _is_none, is_spec as _is_spec, path_parts
from .._version import __version__
from .._typing import floating_dtype, typechecked
from ..sharding._specs import sharding_of

FORMAT = "redeqx-checkpoint"
FORMAT_VERSION = 1  # raise it when the layout on disk changes; readers refuse a newer one
TMP_MARKER = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read: the message names its path and the cause."""


class NewerFormatError(CheckpointError):
    """A checkpoint in a format newer than this redeqx reads (never a reason
    to fall back to an older checkpoint: that would drop the newer work)."""


# ----------------------------------------------------------------------------- trees


def _array_leaves(tree) -> list[tuple[tuple[str, ...], Any]]:
    """``(attribute path parts, leaf)`` for every array (or abstract array) leaf."""
    return [(tuple(path_parts(kp)), x) for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0] if is_array_like(x)]


def _nest(pairs) -> dict:
    """``[(("layers", "0", "weight"), x), ...]`` -> ``{"layers": {"0": {"weight": x}}}``."""
    out: dict = {}
    for parts, x in pairs:
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = x
    return out


def _get(nested: dict, parts: tuple[str, ...]):
    for p in parts:
        nested = nested[p]
    return nested


def _train_view(state: TrainState) -> dict:
    """What a TrainState saves besides its model, named as on disk."""
    return {"opt_state": state.opt_state, "model_state": state.model_state, "step": state.step, "key": state.key}


def _items(state) -> dict[str, list[tuple[tuple[str, ...], Any]]]:
    """The arrays to save, per orbax item, with the names they get on disk
    (PRNG keys still as keys: `encode` stores their raw data)."""
    if isinstance(state, TrainState):
        return {"model": _array_leaves(state.model), "train": _array_leaves(_train_view(state))}
    if _is_key(state):
        raise TypeError("state must be a redeqx.TrainState, a model or a pytree of them, got a PRNG key.")
    return {"model": _array_leaves(state)}


def _train_states(tree) -> list[TrainState]:
    return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, TrainState)) if isinstance(x, TrainState)]


def step_of(state) -> int | None:
    """``state.step``; for a tree of TrainStates their common step; else None."""
    found = {int(s.step) for s in _train_states(state)}
    return found.pop() if len(found) == 1 else None


# ----------------------------------------------------------------------------- checksums and content hashes
#
# Two per leaf, from one pass on the devices: a sum of the leaf's words
# (catches a flipped bit; the first format's check, still written for older
# readers) and a content hash that also catches two values swapped or two
# sign flips. The hash is a sum too, so it is the same on any layout and
# any number of processes (the partitioner adds the shards' parts with a
# collective), but of each word mixed with its place in the array:
# ``fmix32(word ^ (index * C + S))`` (murmur3's finaliser, in which every
# input bit reaches every output bit; ``C`` odd, so each place has its own
# key), in two lanes with their own ``C`` and ``S``, 64 bits in all. A change
# anywhere moves each lane by an unpredictable amount: a damaged array
# passes with odds of about 2**-64. Nothing leaves the devices but the
# numbers (no copy of the arrays to the host, as hashing there would
# need); on XLA:CPU the pass costs a few times the word sum, on an
# accelerator it is bound by memory bandwidth.
#
# Checkpoints written before it hold an ``xxh3_128`` digest of each piece a
# saving device held instead, checked where this process holds the piece
# whole (`unmatched_pieces`).

HASH = "content_hash"
_LANES = ((0x9E3779B1, 0x7F4A7C15), (0x85EBCA77, 0xC2B2AE3D))  # (C, S) of each 32-bit lane


def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x):
    """``x``'s bits as ``uint32``, one word per element (a trailing axis of
    two for 64-bit dtypes)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize > 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}")).astype(jnp.uint32)


def _content_hash(words) -> jax.Array:
    """The two lanes of the content hash of ``words`` (``uint32[2]``)."""
    index, stride = jnp.zeros(words.shape, jnp.uint32), 1  # the row-major place of each word, mod 2**32
    for d in reversed(range(words.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, d) * jnp.uint32(stride % 2**32)
        stride *= words.shape[d]
    return jnp.stack([jnp.sum(_fmix32(words ^ (index * jnp.uint32(c) + jnp.uint32(s))), dtype=jnp.uint32)
                      for c, s in _LANES])


def _hex(lanes) -> str:
    return "".join(f"{int(v):08x}" for v in lanes)


@jax.jit
def _fingerprints(leaves: list) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per leaf, its ``uint32`` word sum (wrapping mod 2**32), the two
    lanes of its content hash, and whether every value is finite: one pass,
    one fetch, inside every save and restore."""

    def finite(x):
        return jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)

    def checksum(x):  # as the first format defined it: a 64-bit word counts its low half
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.uint8)
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
        return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)

    if not leaves:
        return jnp.zeros((0,), jnp.uint32), jnp.zeros((0, 2), jnp.uint32), jnp.zeros((0,), jnp.bool_)
    return (jnp.stack([checksum(x) for x in leaves]), jnp.stack([_content_hash(_words(x)) for x in leaves]),
            jnp.stack([finite(x) for x in leaves]))


def fingerprints(leaves: list[jax.Array]) -> tuple[list[int], list[str], list[bool]]:
    """`_fingerprints` on the host: word sums, content hashes as hex, finiteness."""
    sums, hashes, finite = jax.device_get(_fingerprints(leaves))
    return np.asarray(sums).tolist(), [_hex(h) for h in np.asarray(hashes)], np.asarray(finite).tolist()


_PIECES = "xxh3_128"  # the older checkpoints' hashes, per saved piece


def _index_slices(key: str) -> tuple[slice, ...]:
    return tuple(slice(*map(int, part.split(":"))) for part in key.split(",")) if key else ()


def unmatched_pieces(leaves: list[jax.Array], saved: list[dict[str, str] | None]) -> list[bool]:
    """Per leaf, whether a piece hashed by an older redeqx that this process
    can see whole has another ``xxh3_128`` digest now, agreed over every
    process (leaves without such hashes pass)."""
    bad = []
    for x, want in zip(leaves, saved):
        wrong = False
        if want:
            held = {",".join(f"{sl.start or 0}:{n if sl.stop is None else sl.stop}"
                             for sl, n in zip(sh.index, x.shape)): sh for sh in x.addressable_shards}
            whole = None
            for key, digest in want.items():
                if key in held:
                    data = np.asarray(held[key].data)
                elif x.is_fully_addressable:
                    whole = np.asarray(x) if whole is None else whole
                    data = whole[_index_slices(key)]
                else:
                    continue  # spread over processes on this layout: the word sum checks it
                if xxhash.xxh3_128(np.ascontiguousarray(data).reshape(-1).view(np.uint8)).hexdigest() != digest:
                    wrong = True
                    break
        bad.append(wrong)
    if jax.process_count() > 1:
        return [any(column) for column in zip(*_all_processes(bad))]
    return bad


def _all_processes(local: list) -> list:
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


def _cast(x, dtype):
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
        return x
    return x.astype(dtype)


# ----------------------------------------------------------------------------- metadata
# (encoded to strict JSON by ``_json.py``, the one encoder of what redeqx writes)

def metadata_file(path: Path) -> Path:
    return path / "metadata" / "metadata"


def orbax_layout(path: Path) -> str | None:
    """What another tool's orbax directory at ``path`` looks like ("an orbax
    checkpoint", "an orbax CheckpointManager directory (steps 0, 1)"), or None."""
    if not path.is_dir():
        return None
    if any((path / name).exists() for name in ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt")):
        return "an orbax checkpoint"
    steps = sorted(int(p.name) for p in path.iterdir()
                   if p.is_dir() and p.name.isdigit() and (p / "_CHECKPOINT_METADATA").exists())
    if steps:
        shown = ", ".join(map(str, steps[:5])) + (" ..." if len(steps) > 5 else "")
        return f"an orbax CheckpointManager directory (steps {shown})"
    return None


_FOREIGN = (
    "redeqx restores only checkpoints it wrote. Read this one with orbax itself "
    "(orbax.checkpoint.PyTreeCheckpointer().restore(path) gives nested dicts of arrays) and put the arrays "
    "into your model, e.g. with eqx.tree_at, then save it with redeqx."
)


def raw_metadata(path: Path) -> dict:
    """The metadata JSON of the checkpoint at ``path`` as stored, after
    checking that it is a complete redeqx checkpoint in a format this redeqx
    reads; a `CheckpointError` saying what it is otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist.")
    if path.name.find(TMP_MARKER) != -1:
        raise CheckpointError(f"{path} is an unfinished save (orbax temporary directory), not a checkpoint.")
    try:
        meta = json.loads(metadata_file(path).read_text())
    except (OSError, ValueError) as e:
        if not metadata_file(path).exists() and (kind := orbax_layout(path)) is not None:
            raise CheckpointError(f"{path} is {kind}, not a redeqx checkpoint (it has no {metadata_file(path)}). "
                                  + _FOREIGN) from None
        raise CheckpointError(
            f"checkpoint at {path} is incomplete or corrupted: cannot read {metadata_file(path)} "
            f"({type(e).__name__}: {e})."
        ) from None
    section = meta.get("redeqx") if isinstance(meta, dict) else None
    if not isinstance(section, dict) or section.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a redeqx checkpoint (its metadata has no redeqx format marker). "
                              + _FOREIGN)
    version = section.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"checkpoint at {path} has format_version={version!r}, which no redeqx writes: "
                              "its metadata is damaged.")
    if version > FORMAT_VERSION:
        raise NewerFormatError(
            f"checkpoint at {path} is in format version {version}, written by redeqx {section.get('version')}; "
            f"this redeqx ({__version__}) reads format versions up to {FORMAT_VERSION}. Upgrade redeqx to restore it."
        )
    if (damage := _damaged_section(section)) is not None:
        raise CheckpointError(f"checkpoint at {path} has damaged metadata ({metadata_file(path)}): {damage}. "
                              "Restore an earlier checkpoint.")
    if FIELDS_HASH in section and section[FIELDS_HASH] != fields_hash(meta):
        raise CheckpointError(
            f"checkpoint at {path} has damaged metadata ({metadata_file(path)}): its step, data position, metrics "
            "or other fields do not match the hash written with them, so resuming from it would read other data "
            "than the run saved. Restore an earlier checkpoint."
        )
    return meta


FIELDS_HASH = "fields_hash"


def fields_hash(meta: dict) -> str:
    """``xxh3_128`` of ``meta`` outside its ``redeqx`` section (the step, the
    data position, metrics, the caller's fields) as canonical JSON: one
    changed number of a data iterator's saved state is a damaged checkpoint,
    not batches silently shifted."""
    fields = {k: v for k, v in meta.items() if k != "redeqx"}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return xxhash.xxh3_128(text.encode()).hexdigest()


def _damaged_section(section: dict) -> str | None:
    """What is wrong with a ``redeqx`` metadata section that parses as
    JSON, or None: the parts a restore reads must be there and well formed."""
    if section.get("kind") not in ("train_state", "model"):
        return f"'kind' is {section.get('kind')!r}, not 'train_state' or 'model'"
    leaves = section.get("leaves")
    if not isinstance(leaves, dict) or "model" not in leaves or not all(isinstance(v, dict) for v in leaves.values()):
        return "its 'leaves' section (each array's shape, dtype and checksum) is missing or not a table per item"
    for item, entries in leaves.items():
        for name, e in entries.items():
            where = f"leaves/{item}/{name}"
            if not isinstance(e, dict):
                return f"{where} is {e!r}, not a table"
            shape = e.get("shape")
            if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                      for n in shape):
                return f"{where} has shape {shape!r}, not a list of sizes"
            try:
                jnp.dtype(e.get("dtype"))
            except TypeError:
                return f"{where} has dtype {e.get('dtype')!r}, which is no dtype"
            if not isinstance(e.get("checksum"), int) or isinstance(e.get("checksum"), bool):
                return f"{where} has checksum {e.get('checksum')!r}, not a number"
    return None


@typechecked
def read_metadata(path: str | os.PathLike) -> dict:
    """The JSON metadata of the checkpoint at ``path``: ``step``, whatever
    ``metadata=`` was saved (PRNG keys come back as keys; non-finite numbers
    as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``), and a
    ``redeqx`` section (format version, redeqx version, leaf shapes, dtypes,
    checksums).

    **Example:**

    ```python
    meta = redeqx.read_metadata("run/checkpoints/step_000001000")
    print(meta["step"], meta["metrics"])
    ```
    """
    return _from_json(raw_metadata(Path(path)))


# ----------------------------------------------------------------------------- save


def check_dtype(dtype):
    return floating_dtype(dtype, "dtype")


class Encoded(NamedTuple):
    """A state turned into what orbax writes."""

    args: ocp.args.Composite  # the orbax items
    metadata: dict  # the JSON written with them
    non_finite: list[str]  # floating leaves holding NaN or inf, as ``item/path``


def encode(state, metadata, dtype) -> Encoded:
    """``state`` -> what orbax writes, and the metadata JSON. Blocks only for
    the checksums (and finiteness, from the same pass)."""
    if isinstance(state, TrainState) and not _is_key(state.key):
        raise TypeError("state.key must be a typed PRNG key (jax.random.key(seed)).")
    dtype = check_dtype(dtype)
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
    user = _to_json(dict(metadata or {}), "metadata")
    own_step = step_of(state)
    step = own_step if own_step is not None else user.get("step", 0)
    if "redeqx" in user or ("step" in user and own_step is not None and user["step"] != step):
        raise ValueError(
            f"metadata may not set 'redeqx' or a 'step' other than state.step ({step}); got keys {sorted(user)}."
        )
    named = [(name, ".".join(parts), x) for name, pairs in items.items() for parts, x in pairs]
    sums, hashes, finite = fingerprints([x for _, _, x in named])
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
    args = {name: ocp.args.StandardSave(_nest(pairs)) for name, pairs in items.items()}
    args["metadata"] = ocp.args.JsonSave(meta)
    non_finite = [f"{name}/{path}" for (name, path, _), ok in zip(named, finite) if not ok]
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
    encoded = encode(state, metadata, dtype)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        write(checkpointer, path, encoded.args)
    return path


# ----------------------------------------------------------------------------- restore


def _live_sharding(name: str, x, mesh: Mesh) -> NamedSharding:
    sh = getattr(x, "sharding", None)
    if isinstance(sh, NamedSharding) and same_devices(sh.mesh, mesh):
        return NamedSharding(mesh, sh.spec)
    raise ValueError(
        f"like leaf '{name}' carries no sharding on this mesh ({type(sh).__name__ if sh is not None else 'none'}), "
        "so restore cannot tell where to put it: pass specs (redeqx.sharding_rules(model, mesh)), or a like "
        "whose arrays live on this mesh (the live state)."
    )


def _leaves_to_read(like, mesh: Mesh, specs) -> dict[str, list[tuple[tuple[str, ...], Any, NamedSharding]]]:
    """Per orbax item: ``(name parts, abstract leaf as stored, sharding)`` for
    every array `restore_checkpoint` reads. PRNG keys are read as their raw data. With
    ``specs=None`` every leaf goes where it is in ``like`` (a live state)."""
    replicated = NamedSharding(mesh, P())

    def stored(x):
        return jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x

    def live(tree, prefix=()):
        return [((*prefix, *parts), stored(x), _live_sharding(".".join((*prefix, *parts)), x, mesh))
                for parts, x in _array_leaves(tree)]

    if not isinstance(like, TrainState):
        if specs is None:
            return {"model": live(like)}
        _check_specs_match(like, specs, "model")
        out = []
        m_leaves = jax.tree_util.tree_flatten_with_path(like, is_leaf=_is_none)[0]
        for (kp, x), spec in zip(m_leaves, jax.tree.leaves(specs, is_leaf=_is_spec), strict=True):
            if is_array_like(x):
                out.append((tuple(path_parts(kp)), stored(x), sharding_of(spec, mesh)))
        return {"model": out}
    if specs is None:
        return {"model": live(like.model), "train": live(_train_view(like))}
    model_leaves = _leaves_to_read(like.model, mesh, specs)["model"]
    os_specs = _mirror_specs(like.opt_state, like.model, specs)
    train = []
    for (kp, x), spec in zip(jax.tree_util.tree_flatten_with_path(like.opt_state, is_leaf=_is_none)[0],
                             jax.tree.leaves(os_specs, is_leaf=_is_spec), strict=True):
        if is_array_like(x):
            train.append((("opt_state", *path_parts(kp)), x, sharding_of(spec, mesh)))
    for parts, x in _array_leaves(like.model_state):
        sh = getattr(x, "sharding", None)
        keep = isinstance(sh, NamedSharding) and sh.mesh == mesh
        train.append((("model_state", *parts), x, sh if keep else replicated))
    train.append((("step",), like.step, replicated))
    train.append((("key",), stored(like.key), replicated))
    return {"model": model_leaves, "train": train}


_SHOWN_DIFFERENCES = 8


def _check_match(path: Path, meta: dict, to_read) -> None:
    """``like`` and the checkpoint hold the same arrays with the same shapes,
    or a ValueError naming the first difference (path and both shapes) and a
    few more, before orbax is asked to read anything."""
    problems = []
    for item, wanted in to_read.items():
        saved = meta["redeqx"]["leaves"].get(item)
        if saved is None:
            problems.append(f"the checkpoint has no '{item}' (it holds a {meta['redeqx']['kind']}); "
                            "restore params only with like=state.model")
            continue
        names = set()
        for parts, x, _ in wanted:
            name = ".".join(parts)
            names.add(name)
            if name not in saved:
                problems.append(f"{item}/{name}: in like {tuple(x.shape)}, missing from the checkpoint")
            elif tuple(saved[name]["shape"]) != tuple(x.shape):
                problems.append(f"{item}/{name}: checkpoint {tuple(saved[name]['shape'])}, like {tuple(x.shape)}")
        problems += [f"{item}/{name}: in the checkpoint {tuple(saved[name]['shape'])}, not in like"
                     for name in saved if name not in names]
    if problems:
        _refuse_damaged_shapes(path, meta, to_read)
        first, rest = problems[0], problems[1:]
        more = len(rest) - _SHOWN_DIFFERENCES
        shown = "".join(f"\n  {p}" for p in rest[:_SHOWN_DIFFERENCES])
        shown += f"\n  ... and {more} more" if more > 0 else ""
        raise ValueError(
            f"checkpoint at {path} does not match like: first {first}.{' Then:' if rest else ''}{shown}\nThe "
            "checkpoint holds another model (another size, depth or architecture): build like from the same model "
            "code and config the checkpoint was saved with (e.g. eqx.filter_eval_shape(make_model, key))."
        )


def _refuse_damaged_shapes(path: Path, meta: dict, to_read) -> None:
    """A shape in the metadata that differs from ``like`` while the array
    files (orbax's own record of them) hold ``like``'s shape: the metadata
    is damaged, not the model another (a `CheckpointError`, so a manager
    falls back to the previous checkpoint)."""
    saved = meta["redeqx"]["leaves"]
    for item, wanted in to_read.items():
        try:
            with _quiet_absl():
                on_disk = ocp.PyTreeCheckpointer().metadata(path / item).item_metadata.tree
        except Exception:
            continue
        for parts, x, _ in wanted:
            name = ".".join(parts)
            if name not in saved.get(item, {}):
                continue
            try:
                stored = tuple(_get(on_disk, parts).shape)
            except (KeyError, TypeError, AttributeError):
                continue
            if tuple(saved[item][name]["shape"]) != stored:
                raise CheckpointError(
                    f"checkpoint at {path} has damaged metadata: it says {item}/{name} has shape "
                    f"{tuple(saved[item][name]['shape'])}, but its array files hold {stored}. Restore an earlier "
                    "checkpoint."
                )


@contextlib.contextmanager
def _quiet_absl():
    """orbax logs a warning through absl for every item directory it reads
    metadata from without its own metadata file; nothing a user can act on."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _is_key_data(item, parts, saved) -> bool:
    entry = saved.get(item, {}).get(".".join(parts), {})
    return "prng_key" in entry or (item == "train" and parts == ("key",))


@eqx.filter_jit
def _cast_to(tree, dtypes):
    return jax.tree.map(lambda x, d: x.astype(d), tree, dtypes)


@typechecked
def restore_checkpoint(path: str | os.PathLike, like: PyTree, mesh: Mesh, specs: PyTree = None) -> PyTree:
    """Read the checkpoint at ``path`` into the structure of ``like``, placed
    on ``mesh`` by ``specs``.

    ``like`` gives structure, shapes and dtypes; it may be abstract, as made
    by ``eqx.filter_eval_shape``, so the full model is never built in host
    memory: each device reads only its own shards straight from disk. ``mesh``
    and ``specs`` (the model's, from `sharding_rules`) need not be those of the
    run that saved it: a checkpoint saved with ``n_model_shards=1`` restores
    onto ``n_model_shards=4``. The optimizer state is sharded like the
    parameters it mirrors, as in `init_state`.

    - ``like`` a `TrainState` restores everything; ``like`` a model restores
      the parameters only (to fine-tune or predict); ``like`` any other pytree
      (a dict of TrainStates for several models, a replay buffer) restores the
      state saved from a tree of that structure.
    - ``specs=None``: every array goes where the same leaf of ``like`` lives
      (pass the live state as ``like``): the way to restore a tree of several
      models, each with its own layout.
    - Arrays come back with ``like``'s dtypes (a checkpoint saved with
      ``dtype=jnp.bfloat16`` is cast back up).
    - Shapes that differ, or a checkpoint whose checksums don't match its
      arrays, raise an error naming the paths.

    **Example:**

    ```python
    like = eqx.filter_eval_shape(redeqx.init_state, model, optimizer, mesh, specs, key=jax.random.key(0))
    state = redeqx.restore_checkpoint("run/ckpt_100", like, mesh, specs)
    model = redeqx.restore_checkpoint("run/ckpt_100", model, mesh, specs)   # params only
    ```
    """
    path = Path(path).absolute()  # orbax refuses relative paths
    mesh = check_mesh(mesh)
    meta = raw_metadata(path)
    to_read = _leaves_to_read(like, mesh, specs)
    _check_match(path, meta, to_read)
    saved = meta["redeqx"]["leaves"]
    args = {}
    for item, wanted in to_read.items():
        abstract = [
            (parts, jax.ShapeDtypeStruct(x.shape, jnp.dtype(saved[item][".".join(parts)]["dtype"]), sharding=sh))
            for parts, x, sh in wanted
        ]
        args[item] = ocp.args.StandardRestore(_nest(abstract))
    _hooks.count_orbax_bytes_without_leaking()
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(path, args=ocp.args.Composite(**args))
    except Exception as e:
        raise CheckpointError(
            f"checkpoint at {path} is truncated or corrupted: orbax could not read it ({type(e).__name__}: {e})."
        ) from e
    arrays = {item: [_get(restored[item], parts) for parts, _, _ in wanted] for item, wanted in to_read.items()}
    flat = [x for xs in arrays.values() for x in xs]
    entries = [saved[item][".".join(parts)] for item, wanted in to_read.items() for parts, _, _ in wanted]
    sums, hashes, _ = fingerprints(flat)
    unmatched = unmatched_pieces(flat, [None if HASH in e else e.get(_PIECES) for e in entries])
    names = [f"{item}/{'.'.join(parts)}" for item, wanted in to_read.items() for parts, _, _ in wanted]
    bad = [name for name, total, digest, e, wrong in zip(names, sums, hashes, entries, unmatched)
           if wrong or total != e["checksum"] or e.get(HASH, digest) != digest]
    if bad:
        raise CheckpointError(
            f"checkpoint at {path} is corrupted: the data of {', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''} "
            "does not match the checksum and content hash written with it. Restore an earlier checkpoint."
        )
    for item, wanted in to_read.items():
        dtypes = [None if jnp.issubdtype(like_leaf.dtype, jax.dtypes.prng_key) or _is_key_data(item, parts, saved)
                  else jnp.dtype(like_leaf.dtype) for parts, like_leaf, _ in wanted]
        keep = [i for i, (a, d) in enumerate(zip(arrays[item], dtypes)) if d is not None and a.dtype != d]
        if keep:
            cast = _cast_to([arrays[item][i] for i in keep], [dtypes[i] for i in keep])
            for i, a in zip(keep, cast):
                arrays[item][i] = a
    by_name = {item: {".".join(parts): a for (parts, _, _), a in zip(wanted, arrays[item])}
               for item, wanted in to_read.items()}
    return _rebuild(like, by_name, meta)


def _rebuild(like, arrays: dict[str, dict[str, Any]], meta: dict):
    """``like`` with its arrays from ``arrays`` (per item, by name on disk)."""
    info = meta["redeqx"]["leaves"]

    def fill(tree, item, names):
        it = iter(names)
        leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_none)
        out = []
        for x in leaves:
            if not is_array_like(x):
                out.append(x)
                continue
            name = next(it)
            a = arrays[item][name]
            if _is_key(x):  # stored as raw data; older checkpoints name the impl once
                impl = info[item][name].get("prng_key") or meta["redeqx"].get("key_impl")
                a = jax.random.wrap_key_data(a, impl=impl)
            out.append(a)
        return jax.tree.unflatten(treedef, out)

    def names(tree, prefix=()):
        return [".".join((*prefix, *parts)) for parts, _ in _array_leaves(tree)]

    if not isinstance(like, TrainState):
        return fill(like, "model", names(like))
    view = fill(_train_view(like), "train", names(_train_view(like)))
    return TrainState(model=fill(like.model, "model", names(like.model)), opt_state=view["opt_state"],
                      step=view["step"], key=view["key"], model_state=view["model_state"])
