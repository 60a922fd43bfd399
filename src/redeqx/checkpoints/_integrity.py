"""Integrity: what proves a checkpoint whole before anything is restored
from it. Per leaf a word sum and a content hash (``_hashing.py``; written
by `encode`, checked by `check_arrays` after reading), a hash of the metadata's fields,
the metadata's own checks (`raw_metadata`), and the check that ``like`` and
the checkpoint hold the same arrays (`check_match`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import jax.numpy as jnp
import orbax.checkpoint as ocp
import xxhash

from .._json import from_json as _from_json
from .._typing import typechecked
from .._version import __version__
from ._hashing import _PIECES, HASH, fingerprints, unmatched_pieces
from ._format import (
    FORMAT,
    FORMAT_VERSION,
    TMP_MARKER,
    CheckpointError,
    NewerFormatError,
    leaf_at,
    metadata_file,
)


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
        optimizer_only = all("/opt_state" in p.split(":")[0] for p in problems)
        advice = ("The model matches; its optimizer state does not: the checkpoint was saved with another optimizer "
                  "(another optax transformation or chain, a schedule where there was a constant) or another "
                  "trainable= filter. Make like with the optimizer and trainable= it was saved with "
                  "(redeqx.init_state(model, optimizer, mesh, specs, trainable=...)), or restore the model alone "
                  "(like=state.model) and start a new optimizer state." if optimizer_only else
                  "The checkpoint holds another model (another size, depth or architecture): build like from the "
                  "same model code and config the checkpoint was saved with (e.g. eqx.filter_eval_shape(make_model, "
                  "key)).")
        raise ValueError(
            f"checkpoint at {path} does not match like: first {first}.{' Then:' if rest else ''}{shown}\n{advice}")


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


def check_arrays(path: Path, saved: dict, arrays: dict[str, list], to_read, programs=None) -> None:
    """The arrays read from ``path`` (per item, in the order of ``to_read``)
    match the word sums and content hashes written with them (``saved``: the
    metadata's ``leaves``), or a `CheckpointError` naming those that do not.
    ``programs``: `compile_fingerprints` of them, compiled while they were read."""
    names = [(item, ".".join(parts)) for item, wanted in to_read.items() for parts, _, _ in wanted]
    flat = [x for xs in arrays.values() for x in xs]
    entries = [saved[item][name] for item, name in names]
    sums, hashes, _ = fingerprints(flat, finite=False, programs=programs)
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
