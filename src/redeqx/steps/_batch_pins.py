"""`batch_over_data`: the model's own layout pins keep the batch split over ``data``.

A model pins its activations' layout where Megatron's plan fixes one (`redeqx.constrain`, or
``jax.lax.with_sharding_constraint``); inside the loss's ``jax.vmap`` over examples, the batch dim is
left free at those pins. With FSDP the partitioner then resolves the clash between the batch (split
over ``data``) and the weights (also split over ``data``) by keeping the whole batch on every device
and splitting the weights' contraction: libtpu compiled a 7B LLaMA's FSDP step with 2.3x the
FLOPs and 6.5x the collective bytes of the same step with the batch pinned (benchmarks/RESULTS.md,
"Pipeline stages"). With a weight split over ``data``, the train and eval steps therefore evaluate
the loss with each pin that leaves its batch dim free naming ``data`` there instead, which is what
``jax.vmap(model, spmd_axis_name="data")`` would do. With pipeline stages they name ``("data",
"stage")``: the rows each stage holds outside the stack are those the pipeline deals it, so the
embedding and the head run on ``1 / S`` of a data shard's rows on each stage, not all of them on every
stage. The batch dim of a pinned value is found by
tracing the loss a second time on half the rows: the dim that halves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from ..data import batch_size
from ..mesh import DATA, STAGE
from .._rewrite import rewritten_by_rows, rows_dim
from ._pipeline import pipelined_layer_scans


def _pin(eqn, eqn_half, axes: tuple[str, ...]):
    """A ``sharding_constraint`` whose batch dim is free, with ``axes`` there; else None."""
    if eqn.primitive.name != "sharding_constraint":
        return None
    p = eqn.params
    spec, free = p["sharding"].spec, p.get("unconstrained_dims") or frozenset()
    d = rows_dim(tuple(eqn.invars[0].aval.shape), tuple(eqn_half.invars[0].aval.shape), 2)
    used = {a for e in spec if e is not None and e is not P.UNCONSTRAINED for a in (e if isinstance(e, tuple) else (e,))}
    if d is None or d is False or d not in free or d >= len(spec) or spec[d] is not P.UNCONSTRAINED or used & set(axes):
        return None
    entries = list(spec)
    entries[d] = axes[0] if len(axes) == 1 else axes
    sharding = NamedSharding(p["sharding"].mesh, P(*entries), memory_kind=p["sharding"].memory_kind)
    return eqn.replace(params={**p, "sharding": sharding, "unconstrained_dims": frozenset(free - {d})})


def batch_pins(mesh, microbatches: int | None, weights_over_data: bool) -> tuple[str, ...]:
    """The axes the batch is pinned to in a step on ``mesh``: ``data`` (and ``stage``, when the
    stages deal each a share of the microbatches) with fsdp or stages; none otherwise."""
    stages = dict(mesh.shape).get(STAGE, 1)
    if stages > 1 and microbatches is not None and microbatches % stages == 0:
        return (DATA, STAGE)
    if stages > 1 or (weights_over_data and mesh.shape[DATA] > 1):
        return (DATA,)
    return ()


def batch_over_data(fn: Callable, *, batch_arg: int = 1, axes: tuple[str, ...] = (DATA,)) -> Callable:
    """``fn(model, ..., batch, ...)`` evaluated with the free batch dim of each of its layout pins
    naming ``axes`` (see the module's text): ``("data", "stage")`` with pipeline stages, whose
    embedding and head then run on the rows the stages deal (`redeqx.steps._pipeline`). Under a
    ``data`` already manual (inside a ``shard_map`` over it), for a batch of one row, or where ``fn``
    cannot be traced on half its rows: ``fn`` as it is (`redeqx._rewrite.rewritten_by_rows`)."""

    @functools.wraps(fn)
    def run(*args):
        rows = batch_size(args[batch_arg])
        if rows < 2 or rows % 2 or set(axes) & set(jax.sharding.get_abstract_mesh().manual_axes):
            return fn(*args)
        return rewritten_by_rows(fn, args, batch_arg, rows, lambda eqn, twin: _pin(eqn, twin, axes))

    return run


def on_mesh(fn: Callable, mesh, microbatches: int | None, *, weights_over_data: bool, specs) -> Callable:
    """``fn`` (a loss) as the train and eval steps run it on ``mesh``: its layout pins naming the
    axes of `batch_pins`, then its stacked layers as a pipeline where the mesh has stages
    (`redeqx.steps._pipeline.pipelined_layer_scans`; ``fn`` itself on a mesh without them)."""
    if pins := batch_pins(mesh, microbatches, weights_over_data):
        fn = batch_over_data(fn, axes=pins)
    return pipelined_layer_scans(fn, mesh, microbatches, weights_over_data=weights_over_data, specs=specs)
