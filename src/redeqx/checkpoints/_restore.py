"""Reading with orbax: `restore_checkpoint` reads each device's shards of
the arrays ``like`` names straight from disk, checks them against their
hashes, and puts them back into ``like``'s structure."""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from .. import _hooks
from .._json import is_key as _is_key
from ..mesh import check_mesh, same_devices
from ..state import mirror_specs as _mirror_specs
from ..mesh import check_specs_match as _check_specs_match
from ..state import TrainState
from .._trees import is_array_like, is_none as _is_none, is_spec as _is_spec, path_parts
from .._typing import typechecked
from ..sharding import sharding_of
from ._format import CheckpointError, array_leaves, leaf_at, nest, train_view
from ._hashing import compile_fingerprints
from ._integrity import check_arrays, check_match, raw_metadata


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
                for parts, x in array_leaves(tree)]

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
        return {"model": live(like.model), "train": live(train_view(like))}
    model_leaves = _leaves_to_read(like.model, mesh, specs)["model"]
    os_specs = _mirror_specs(like.opt_state, like.model, specs, mesh)
    train = []
    for (kp, x), spec in zip(jax.tree_util.tree_flatten_with_path(like.opt_state, is_leaf=_is_none)[0],
                             jax.tree.leaves(os_specs, is_leaf=_is_spec), strict=True):
        if is_array_like(x):
            train.append((("opt_state", *path_parts(kp)), x, sharding_of(spec, mesh)))
    for parts, x in array_leaves(like.model_state):
        sh = getattr(x, "sharding", None)
        keep = isinstance(sh, NamedSharding) and sh.mesh == mesh
        train.append((("model_state", *parts), x, sh if keep else replicated))
    train.append((("step",), like.step, replicated))
    train.append((("key",), stored(like.key), replicated))
    return {"model": model_leaves, "train": train}


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
    check_match(path, meta, to_read)
    saved = meta["redeqx"]["leaves"]
    _check_kinds(path, saved, to_read)
    abstract = _stored(saved, to_read)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the hash's programs compile while orbax reads
        programs = pool.submit(compile_fingerprints, [x for xs in abstract.values() for _, x in xs], False)
        arrays = _read(path, abstract)
    check_arrays(path, saved, arrays, to_read, programs.result())
    _cast_back(arrays, saved, to_read)
    by_name = {item: {".".join(parts): a for (parts, _, _), a in zip(wanted, arrays[item])}
               for item, wanted in to_read.items()}
    return _rebuild(like, by_name, meta)


def _stored(saved: dict, to_read) -> dict[str, list[tuple[tuple[str, ...], jax.ShapeDtypeStruct]]]:
    """The arrays of ``to_read`` as stored (``saved``: the metadata's ``leaves``, for their dtypes)
    and placed on this mesh, abstract."""
    return {item: [(parts, jax.ShapeDtypeStruct(x.shape, jnp.dtype(saved[item][".".join(parts)]["dtype"]),
                                                sharding=sh)) for parts, x, sh in wanted]
            for item, wanted in to_read.items()}


def _read(path: Path, abstract: dict) -> dict[str, list[jax.Array]]:
    """The arrays of ``abstract`` (`_stored`) read from ``path``, each device reading its own shards."""
    args = {item: ocp.args.StandardRestore(nest(pairs)) for item, pairs in abstract.items()}
    _hooks.count_orbax_bytes_without_leaking()
    _hooks.quiet_orbax_unraisable()
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(path, args=ocp.args.Composite(**args))
    except Exception as e:
        raise CheckpointError(
            f"checkpoint at {path} is truncated or corrupted: orbax could not read it ({type(e).__name__}: {e})."
        ) from e
    return {item: [leaf_at(restored[item], parts) for parts, _ in pairs] for item, pairs in abstract.items()}


def _kind(dtype) -> str:
    for kind in (jnp.bool_, jnp.integer, jnp.floating, jnp.complexfloating):
        if jnp.issubdtype(dtype, kind):
            return kind.__name__
    return str(dtype)


def _check_kinds(path: Path, saved: dict, to_read) -> None:
    """Only a cast within a kind (float32 <-> bfloat16): float values read into an int leaf of
    ``like`` would be truncated, an int or bool read as float is some other array than ``like``'s."""
    wrong = []
    for item, wanted in to_read.items():
        for parts, like_leaf, _ in wanted:
            name = ".".join(parts)
            if jnp.issubdtype(like_leaf.dtype, jax.dtypes.prng_key) or _is_key_data(item, parts, saved):
                continue
            stored = jnp.dtype(saved[item][name]["dtype"])
            if _kind(stored) != _kind(like_leaf.dtype):
                wrong.append(f"{name} (saved {stored}, like has {jnp.dtype(like_leaf.dtype)})")
    if wrong:
        raise ValueError(
            f"restore_checkpoint({str(path)!r}): like's dtypes are of another kind than the checkpoint's for "
            f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}; casting would change the values (floats "
            "truncated to integers). Build like with the dtypes the state was saved with (the same model, "
            "optimizer and init_state call)."
        )


def _cast_back(arrays: dict[str, list[jax.Array]], saved: dict, to_read) -> None:
    """Casts, in place, each array read to the dtype of its leaf of ``like``
    (a checkpoint saved with ``dtype=jnp.bfloat16``); PRNG key data stays."""
    for item, wanted in to_read.items():
        dtypes = [None if jnp.issubdtype(like_leaf.dtype, jax.dtypes.prng_key) or _is_key_data(item, parts, saved)
                  else jnp.dtype(like_leaf.dtype) for parts, like_leaf, _ in wanted]
        keep = [i for i, (a, d) in enumerate(zip(arrays[item], dtypes)) if d is not None and a.dtype != d]
        if keep:
            cast = _cast_to([arrays[item][i] for i in keep], [dtypes[i] for i in keep])
            for i, a in zip(keep, cast):
                arrays[item][i] = a


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
        return [".".join((*prefix, *parts)) for parts, _ in array_leaves(tree)]

    if not isinstance(like, TrainState):
        return fill(like, "model", names(like))
    view = fill(train_view(like), "train", names(train_view(like)))
    return TrainState(model=fill(like.model, "model", names(like.model)), opt_state=view["opt_state"],
                      step=view["step"], key=view["key"], model_state=view["model_state"])
