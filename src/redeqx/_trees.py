"""Pytree operations every part of redeqx needs, written once: a leaf's path
as text, what counts as an array, and a tree zipped with its specs."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

CONCRETE_ARRAYS = (jax.Array, np.ndarray, np.generic)


def path_parts(keypath) -> list[str]:
    """A key path as names: ``blocks``, ``0``, ``weight``."""
    parts = []
    for k in keypath:
        if isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, (jax.tree_util.DictKey, jax.tree_util.FlattenedIndexKey)):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return parts


def path_str(keypath) -> str:
    """A key path as `sharding_rules`, `explain` and overrides write it: ``blocks.0.weight``."""
    return ".".join(path_parts(keypath))


def is_none(x) -> bool:
    return x is None


def is_spec(x) -> bool:
    """A leaf of a spec tree: a PartitionSpec, or None where the tree has no array."""
    return isinstance(x, P) or x is None


def is_array(x) -> bool:
    """A concrete array: what a step takes as an input rather than a constant."""
    return isinstance(x, CONCRETE_ARRAYS)


def is_array_like(x) -> bool:
    """A concrete array, or an abstract one (``jax.ShapeDtypeStruct``, as
    ``eqx.filter_eval_shape`` makes them)."""
    return isinstance(x, CONCRETE_ARRAYS + (jax.ShapeDtypeStruct,))


def is_floating(x) -> bool:
    """An array (concrete or abstract) of a floating dtype: a parameter."""
    return is_array_like(x) and jnp.issubdtype(x.dtype, jnp.floating)


def named_leaves(tree, is_leaf=None) -> list[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf of ``tree``."""
    return [(path_str(kp), x) for kp, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]


def leaves_with_specs(tree, specs) -> list[tuple[str, Any, P]]:
    """``(path, leaf, spec)`` for every array leaf of ``tree`` (concrete or
    abstract), ``spec`` from the spec tree of the same structure (``P()``
    where it says None). Structures are assumed to match (see
    `redeqx.mesh.check_specs_match`): ``None`` fields, such as a Linear's
    missing bias, are leaves on both sides."""
    leaves = named_leaves(tree, is_leaf=is_none)
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    if len(leaves) != len(spec_leaves):
        raise ValueError(
            f"specs have {len(spec_leaves)} leaves for {len(leaves)} leaves of the tree; build specs from this "
            "tree: redeqx.sharding_rules(model, mesh)."
        )
    return [(path, x, P() if s is None else s) for (path, x), s in zip(leaves, spec_leaves) if is_array_like(x)]


def replace_array_leaves(tree, new_leaves) -> Any:
    """``tree`` with its array leaves (concrete or abstract, in flatten order,
    ``None`` fields kept) replaced by ``new_leaves``."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_none)
    it = iter(new_leaves)
    return jax.tree.unflatten(treedef, [next(it) if is_array_like(x) else x for x in leaves])


def per_device_shape(shape, spec: P, mesh) -> tuple[int, ...]:
    """The shape of one device's shard of an array of ``shape`` laid out by ``spec``."""
    out = list(shape)
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        axes = entry if isinstance(entry, tuple) else (entry,)
        out[d] = out[d] // math.prod(mesh.shape[a] for a in axes)
    return tuple(out)


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.50 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
