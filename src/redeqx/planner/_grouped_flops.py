"""The grouped matmuls (``jax.lax.ragged_dot_general``) of a traced program,
counted by their rows, for `redeqx.plan`.

A grouped matmul multiplies each group of rows by its own matrix: ``M`` rows
of ``K`` by ``G`` matrices ``K x N`` cost ``2 M K N`` FLOPs, whatever ``G``.
That is what an accelerator's kernel spends and what libtpu's cost analysis
counts. On a CPU, JAX 0.10 lowers the op as a masked dense product over every
group (each row multiplied by all ``G`` matrices, the others masked to zero),
so XLA:CPU's compiled figure counts ``G`` times the rows' FLOPs (plus the
masks). `overcount` reads the program before lowering, where each grouped
matmul is still one op, and says how much to take off.
"""

from __future__ import annotations

import math

import jax
import jax.extend.core

from ..models import RECOMPUTE


def _rows_flops(eqn) -> float:
    """``2 x`` (the multiply-adds of each row against its own group's matrix)."""
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    dims = eqn.params["ragged_dot_dimension_numbers"]
    (_, rhs_contract), (_, rhs_batch) = dims.dot_dimension_numbers
    rhs_own = [d for d in range(rhs.ndim) if d not in (*rhs_contract, *rhs_batch, *dims.rhs_group_dimensions)]
    return 2.0 * math.prod(lhs.shape) * math.prod(rhs.shape[d] for d in rhs_own)


def _subjaxprs(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _subjaxprs(v)


def grouped_matmuls(jaxpr, times: float = 1.0) -> list[tuple[float, int, float, bool]]:
    """``(FLOPs by rows, groups, lhs elements, recompute)`` of every grouped
    matmul one run of ``jaxpr`` executes (per device inside a ``shard_map``),
    one entry per execution count: a scan's body counts ``length`` times.

    ``recompute``: the backward pass of `redeqx.models.mix_experts`
    recomputing the experts' forward (its name scope says so). Unless the step
    is rematerialised, XLA merges it with the forward pass's identical product
    (common subexpression elimination): the compiled programs, libtpu's and
    XLA:CPU's, compute it once."""
    if isinstance(jaxpr, jax.extend.core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    ragged = [e for e in jaxpr.eqns if e.primitive.name == "ragged_dot_general"]
    found = [(times * _rows_flops(e), int(e.invars[2].aval.shape[-1]), times * math.prod(e.invars[0].aval.shape),
              f"{RECOMPUTE}/jvp" in str(e.source_info.name_stack)) for e in ragged]
    for eqn in jaxpr.eqns:
        inner = times * (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1)
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                found += grouped_matmuls(sub, inner)
    return found


def overcount(jaxpr) -> tuple[float, float]:
    """``(by rows, extra)``: the grouped matmuls' FLOPs counted by their rows,
    each computed once (no recompute, as XLA merges it), and what a count of
    the program as written before XLA:CPU's passes has on top of that: for
    each, ``G - 1`` times its rows' FLOPs and the masks (``4 G`` elementwise
    ops per row element) of JAX's masked dense lowering on a CPU, and the
    rows' FLOPs of each recompute."""
    found = grouped_matmuls(jaxpr)
    by_rows = sum(f for f, _, _, again in found if not again)
    extra = sum(f * (g - 1) + 4 * g * lhs + (f if again else 0) for f, g, lhs, again in found)
    return by_rows, extra
