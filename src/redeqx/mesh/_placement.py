"""Placing arrays on the mesh: a spec's `NamedSharding` (`sharding_of`,
`named_shardings`), one array (`place`, never sharing memory with its input
when asked), a tree by its specs (`shard`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from ._mesh import check_mesh
from ._spec_checks import check_leaf, check_specs, check_specs_match
from .._trees import is_array, is_none, is_spec, named_leaves
from .._typing import typechecked


def named_shardings(specs, mesh: Mesh):
    """PartitionSpec tree -> NamedSharding tree (``None`` stays ``None``): the one place a spec meets a mesh."""
    return jax.tree.map(lambda s: None if s is None else NamedSharding(mesh, s), specs, is_leaf=is_spec)


def sharding_of(spec: P | None, mesh: Mesh) -> NamedSharding:
    """One leaf's NamedSharding; ``None`` (no spec) is replicated."""
    return NamedSharding(mesh, P() if spec is None else spec)


def _buffers(x) -> set | None:
    """The memory ``x`` lives in, as buffer addresses (None: cannot tell)."""
    if isinstance(x, np.ndarray):
        return {x.__array_interface__["data"][0]}
    if isinstance(x, jax.Array):
        try:
            return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        except Exception:
            return None
    return set()


@functools.lru_cache(maxsize=None)
def _copier(sharding):
    return jax.jit(jnp.copy, out_shardings=sharding)


def place(x, sharding: NamedSharding, *, copy: bool):
    """``x`` laid out by ``sharding``. With ``copy=True`` the result never
    shares memory with ``x``: ``jax.device_put`` hands back ``x`` itself, or
    an array whose shard on ``x``'s device is ``x``'s buffer (a replicated
    placement), and a donating step would then delete the caller's array."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        # through its raw data: device_put refuses a typed key for a sharding that
        # spans other processes' devices
        return jax.random.wrap_key_data(place(jax.random.key_data(x), sharding, copy=copy),
                                        impl=jax.random.key_impl(x))
    y = jax.device_put(x, sharding)
    if copy:
        before, after = _buffers(x), _buffers(y)
        if y is x or before is None or after is None or before & after:
            y = _copier(sharding)(y)
    return y


@typechecked
def shard(tree: PyTree, specs: PyTree, mesh: Mesh) -> PyTree:
    """Places every array leaf of ``tree`` with ``NamedSharding(mesh, spec)``.

    ``specs`` has ``tree``'s structure (as made by `sharding_rules`); non-array
    leaves pass through unchanged. The result never shares memory with
    ``tree`` (an array already in place is copied), so a donating step can
    consume it while ``tree`` stays usable.

    **Example:**

    ```python
    model = redeqx.shard(model, redeqx.sharding_rules(model, mesh), mesh)
    ```
    """
    mesh = check_mesh(mesh)
    check_specs(specs, mesh)
    return place_tree(tree, specs, mesh, copy=True, what="tree")


def place_tree(tree, specs, mesh: Mesh, *, copy: bool, what: str):
    check_specs_match(tree, specs, what)
    placed = []
    for (path, leaf), spec in zip(named_leaves(tree, is_leaf=is_none), jax.tree.leaves(specs, is_leaf=is_spec)):
        check_leaf(path, leaf, what)
        placed.append(place(leaf, sharding_of(spec, mesh), copy=copy) if is_array(leaf)
                      else leaf)
    return jax.tree.unflatten(jax.tree.structure(tree, is_leaf=is_none), placed)


def replicate_key(key, mesh: Mesh):
    return place(key, NamedSharding(mesh, P()), copy=True)
