"""Checkpoints on orbax: `save_checkpoint` / `restore_checkpoint` for one
checkpoint, `CheckpointManager` for a run's directory of them.

A checkpoint is a directory written by orbax in one atomic commit (orbax
writes into ``<path>.orbax-checkpoint-tmp-*`` and renames it when every
process is done), holding three items:

- ``model/``: the model's arrays as a nested dict keyed by the model's
  attribute path (``layers / 0 / weight``), each device writing its own shards;
- ``train/``: ``opt_state`` (same naming), ``step``, and ``key`` (the PRNG key's
  raw ``uint32`` data) when a `TrainState` was saved;
- ``metadata/metadata``: JSON with ``step``, the caller's fields (``epoch``,
  ``batch``, ``metrics``, ...), and a ``redeqx`` section: version, each leaf's
  shape, dtype and checksum.

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

import atexit
import json
import math
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from ._mesh import DATA, check_mesh
from ._state import TrainState, check_specs_match as _check_specs_match, mirror_specs as _mirror_specs, refuse_deleted
from ._trees import is_none as _is_none, is_spec as _is_spec, named_leaves, path_parts
from ._typing import floating_dtype

FORMAT = "redeqx-checkpoint"
FORMAT_VERSION = 1
_TMP_MARKER = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read: the message names its path and the cause."""


# ----------------------------------------------------------------------------- trees


def _is_arraylike(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _array_leaves(tree) -> list[tuple[tuple[str, ...], Any]]:
    """``(attribute path parts, leaf)`` for every array (or abstract array) leaf."""
    return [(tuple(path_parts(kp)), x) for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0] if _is_arraylike(x)]


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


def _is_key(x) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _train_view(state: TrainState) -> dict:
    """What a TrainState saves besides its model, named as on disk."""
    return {"opt_state": state.opt_state, "model_state": state.model_state, "step": state.step, "key": state.key}


def _items(state) -> dict[str, list[tuple[tuple[str, ...], Any]]]:
    """The arrays to save, per orbax item, with the names they get on disk
    (PRNG keys still as keys: `_prepare` stores their raw data)."""
    if isinstance(state, TrainState):
        return {"model": _array_leaves(state.model), "train": _array_leaves(_train_view(state))}
    if _is_key(state):
        raise TypeError("state must be a redeqx.TrainState, a model or a pytree of them, got a PRNG key.")
    return {"model": _array_leaves(state)}


def _train_states(tree) -> list[TrainState]:
    return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, TrainState)) if isinstance(x, TrainState)]


def _data_shards_of(state) -> int | None:
    """The ``data`` axis size of the mesh ``state`` lives on (what turns a
    batch index into a position in the data), if its arrays say."""
    for x in jax.tree.leaves(state):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if mesh is not None and DATA in getattr(mesh, "axis_names", ()):
            return int(mesh.shape[DATA])
    return None


def _step_of(state) -> int | None:
    """``state.step``; for a tree of TrainStates their common step; else None."""
    found = {int(s.step) for s in _train_states(state)}
    return found.pop() if len(found) == 1 else None


@jax.jit
def _checksums(leaves: list) -> jax.Array:
    """One ``uint32`` per leaf: the sum of its words, wrapping mod 2**32 (any
    single flipped bit changes it). Integer sums are exact, so a sharded array
    gives the same value as the same array on one device. Kept this cheap on
    purpose: it runs inside every save, before the save can return."""

    def one(x):
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.uint8)
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
        return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)

    return jnp.stack([one(x) for x in leaves]) if leaves else jnp.zeros((0,), jnp.uint32)


def _cast(x, dtype):
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
        return x
    return x.astype(dtype)


# ----------------------------------------------------------------------------- metadata


def _to_json(value, where: str):
    """Metadata values -> JSON; PRNG keys become ``{"prng_key": impl, "data": [...]}``."""
    if _is_key(value):
        return {"prng_key": str(jax.random.key_impl(value)), "data": np.asarray(jax.random.key_data(value)).tolist()}
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        return np.asarray(value).tolist()
    if isinstance(value, Mapping):
        return {str(k): _to_json(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"{where} = {value!r} ({type(value).__name__}) cannot be stored as JSON; pass numbers, strings, lists, "
        "dicts, arrays or PRNG keys."
    )


def _from_json(value):
    if isinstance(value, dict):
        if set(value) == {"prng_key", "data"}:
            return jax.random.wrap_key_data(np.asarray(value["data"], np.uint32), impl=value["prng_key"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _version() -> str:
    from ._version import __version__

    return __version__


def _metadata_file(path: Path) -> Path:
    return path / "metadata" / "metadata"


def _raw_metadata(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist.")
    if path.name.find(_TMP_MARKER) != -1:
        raise CheckpointError(f"{path} is an unfinished save (orbax temporary directory), not a checkpoint.")
    try:
        meta = json.loads(_metadata_file(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint at {path} is incomplete or corrupted: cannot read {_metadata_file(path)} "
            f"({type(e).__name__}: {e})."
        ) from None
    if not isinstance(meta, dict) or meta.get("redeqx", {}).get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a redeqx checkpoint (its metadata has no redeqx format marker).")
    return meta


def read_metadata(path: str | os.PathLike) -> dict:
    """The JSON metadata of the checkpoint at ``path``: ``step``, whatever
    ``metadata=`` was saved (PRNG keys come back as keys), and a ``redeqx``
    section (version, leaf shapes, dtypes, checksums).

    **Example:**

    ```python
    meta = redeqx.read_metadata("run/checkpoints/step_000001000")
    print(meta["step"], meta["metrics"])
    ```
    """
    return _from_json(_raw_metadata(Path(path)))


# ----------------------------------------------------------------------------- save


def _check_dtype(dtype):
    return floating_dtype(dtype, "dtype")


def _prepare(state, metadata, dtype):
    """-> (orbax Composite args, metadata dict). Blocks only for the checksums."""
    if isinstance(state, TrainState) and not _is_key(state.key):
        raise TypeError("state.key must be a typed PRNG key (jax.random.key(seed)).")
    dtype = _check_dtype(dtype)
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
    own_step = _step_of(state)
    step = own_step if own_step is not None else user.get("step", 0)
    if "redeqx" in user or ("step" in user and own_step is not None and user["step"] != step):
        raise ValueError(
            f"metadata may not set 'redeqx' or a 'step' other than state.step ({step}); got keys {sorted(user)}."
        )
    leaves = [x for pairs in items.values() for _, x in pairs]
    sums = np.asarray(jax.device_get(_checksums(leaves))).tolist()
    sums_it = iter(sums)
    info = {}
    for name, pairs in items.items():
        info[name] = {}
        for parts, x in pairs:
            entry = {"shape": list(x.shape), "dtype": str(x.dtype), "checksum": next(sums_it)}
            impl = impls.get(name, {}).get(".".join(parts))
            if impl is not None:
                entry["prng_key"] = impl
            info[name][".".join(parts)] = entry
    meta = {
        **user,
        "step": step,
        "redeqx": {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version": _version(),
            "kind": "train_state" if isinstance(state, TrainState) else "model",
            "key_impl": str(jax.random.key_impl(state.key)) if isinstance(state, TrainState) else None,
            "leaves": info,
        },
    }
    args = {name: ocp.args.StandardSave(_nest(pairs)) for name, pairs in items.items()}
    args["metadata"] = ocp.args.JsonSave(meta)
    return ocp.args.Composite(**args), meta


def _write(checkpointer, path: Path, args) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        checkpointer.save(path, args=args)
    except Exception as e:
        _remove_partial(path)
        raise CheckpointError(
            f"could not write the checkpoint to {path} ({type(e).__name__}: {e}). Earlier checkpoints are "
            "untouched; check that the directory is writable and the disk has room."
        ) from e


def _remove_partial(path: Path) -> None:
    """Deletes what a failed save left in orbax's temporary directory. Its
    writer threads may still be finishing, so look again until it stays gone."""
    if jax.process_index() != 0 or not path.parent.is_dir():
        return
    for _ in range(50):
        leftovers = [p for p in path.parent.iterdir() if p.name.startswith(path.name + _TMP_MARKER)]
        if not leftovers:
            return
        for p in leftovers:
            shutil.rmtree(p, ignore_errors=True)
        time.sleep(0.05)


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

    **Example:**

    ```python
    redeqx.save_checkpoint("run/ckpt_100", state, metadata={"epoch": 1, "batch": 0})
    ```
    """
    path = Path(path)
    if path.exists():
        raise CheckpointError(f"{path} already exists; save to a new path or delete the old checkpoint first.")
    refuse_deleted(named_leaves(state), "state")
    args, _ = _prepare(state, metadata, dtype)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        _write(checkpointer, path, args)
    return path


# ----------------------------------------------------------------------------- restore


def _live_sharding(name: str, x, mesh: Mesh) -> NamedSharding:
    sh = getattr(x, "sharding", None)
    if isinstance(sh, NamedSharding) and sh.mesh.devices.shape == mesh.devices.shape and np.array_equal(
            np.vectorize(lambda d: d.id)(sh.mesh.devices), np.vectorize(lambda d: d.id)(mesh.devices)):
        return NamedSharding(mesh, sh.spec)
    raise ValueError(
        f"like leaf '{name}' carries no sharding on this mesh ({type(sh).__name__ if sh is not None else 'none'}), "
        "so restore cannot tell where to put it: pass specs (redeqx.sharding_rules(model, mesh)), or a like "
        "whose arrays live on this mesh (the live state)."
    )


def _targets(like, mesh: Mesh, specs) -> dict[str, list[tuple[tuple[str, ...], Any, NamedSharding]]]:
    """Per orbax item: ``(name parts, abstract leaf as stored, sharding)`` for
    every array to read. PRNG keys are read as their raw data. With
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
            if _is_arraylike(x):
                out.append((tuple(path_parts(kp)), stored(x), NamedSharding(mesh, P() if spec is None else spec)))
        return {"model": out}
    if specs is None:
        return {"model": live(like.model), "train": live(_train_view(like))}
    model_targets = _targets(like.model, mesh, specs)["model"]
    os_specs = _mirror_specs(like.opt_state, like.model, specs)
    train = []
    for (kp, x), spec in zip(jax.tree_util.tree_flatten_with_path(like.opt_state, is_leaf=_is_none)[0],
                             jax.tree.leaves(os_specs, is_leaf=_is_spec), strict=True):
        if _is_arraylike(x):
            train.append((("opt_state", *path_parts(kp)), x, NamedSharding(mesh, spec)))
    for parts, x in _array_leaves(like.model_state):
        sh = getattr(x, "sharding", None)
        keep = isinstance(sh, NamedSharding) and sh.mesh == mesh
        train.append((("model_state", *parts), x, sh if keep else replicated))
    train.append((("step",), like.step, replicated))
    train.append((("key",), stored(like.key), replicated))
    return {"model": model_targets, "train": train}


def _check_match(path: Path, meta: dict, targets) -> None:
    problems = []
    for item, wanted in targets.items():
        saved = meta["redeqx"]["leaves"].get(item)
        if saved is None:
            problems.append(f"  the checkpoint has no '{item}' (it holds a {meta['redeqx']['kind']}); "
                            "restore params only with like=state.model")
            continue
        names = set()
        for parts, x, _ in wanted:
            name = ".".join(parts)
            names.add(name)
            if name not in saved:
                problems.append(f"  {item}/{name}: in like {tuple(x.shape)}, missing from the checkpoint")
            elif tuple(saved[name]["shape"]) != tuple(x.shape):
                problems.append(f"  {item}/{name}: checkpoint {tuple(saved[name]['shape'])}, like {tuple(x.shape)}")
        problems += [f"  {item}/{name}: in the checkpoint {tuple(saved[name]['shape'])}, not in like"
                     for name in saved if name not in names]
    if problems:
        raise ValueError(
            f"checkpoint at {path} does not match like:\n" + "\n".join(problems) + "\nBuild like from the same model "
            "code and config the checkpoint was saved with (e.g. eqx.filter_eval_shape(make_model, key))."
        )


def _is_key_data(item, parts, saved) -> bool:
    entry = saved.get(item, {}).get(".".join(parts), {})
    return "prng_key" in entry or (item == "train" and parts == ("key",))


@eqx.filter_jit
def _cast_to(tree, dtypes):
    return jax.tree.map(lambda x, d: x.astype(d), tree, dtypes)


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
    path = Path(path)
    mesh = check_mesh(mesh)
    meta = _raw_metadata(path)
    targets = _targets(like, mesh, specs)
    _check_match(path, meta, targets)
    saved = meta["redeqx"]["leaves"]
    args = {}
    for item, wanted in targets.items():
        abstract = [
            (parts, jax.ShapeDtypeStruct(x.shape, jnp.dtype(saved[item][".".join(parts)]["dtype"]), sharding=sh))
            for parts, x, sh in wanted
        ]
        args[item] = ocp.args.StandardRestore(_nest(abstract))
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(path, args=ocp.args.Composite(**args))
    except Exception as e:
        raise CheckpointError(
            f"checkpoint at {path} is truncated or corrupted: orbax could not read it ({type(e).__name__}: {e})."
        ) from e
    arrays = {item: [_get(restored[item], parts) for parts, _, _ in wanted] for item, wanted in targets.items()}
    sums = np.asarray(jax.device_get(_checksums([x for xs in arrays.values() for x in xs]))).tolist()
    sums_it = iter(sums)
    bad = [
        f"{item}/{'.'.join(parts)}"
        for item, wanted in targets.items()
        for parts, _, _ in wanted
        if next(sums_it) != saved[item][".".join(parts)]["checksum"]
    ]
    if bad:
        raise CheckpointError(
            f"checkpoint at {path} is corrupted: the data of {', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''} "
            "does not match the checksum written with it. Restore an earlier checkpoint."
        )
    for item, wanted in targets.items():
        dtypes = [None if jnp.issubdtype(like_leaf.dtype, jax.dtypes.prng_key) or _is_key_data(item, parts, saved)
                  else jnp.dtype(like_leaf.dtype) for parts, like_leaf, _ in wanted]
        keep = [i for i, (a, d) in enumerate(zip(arrays[item], dtypes)) if d is not None and a.dtype != d]
        if keep:
            cast = _cast_to([arrays[item][i] for i in keep], [dtypes[i] for i in keep])
            for i, a in zip(keep, cast):
                arrays[item][i] = a
    by_name = {item: {".".join(parts): a for (parts, _, _), a in zip(wanted, arrays[item])}
               for item, wanted in targets.items()}
    return _rebuild(like, by_name, meta)


def _rebuild(like, arrays: dict[str, dict[str, Any]], meta: dict):
    """``like`` with its arrays from ``arrays`` (per item, by name on disk)."""
    info = meta["redeqx"]["leaves"]

    def fill(tree, item, names):
        it = iter(names)
        leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_none)
        out = []
        for x in leaves:
            if not _is_arraylike(x):
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


# ----------------------------------------------------------------------------- manager

_STEP_DIR = re.compile(r"^step_(\d+)$")

# Managers with a save in flight. At exit each is waited for while its writer threads
# still run: Python stops concurrent.futures' workers in threading's own exit hooks,
# before atexit's, so an atexit hook found the writer gone and the checkpoint lost.
# threading's hooks run newest first, so one registered after orbax's executors
# exist runs before they are shut down.
_IN_FLIGHT: set = set()
_HOOKED = []


def _finish_in_flight() -> None:
    for manager in list(_IN_FLIGHT):
        try:
            manager.close()
        except Exception as e:  # exit goes on; say what was lost
            warnings.warn(f"redeqx.CheckpointManager: a save in flight at exit failed: {e}", stacklevel=1)


def _register_exit_hook() -> None:
    if not _HOOKED:
        getattr(threading, "_register_atexit", atexit.register)(_finish_in_flight)
        _HOOKED.append(True)


def _check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


def _warn_moved_position(meta: dict, mesh: Mesh, path: Path) -> None:
    """A mid-epoch position is a batch index, and a batch is
    ``per_device_batch_size * data`` examples: on another ``data`` size,
    ``batches(..., start=batch)`` starts at another example."""
    saved, now = meta.get("data_shards"), mesh.shape[DATA]
    if meta.get("batch", 0) and saved is not None and saved != now:
        warnings.warn(
            f"redeqx.CheckpointManager: {path.name} was saved mid-epoch (next batch {meta['batch']}) on a mesh with "
            f"data={saved}, and this mesh has data={now}: with the same per_device_batch_size a batch is "
            f"{now}/{saved} as many examples, so batches(..., start={meta['batch']}) would skip or repeat examples "
            "of this epoch. Resume on the same data size to finish the epoch, scale per_device_batch_size by "
            f"{saved}/{now}, or restart the epoch (start=0).",
            stacklevel=3,
        )


class CheckpointManager:
    """A run's checkpoints in ``workdir/checkpoints/step_<step>/``: which to
    write, which to keep, and which to restore.

    - ``every=k``, ``unit="step"``: `save` writes when ``state.step`` is a
      multiple of ``k``; ``unit="epoch"``: when ``epoch`` (the epoch to resume
      at, so ``epoch + 1`` after finishing epoch ``epoch``) is. A save whose
      metrics beat a tracked best, or with ``force=True``, always writes.
    - ``keep_last=n`` keeps the ``n`` newest; ``best={"accuracy": "max",
      "loss": "min"}`` also keeps the best checkpoint by each metric (read
      from the ``metrics`` given to `save`). Others are deleted after a newer
      save has completed.
    - ``async_save=True`` (default): `save` returns once the arrays are copied
      off the devices and writes them in a background thread, overlapping the
      next training steps. The next `save`, `restore`, `close` or interpreter
      exit waits for it.
    - Atomic: a checkpoint directory appears only when complete (orbax writes
      to a temporary directory and renames it), so a run killed at any moment,
      even with SIGKILL, never leaves a half checkpoint that `latest` or
      `best` would pick; leftovers are removed when the next manager starts.
      `restore` skips a checkpoint that is unreadable (truncated, corrupted)
      with a warning naming it, and falls back to the previous one.

    `save` keeps the data position for an exact resume: ``epoch`` and
    ``batch`` (the next batch to run, as ``batches(..., start=batch)``) and
    ``data_key`` (the key the epoch's shuffle order came from), with the
    mesh's ``data`` size: `restore` warns when a mid-epoch position is
    resumed on another ``data`` size, where the same batch index is another
    example.

    **Example:**

    ```python
    manager = redeqx.CheckpointManager("runs/mnist", keep_last=1, best={"accuracy": "max"})
    found = manager.restore(state, mesh, specs)          # None on a fresh run
    if found is not None:
        state, meta = found                              # meta["epoch"], meta["batch"], ...
    ...
    manager.save(state, epoch=epoch + 1, metrics={"accuracy": acc})
    manager.close()
    ```
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        keep_last: int = 1,
        every: int = 1,
        unit: Literal["step", "epoch"] = "step",
        best: Mapping[str, Literal["max", "min"]] | None = None,
        async_save: bool = True,
        dtype=None,
    ):
        self.keep_last = _check_count("keep_last", keep_last, 1)
        self.every = _check_count("every", every, 1)
        if unit not in ("step", "epoch"):
            raise ValueError(f"unit must be 'step' or 'epoch', got {unit!r}.")
        self.unit = unit
        best = dict(best or {})
        for name, mode in best.items():
            if mode not in ("max", "min"):
                raise ValueError(f"best[{name!r}] must be 'max' or 'min', got {mode!r}: e.g. best={{'accuracy': 'max'}}.")
        self.best_modes = best
        self.dtype = _check_dtype(dtype)
        self.directory = Path(workdir) / "checkpoints"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create the checkpoint directory {self.directory}: {e}.") from e
        handler = ocp.CompositeCheckpointHandler()
        self._checkpointer = ocp.AsyncCheckpointer(handler) if async_save else ocp.Checkpointer(handler)
        self._pending: Path | None = None
        self._meta: dict[str, dict | None] = {}
        self._lock = threading.Lock()
        self._clean_leftovers()
        _register_exit_hook()

    # -- what is on disk

    def _clean_leftovers(self) -> None:
        """Removes unfinished saves and half-deleted checkpoints of earlier runs."""
        if jax.process_index() != 0:
            return
        for p in self.directory.iterdir():
            if _TMP_MARKER in p.name or p.name.endswith(".deleting"):
                shutil.rmtree(p, ignore_errors=True)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first."""
        found = (_STEP_DIR.match(p.name) for p in self.directory.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, step: int) -> Path:
        return self.directory / f"step_{int(step):09d}"

    @property
    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def _metadata(self, path: Path) -> dict | None:
        if path.name not in self._meta:
            try:
                self._meta[path.name] = _raw_metadata(path)
            except CheckpointError:
                return None  # not cached: it may be a save still in flight
        return self._meta[path.name]

    def _metric(self, path: Path, name: str) -> float | None:
        meta = self._metadata(path)
        value = (meta or {}).get("metrics", {}).get(name) if isinstance((meta or {}).get("metrics"), dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        return None

    def _ranked(self, name: str, paths: list[Path]) -> list[Path]:
        scored = [(v, p) for p in paths if (v := self._metric(p, name)) is not None]
        scored.sort(key=lambda vp: vp[0], reverse=self.best_modes.get(name, "max") == "max")
        return [p for _, p in scored]

    def best(self, metric: str) -> Path | None:
        """The complete checkpoint with the best ``metric`` (per ``best=``), or None."""
        if metric not in self.best_modes:
            raise ValueError(f"metric {metric!r} is not tracked; this manager tracks best={self.best_modes}.")
        ranked = self._ranked(metric, [self.path(s) for s in self.steps()])
        return ranked[0] if ranked else None

    # -- writing

    def _improves(self, metrics: Mapping[str, Any]) -> bool:
        paths = [self.path(s) for s in self.steps()] + ([self._pending] if self._pending else [])
        for name, mode in self.best_modes.items():
            value = metrics.get(name)
            if value is None:
                continue
            value = float(np.asarray(jax.device_get(value)))
            if not math.isfinite(value):
                continue
            ranked = self._ranked(name, paths)
            if not ranked:
                return True
            top = self._metric(ranked[0], name)
            if (value > top) if mode == "max" else (value < top):
                return True
        return False

    def save(
        self,
        state: PyTree,
        *,
        epoch: int = 0,
        batch: int = 0,
        data_key=None,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        step: int | None = None,
        force: bool = False,
    ) -> bool:
        """Save ``state`` if due (see the class docstring); returns whether it did.

        ``epoch``/``batch``/``data_key`` are where to resume the data (the next
        batch to run), ``metrics`` what to rank by, ``metadata`` anything else
        JSON-able. ``step`` defaults to ``state.step`` (give it for a bare model).
        """
        refuse_deleted(named_leaves(state), "state")
        if step is None:
            step = _step_of(state)
            if step is None:
                raise ValueError(
                    "save(state) needs step= here: only a TrainState (or a tree of TrainStates at one step) "
                    "carries its own step."
                )
        step = _check_count("step", step, 0)
        epoch = _check_count("epoch", epoch, 0)
        batch = _check_count("batch", batch, 0)
        metrics = dict(metrics or {})
        counter = step if self.unit == "step" else epoch
        if not (force or counter % self.every == 0 or self._improves(metrics)):
            return False
        self._finish()
        path = self.path(step)
        if path.exists():
            return False  # this step is already saved (e.g. just restored from it)
        meta = {**dict(metadata or {}), "step": step, "epoch": epoch, "batch": batch, "metrics": metrics}
        if data_key is not None:
            meta["data_key"] = data_key
        if (n_data := _data_shards_of(state)) is not None:
            meta["data_shards"] = n_data
        args, full = _prepare(state, meta, self.dtype)
        with self._lock:
            _write(self._checkpointer, path, args)
            self._meta[path.name] = full
            self._pending = path
            _IN_FLIGHT.add(self)  # kept alive until written, even if the caller drops the manager
        if not isinstance(self._checkpointer, ocp.AsyncCheckpointer):
            self._finish()
        return True

    def _finish(self) -> None:
        """Waits for the save in flight, then deletes what is no longer kept."""
        with self._lock:
            pending, self._pending = self._pending, None
            _IN_FLIGHT.discard(self)
            if pending is not None:
                try:
                    if isinstance(self._checkpointer, ocp.AsyncCheckpointer):
                        self._checkpointer.wait_until_finished()
                except Exception as e:
                    self._meta.pop(pending.name, None)
                    _remove_partial(pending)
                    raise CheckpointError(
                        f"could not write the checkpoint to {pending} ({type(e).__name__}: {e}). Earlier "
                        "checkpoints are untouched; check that the directory is writable and the disk has room."
                    ) from e
                self._prune()  # only after a save of ours is complete

    def _prune(self) -> None:
        if jax.process_index() != 0:
            return
        # checkpoints whose metadata cannot be read are neither counted nor deleted
        paths = [p for p in (self.path(s) for s in self.steps()) if self._metadata(p) is not None]
        keep = set(paths[-self.keep_last:])
        for name in self.best_modes:
            keep.update(self._ranked(name, paths)[:1])
        for p in paths:
            if p not in keep:
                # rename first: a half-deleted checkpoint must never look complete
                doomed = p.with_name(p.name + ".deleting")
                os.rename(p, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
                self._meta.pop(p.name, None)

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk."""
        self._finish()

    def close(self) -> None:
        """Wait for the save in flight and release the writer (also run at exit)."""
        if self._checkpointer is None:
            return
        try:
            self._finish()
        finally:
            self._checkpointer.close()
            self._checkpointer = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading

    def restore(self, like: PyTree, mesh: Mesh, specs: PyTree = None, *, best: str | None = None):
        """``(state, metadata)`` from the latest complete checkpoint (or the
        best by metric ``best``), or None if there is none yet. A checkpoint
        that cannot be read is skipped with a warning naming it and the next
        one (older, or next best) is tried. ``like``/``mesh``/``specs`` are as
        in `restore_checkpoint` (a model as ``like`` restores parameters only).
        """
        if self._checkpointer is not None:
            self._finish()
        if best is None:
            candidates = [self.path(s) for s in reversed(self.steps())]
        else:
            if best not in self.best_modes:
                raise ValueError(f"best={best!r} is not tracked; this manager tracks best={self.best_modes}.")
            candidates = self._ranked(best, [self.path(s) for s in self.steps()])
        failures = []
        for path in candidates:
            try:
                state = restore_checkpoint(path, like, mesh, specs)
                meta = read_metadata(path)
                _warn_moved_position(meta, mesh, path)
                return state, meta
            except CheckpointError as e:
                failures.append(str(e))
                warnings.warn(f"redeqx.CheckpointManager: skipping {path}: {e}", stacklevel=2)
        if failures:
            raise CheckpointError(f"no readable checkpoint in {self.directory}:\n" + "\n".join(failures))
        return None
