"""Stacked layers: which array leaves of a model carry leading layer axes.

A stack is a module built once per layer and stacked (``eqx.filter_vmap`` of
its constructor over keys, as Equinox recommends for ``lax.scan``): every
array has one more leading dim than the module declares. A module says how
many dims its arrays have in one layer exactly where it can: Equinox's layers
by their static fields (a Linear's weight has 2, a 2-D conv's 4, a
LayerNorm's as many as its ``shape``), any module by a jaxtyping annotation
with a fixed number of dims (``weight: Float[Array, "out in"]``). A module
whose declared leaves all carry ``n`` more dims than declared is a stack of
depth ``n``; its other leaves (bare arrays with no annotation) carry the same
``n`` layer axes. Stacks may nest (a stack of stacks: two layer axes).
"""

from __future__ import annotations

import functools
import types
import typing

import equinox as eqx
import jax

from .._trees import is_array_like, path_parts

_NORM_SHAPE = (eqx.nn.LayerNorm, eqx.nn.RMSNorm)


def _shape_ndim(shape) -> int:
    return 0 if shape is None else (1 if isinstance(shape, int) else len(shape))


def _equinox_ndim(module, name: str) -> int | None:
    """How many dims field ``name`` has in one layer, for Equinox's own layers."""
    if isinstance(module, (eqx.nn.Linear, eqx.nn.Embedding)):
        return {"weight": 2, "bias": 1}.get(name)
    if isinstance(module, (eqx.nn.Conv, eqx.nn.ConvTranspose)):
        n = module.num_spatial_dims
        return {"weight": 2 + n, "bias": 1 + n}.get(name)
    if isinstance(module, _NORM_SHAPE):
        return _shape_ndim(module.shape) if name in ("weight", "bias") else None
    if isinstance(module, (eqx.nn.GRUCell, eqx.nn.LSTMCell)):
        return {"weight_ih": 2, "weight_hh": 2, "bias": 1, "bias_n": 1}.get(name)
    if isinstance(module, (eqx.nn.GroupNorm, eqx.nn.BatchNorm)):
        return {"weight": 1, "bias": 1}.get(name)
    return None


@functools.lru_cache(maxsize=None)
def _annotated_ndims(cls) -> dict[str, int]:
    """Fields of ``cls`` annotated with a jaxtyping array type of fixed rank."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        return {}
    out = {}
    for name, hint in hints.items():
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        ranks = {len(h.dims) for h in options
                 if hasattr(h, "dims") and hasattr(h, "index_variadic") and h.index_variadic is None}
        if len(ranks) == 1:
            out[name] = ranks.pop()
    return out


def declared_ndim(module, name: str) -> int | None:
    """How many dims field ``name`` of ``module`` has in one layer, where the
    module says (Equinox's static fields, or a jaxtyping annotation); None
    where it does not."""
    if not isinstance(module, eqx.Module):
        return None
    found = _equinox_ndim(module, name)
    return found if found is not None else _annotated_ndims(type(module)).get(name)


def _child(obj, key):
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(obj, key.name, None)
    if isinstance(key, jax.tree_util.SequenceKey):
        return obj[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        return obj[key.key]
    return None


class StackError(ValueError):
    """Leaves of one stack that disagree on its layer axes."""


def layer_axes(model) -> list[int]:
    """For each array leaf of ``model`` (concrete or abstract, in flatten
    order), how many leading layer axes it carries."""
    flat = [(kp, x) for kp, x in jax.tree_util.tree_flatten_with_path(model)[0] if is_array_like(x)]
    extra: list[int | None] = []
    for kp, x in flat:
        parent = model
        for k in kp[:-1]:
            parent = _child(parent, k) if parent is not None else None
        key = kp[-1] if kp else None
        ndim = declared_ndim(parent, key.name) if isinstance(key, jax.tree_util.GetAttrKey) else None
        extra.append(None if ndim is None or x.ndim < ndim else x.ndim - ndim)
    paths = [tuple(path_parts(kp)) for kp, _ in flat]
    axes = [0] * len(flat)

    def visit(members: list[int], depth: int, inherited: int) -> None:
        known = [extra[i] for i in members if extra[i] is not None]
        level = max(inherited, min(known)) if known else inherited
        if level > inherited:  # this node is a stack: every leaf under it carries these axes
            leading = {tuple(flat[i][1].shape[:level]) for i in members if flat[i][1].ndim >= level}
            short = [i for i in members if flat[i][1].ndim < level]
            if short or len(leading) != 1:
                where = ".".join(paths[members[0]][:depth]) or "<root>"
                raise StackError(
                    f"the leaves under '{where}' look stacked ({level} leading layer axes, from the layers "
                    f"under it) but do not all share leading dims: {sorted(leading)}"
                    + (f"; {'.'.join(paths[short[0]])} has shape {tuple(flat[short[0]][1].shape)}" if short else "")
                    + ". Build a stack with eqx.filter_vmap over one module, so every array gets the same layer axes."
                )
        groups: dict[str, list[int]] = {}
        for i in members:
            if len(paths[i]) > depth + 1:
                groups.setdefault(paths[i][depth], []).append(i)
            else:
                axes[i] = level
        for group in groups.values():
            visit(group, depth + 1, level)

    visit(list(range(len(flat))), 0, 0)
    return axes
