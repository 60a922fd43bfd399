"""Placing arrays on the mesh, and the immutable training state."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from ._rules import path_parts
from ._typing import typechecked


def _is_spec(x) -> bool:
    return isinstance(x, P) or x is None


def named_shardings(specs, mesh: Mesh):
    """PartitionSpec tree -> NamedSharding tree (``None`` stays ``None``)."""
    return jax.tree.map(lambda s: None if s is None else NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def _is_none(x) -> bool:
    return x is None


def _check_specs_match(tree, specs, what: str) -> None:
    # None fields (e.g. a Linear's missing bias) are leaves on both sides here
    tree_def = jax.tree.structure(tree, is_leaf=_is_none)
    spec_def = jax.tree.structure(specs, is_leaf=_is_spec)
    if tree_def.num_leaves != spec_def.num_leaves:
        raise ValueError(
            f"specs do not match {what}: {spec_def.num_leaves} spec leaves for {tree_def.num_leaves} leaves. "
            f"Build specs from this {what} with redeqx.sharding_rules({what}, mesh)."
        )


@typechecked
def shard(tree: PyTree, specs: PyTree, mesh: Mesh) -> PyTree:
    """Places every array leaf of ``tree`` with ``NamedSharding(mesh, spec)``.

    ``specs`` has ``tree``'s structure (as made by `sharding_rules`); non-array
    leaves pass through unchanged.

    **Example:**

    ```python
    model = redeqx.shard(model, redeqx.sharding_rules(model, mesh), mesh)
    ```
    """
    _check_specs_match(tree, specs, "tree")
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_none)
    spec_leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    out = []
    for leaf, spec in zip(leaves, spec_leaves):
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            spec = P() if spec is None else spec
            leaf = jax.device_put(leaf, NamedSharding(mesh, spec))
        out.append(leaf)
    return jax.tree.unflatten(treedef, out)


def _mirror_specs(abstract_state, model, specs):
    """Specs for an optimizer state: a leaf whose tree path ends with a
    parameter's path and has its shape takes that parameter's spec (Adam's mu
    and nu); everything else (counts, scalars) is replicated."""
    by_path: dict[tuple[str, ...], tuple[tuple[int, ...], P]] = {}
    m_leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_none)[0]
    s_leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    for (kp, leaf), spec in zip(m_leaves, s_leaves, strict=True):
        if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):  # abstract models too
            by_path[tuple(path_parts(kp))] = (tuple(leaf.shape), spec)

    def spec_for(kp, leaf):
        parts = tuple(path_parts(kp))
        for start in range(len(parts)):
            hit = by_path.get(parts[start:])
            if hit is not None and hit[0] == tuple(leaf.shape):
                return hit[1] if hit[1] is not None else P()
        return P()

    return jax.tree_util.tree_map_with_path(spec_for, abstract_state)


class TrainState(eqx.Module):
    """Everything a training step reads and returns, as one immutable value.

    ``step`` counts optimizer updates done so far (0 before the first).
    ``key`` is split once per step for the step's randomness (dropout...).
    Replace fields with ``eqx.tree_at`` or ``dataclasses.replace``; steps
    return a new state and never change the old one.
    """

    model: PyTree
    opt_state: optax.OptState
    step: Int[Array, ""]
    key: PRNGKeyArray


def opt_state_specs(optimizer: optax.GradientTransformation, model, specs, trainable=None):
    """PartitionSpecs for the optimizer state of ``model``'s trainable
    parameters, each mirroring the spec of the parameter it belongs to."""
    abstract = jax.eval_shape(optimizer.init, _trainable_params(model, trainable))
    return _mirror_specs(abstract, model, specs)


def _trainable_params(model, trainable):
    params = eqx.filter(model, eqx.is_inexact_array)
    if trainable is None:
        return params
    return eqx.filter(params, trainable)


@typechecked
def init_state(
    model: PyTree,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    specs: PyTree,
    *,
    key: PRNGKeyArray,
    trainable: Any = None,
) -> TrainState:
    """A sharded `TrainState`: the model placed by ``specs`` and the optimizer
    state sharded like the parameters it mirrors (Adam's moments of a weight
    split on ``model`` are split the same way). Nothing is gathered: the
    optimizer state is created by a compiled function that writes each shard
    where it lives.

    ``trainable`` is the same Equinox filter spec given to `make_train_step`:
    frozen leaves get no optimizer state.

    Arrays of ``model`` that already sit where ``specs`` puts them are used
    as they are, not copied (a large model is never held twice); the first
    train step donates them, so keep using ``state.model``, not ``model``.

    **Example:**

    ```python
    state = redeqx.init_state(model, optax.adamw(1e-3), mesh, specs, key=jax.random.key(0))
    ```
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation (e.g. optax.adamw(1e-3)), got {type(optimizer).__name__}."
        )
    if not (isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)):
        raise TypeError(
            f"key must be a typed PRNG key from jax.random.key(seed), got {type(key).__name__} "
            f"{getattr(key, 'dtype', '')}; write key=jax.random.key(0)."
        )
    _check_specs_match(model, specs, "model")
    model = shard(model, specs, mesh)
    params = _trainable_params(model, trainable)
    os_specs = opt_state_specs(optimizer, model, specs, trainable)
    init = jax.jit(optimizer.init, out_shardings=named_shardings(os_specs, mesh))
    opt_state = init(params)
    replicated = NamedSharding(mesh, P())
    return TrainState(
        model=model,
        opt_state=opt_state,
        step=jax.device_put(jnp.zeros((), jnp.int32), replicated),
        # Placed through its raw data: device_put refuses a typed key for a
        # sharding that spans other processes' devices.
        key=jax.random.wrap_key_data(
            jax.device_put(jax.random.key_data(key), replicated), impl=jax.random.key_impl(key)
        ),
    )
