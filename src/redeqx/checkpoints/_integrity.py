"""Integrity: what proves a checkpoint whole before anything is restored
from it. Per leaf a word sum and a content hash (written by `encode`,
checked by `check_arrays` after reading), a hash of the metadata's fields,
the metadata's own checks (`raw_metadata`), and the check that ``like`` and
the checkpoint hold the same arrays (`check_match`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import xxhash
from jax.sharding import NamedSharding, PartitionSpec as P

from .._json import from_json as _from_json
from .._typing import typechecked
from .._version import __version__
from ._format import (
    FORMAT,
    FORMAT_VERSION,
    TMP_MARKER,
    CheckpointError,
    NewerFormatError,
    all_processes,
    leaf_at,
    metadata_file,
)


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


# The pass runs on each device's own shard (`jax.shard_map`), a block of rows at a time, so that
# what it adds to a device's memory is one block's words, never a copy of the leaf (a device of the
# host on CPU: the host's memory). Each device sums its shard's terms at their places in the whole
# array; one copy of each replicated shard counts; the sums are added over the mesh. Equal, term for
# term, to the sum over the whole array, on any layout and process count.
_BLOCK_WORDS = 1 << 22  # words a device hashes at once (16 MiB of uint32)


def _place_index(shape, offsets, strides):
    """The row-major place in the whole array (mod 2**32) of each word of a block of ``shape`` whose
    first word sits at ``offsets`` (per dim) of an array with row-major ``strides``."""
    index = jnp.zeros(shape, jnp.uint32)
    for d in range(len(shape)):
        at = jax.lax.broadcasted_iota(jnp.uint32, shape, d) + offsets[d].astype(jnp.uint32)
        index = index + at * jnp.uint32(strides[d] % 2**32)
    return index


def _block_terms(x, offsets, strides):
    """(word sum, the two hash lanes' sums, all finite) of the block ``x`` at ``offsets``."""
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    plain = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    bits = jax.lax.bitcast_convert_type(plain, jnp.dtype(f"uint{plain.dtype.itemsize * 8}"))
    checksum = jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)  # a 64-bit word counts its low half
    words = _words(x)
    index = _place_index(words.shape, list(offsets) + [jnp.uint32(0)] * (words.ndim - len(offsets)), strides)
    lanes = jnp.stack([jnp.sum(_fmix32(words ^ (index * jnp.uint32(c) + jnp.uint32(s))), dtype=jnp.uint32)
                       for c, s in _LANES])
    return checksum, lanes, finite


def _shard_terms(x, offsets, strides):
    """`_block_terms` of a device's shard ``x``, a block of its leading dim at a time."""
    if x.ndim == 0 or x.size <= _BLOCK_WORDS:
        return _block_terms(x, offsets, strides)
    row = x.size // x.shape[0]
    rows = max(1, min(x.shape[0], _BLOCK_WORDS // max(1, row)))
    while x.shape[0] % rows:  # whole blocks only: a divisor of the leading dim
        rows -= 1
    n = x.shape[0] // rows

    def body(i, acc):
        block = jax.lax.dynamic_slice_in_dim(x, i * rows, rows, axis=0)
        at = [offsets[0] + (i * rows).astype(jnp.uint32)] + list(offsets[1:])
        c, h, f = _block_terms(block, at, strides)
        return acc[0] + c, acc[1] + h, acc[2] & f

    zero = (jnp.uint32(0), jnp.zeros(2, jnp.uint32), jnp.bool_(True))
    return jax.lax.fori_loop(0, n, body, zero)


def _word_strides(shape, dtype) -> list[int]:
    """Row-major strides of the words of a leaf of ``shape`` (a trailing axis of two for 64 bits)."""
    words = list(shape) + ([2] if jnp.dtype(dtype).itemsize > 4 else [])
    strides, stride = [0] * len(words), 1
    for d in reversed(range(len(words))):
        strides[d], stride = stride, stride * words[d]
    return strides


def _leaf_terms(x):
    """`_shard_terms` of every device's shard of ``x``, added over the mesh (inside ``jit``)."""
    strides = _word_strides(x.shape, x.dtype)
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or x.ndim == 0:
        return _shard_terms(x, [jnp.uint32(0)] * x.ndim, strides)
    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    used = {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}

    def per_device(shard):
        offsets = []
        for d, entry in enumerate(spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            k = jnp.uint32(0)
            for a in axes:  # the shard's index along dim d: the axes in order, the first major
                k = k * jnp.uint32(mesh.shape[a]) + jax.lax.axis_index(a).astype(jnp.uint32)
            offsets.append(k * jnp.uint32(shard.shape[d]))
        checksum, lanes, finite = _shard_terms(shard, offsets, strides)
        first = jnp.bool_(True)  # one copy of a shard that other axes replicate
        for a in mesh.axis_names:
            if a not in used:
                first = first & (jax.lax.axis_index(a) == 0)
        keep = first.astype(jnp.uint32)
        axes = tuple(mesh.axis_names)
        return (jax.lax.psum(checksum * keep, axes), jax.lax.psum(lanes * keep, axes),
                jax.lax.psum((~finite).astype(jnp.int32), axes) == 0)

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(*spec),), out_specs=(P(), P(), P()),
                         check_vma=False)(x)


def _hex(lanes) -> str:
    return "".join(f"{int(v):08x}" for v in lanes)


@jax.jit
def _fingerprints(leaves: list) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per leaf, its ``uint32`` word sum (wrapping mod 2**32), the two
    lanes of its content hash, and whether every value is finite: one pass
    over each device's shards (`_leaf_terms`), one fetch, inside every save
    and restore."""
    if not leaves:
        return jnp.zeros((0,), jnp.uint32), jnp.zeros((0, 2), jnp.uint32), jnp.zeros((0,), jnp.bool_)
    terms = [_leaf_terms(x) for x in leaves]
    return (jnp.stack([t[0] for t in terms]), jnp.stack([t[1] for t in terms]), jnp.stack([t[2] for t in terms]))


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
        return [any(column) for column in zip(*all_processes(bad))]
    return bad


# ----------------------------------------------------------------------------- metadata
# (encoded to strict JSON by ``_json.py``, the one encoder of what redeqx writes)

def _exists(path: Path) -> bool:
    """``path.exists()``, False where it cannot even be looked at (a directory this user cannot read)."""
    try:
        return path.exists()
    except OSError:
        return False


def orbax_layout(path: Path) -> str | None:
    """What another tool's orbax directory at ``path`` looks like ("an orbax
    checkpoint", "an orbax CheckpointManager directory (steps 0, 1)"), or None."""
    try:
        if not path.is_dir():
            return None
        if any(_exists(path / name) for name in ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt")):
            return "an orbax checkpoint"
        steps = sorted(int(p.name) for p in path.iterdir()
                       if p.is_dir() and p.name.isdigit() and _exists(p / "_CHECKPOINT_METADATA"))
    except OSError:
        return None  # not readable: not recognisably anything
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
    except PermissionError as e:
        raise CheckpointError(
            f"checkpoint at {path} cannot be read by this user ({e.strerror}: {e.filename}): make it readable "
            "(chmod/chown), or delete it."
        ) from None
    except (OSError, ValueError) as e:
        if not _exists(metadata_file(path)) and (kind := orbax_layout(path)) is not None:
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


# ----------------------------------------------------------------------------- the checks on restore


_SHOWN_DIFFERENCES = 8


def check_match(path: Path, meta: dict, to_read) -> None:
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
                stored = tuple(leaf_at(on_disk, parts).shape)
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


def check_arrays(path: Path, saved: dict, arrays: dict[str, list], to_read) -> None:
    """The arrays read from ``path`` (per item, in the order of ``to_read``)
    match the word sums and content hashes written with them (``saved``: the
    metadata's ``leaves``), or a `CheckpointError` naming those that do not."""
    names = [(item, ".".join(parts)) for item, wanted in to_read.items() for parts, _, _ in wanted]
    flat = [x for xs in arrays.values() for x in xs]
    entries = [saved[item][name] for item, name in names]
    sums, hashes, _ = fingerprints(flat)
    unmatched = unmatched_pieces(flat, [None if HASH in e else e.get(_PIECES) for e in entries])
    bad = [f"{item}/{name}" for (item, name), total, digest, e, wrong in zip(names, sums, hashes, entries, unmatched)
           if wrong or total != e["checksum"] or e.get(HASH, digest) != digest]
    if bad:
        raise CheckpointError(
            f"checkpoint at {path} is corrupted: the data of {', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''} "
            "does not match the checksum and content hash written with it. Restore an earlier checkpoint."
        )


def same_arrays(new: dict, saved: dict) -> bool:
    """Whether two checkpoints' metadata describe the same arrays: the same
    names, the same word sums, and the same content hashes (which an older
    checkpoint does not have)."""
    a, b = new["redeqx"]["leaves"], saved["redeqx"]["leaves"]
    if {i: set(leaves) for i, leaves in a.items()} != {i: set(leaves) for i, leaves in b.items()}:
        return False
    for item, leaves in a.items():
        for name, x in leaves.items():
            y = b[item][name]
            if x["checksum"] != y["checksum"]:
                return False
            hx, hy = x.get(HASH), y.get(HASH)
            if hx and hy and hx != hy:
                return False
    return True
