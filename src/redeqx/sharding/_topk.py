"""The k largest of split features: ``lax.top_k`` along a dim a layer splits (a TopK sparse
autoencoder's latents). This JAX's partitioner gathers the operand whole along that dim and picks
the k on every device, so the split goes on (its layer and the layer that contracts the kept
latents pair) at the price of that gather, which the block is weighed by (`_pricing.acts`); the k
values and their indices are whole. Written back into zeros of the operand's shape at those
indices (``zeros.at[rows, idx].set(v)``, as TopK autoencoders write it), the latents land where
the operand's split was, and the layer that contracts them is its row partner."""

from __future__ import annotations

from . import _ops
from ._reader import Reader, _shape, nbytes

CARRIES_INDICES = frozenset("broadcast_in_dim reshape concatenate convert_element_type squeeze "
                            "add sub lt select_n".split())
"""Ops between ``top_k``'s indices and a scatter's: jnp's indexing makes them non-negative
(``where(i < 0, i + n, i)``), broadcasts the rows' positions beside them and concatenates the two."""


def top_k(r: Reader, eqn) -> None:
    src = eqn.invars[0]
    axis = eqn.params.get("axis", len(_shape(src)) - 1) % len(_shape(src))
    split = [s for s, d in r.tag(src).items() if d == axis and s not in r.facts.blocked]
    if not split:
        return _ops.ordered(r, eqn)
    for seed in split:
        r.facts.gathers[seed] = r.facts.gathers.get(seed, 0) + r.trips * nbytes(src)
    tags = {s: d for s, d in r.tag(src).items() if d != axis}
    for out in eqn.outvars:
        r.set_tags(out, dict(tags), "top_k")
    r.positions[eqn.outvars[1]] = (tuple(split), axis, _shape(src))


def carrying_indices(handler):
    """``handler``, and its outputs hold the positions along a split dim that an input holds."""
    def run(r: Reader, eqn) -> None:
        handler(r, eqn)
        found = next((p for v in eqn.invars if (p := r.position(v)) is not None), None)
        for out in eqn.outvars:
            if found is None:
                r.positions.pop(out, None)  # (a body read before)
            else:
                r.positions[out] = found
    return run


def scatter(r: Reader, eqn) -> None:
    """A scatter of whole updates into zeros (a static operand) at positions ``top_k`` picked along
    a split dim of an activation of the operand's shape: its output is split there too."""
    _ops.scatter(r, eqn)
    operand, indices = eqn.invars[:2]
    if r.position(indices) is None or not r.is_static(operand):
        return
    seeds, axis, shape = r.position(indices)
    if _shape(operand) == shape and axis in eqn.params["dimension_numbers"].scatter_dims_to_operand_dims:
        tags = dict(r.tag(eqn.outvars[0]))
        for seed in seeds:
            tags.setdefault(seed, axis)
        r.set_tags(eqn.outvars[0], tags, eqn.primitive.name)
