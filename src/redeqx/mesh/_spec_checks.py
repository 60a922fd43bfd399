"""Checks of what a caller hands redeqx, before anything is placed or
compiled: specs against a mesh and a tree, array leaves of other libraries,
PRNG keys, arrays a donating step already consumed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from .._trees import is_none, is_spec, named_leaves
from .._typing import short_repr


def check_specs(specs, mesh: Mesh, name: str = "specs") -> None:
    """``specs`` is a tree of PartitionSpecs (``None`` where there is no array)
    naming only this mesh's axes; an error saying what to pass otherwise."""
    fix = "pass the tree made by redeqx.sharding_rules(model, mesh)"
    if specs is None or isinstance(specs, (str, bytes, int, float)):
        raise TypeError(f"{name}={short_repr(specs)} is not a tree of PartitionSpecs: {fix}.")
    leaves = named_leaves(specs, is_leaf=is_spec)
    bad = [(path, x) for path, x in leaves if not is_spec(x)]
    if bad:
        where, x = bad[0]
        raise TypeError(
            f"{name} holds {short_repr(x)} ({type(x).__name__}) at '{where or '<root>'}', where a PartitionSpec "
            f"or None belongs: {fix}."
        )
    if not any(isinstance(x, P) for _, x in leaves):
        raise ValueError(f"{name} holds no PartitionSpec at all ({short_repr(specs)}): {fix}.")
    for path, spec in leaves:
        for entry in spec or ():
            for axis in entry if isinstance(entry, tuple) else (entry,):
                if axis is not None and axis not in mesh.shape:
                    raise ValueError(
                        f"{name} at '{path}' is {spec}, naming axis {axis!r}; the mesh has axes "
                        f"{tuple(mesh.shape)}."
                    )


def check_specs_match(tree, specs, what: str) -> None:
    """``specs`` has the structure of ``tree`` (same attribute paths), else an
    error listing where they differ."""
    # None fields (a Linear's missing bias) are leaves on both sides here
    tree_paths = [p for p, _ in named_leaves(tree, is_leaf=is_none)]
    spec_paths = [p for p, _ in named_leaves(specs, is_leaf=is_spec)]
    if tree_paths == spec_paths:
        return
    only_tree = [p for p in tree_paths if p not in set(spec_paths)]
    only_specs = [p for p in spec_paths if p not in set(tree_paths)]
    detail = []
    if only_tree:
        detail.append(f"in the {what}, not in specs: {', '.join(only_tree[:5])}{' ...' if len(only_tree) > 5 else ''}")
    if only_specs:
        detail.append(f"in specs, not in the {what}: {', '.join(only_specs[:5])}{' ...' if len(only_specs) > 5 else ''}")
    if not detail:
        detail.append("the same paths in another order")
    raise ValueError(
        f"specs do not match the {what} ({len(spec_paths)} spec leaves for {len(tree_paths)} leaves; "
        + "; ".join(detail) + f"). Build specs from this {what}: redeqx.sharding_rules({what}, mesh)."
    )


def check_leaf(path: str, x, what: str):
    """Arrays of other libraries (a torch tensor) would pass as constants."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) or x is None:
        return
    if hasattr(x, "__array__") or (hasattr(x, "shape") and hasattr(x, "dtype")):
        hint = (" an abstract array: build the real model first (or plan with redeqx.plan)"
                if isinstance(x, jax.ShapeDtypeStruct) else
                "; redeqx places JAX and NumPy arrays only: convert it with jnp.asarray(...)")
        raise TypeError(f"{what} leaf '{path}' is a {type(x).__module__}.{type(x).__qualname__}{hint}.")


def check_key(key) -> None:
    if not (isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)):
        raise TypeError(
            f"key must be a typed PRNG key from jax.random.key(seed), got {type(key).__name__} "
            f"{getattr(key, 'dtype', '')}; write key=jax.random.key(0)."
        )


def refuse_deleted(tree, what: str, paths=None) -> None:
    """A step given an array whose buffer an earlier donating call took would
    crash the process (XLA:CPU segfaults executing it) or fail deep in JAX:
    name the leaf and the usual cause instead. (Paths are spelled out only
    when a leaf was deleted, unless ``paths`` already name ``tree``'s leaves:
    this runs on every step call.)"""
    leaves = jax.tree.leaves(tree)
    if not any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
        return
    for path, x in zip(paths, leaves) if paths is not None else named_leaves(tree):
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError(
                f"leaf '{path}' of the {what} was deleted: an earlier step was given it and donated its memory (a train "
                "step reuses the state it is given for the state it returns). Use what that call returned, e.g. "
                "`state, metrics = train_step(state, batch)`, and evaluate or save that state, not the one passed "
                "in. To keep an old state too, copy it first: jax.tree.map(lambda x: x.copy() if "
                "eqx.is_array(x) else x, state)."
            )
