"""``make_train_step(..., accumulate=k)`` averages the gradients of ``k``
micro-batches, which is the whole batch's gradient only for a loss that is a
mean over the batch's rows. A mean over the non-padding tokens of the batch
weighs a token of a short micro-batch more; a loss comparing rows (in-batch
negatives) sees fewer rows. Nothing fails, the update is another one: so the
first call of the step compares, on its batch's first rows, the loss of those
rows with the mean of their micro-batches' losses (`loss_gap`), and warns
when they differ (`judge`). A `FirstCallCheck`, as ``shard_mean_loss``'s.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ._loss import call_loss, cast_floats, fn_name, micro_batches
from ._shard_mean import FirstCallCheck, _first_rows
from ._compiled import CompiledStep, Placement
from ._per_shard import per_data_shard
from ..data import check_batch
from ..mesh import DATA
from .._typing import warn_user

TOLERANCE = 1e-4  # relative distance between the rows' loss and their micro-batches' mean, in float32


def loss_gap(loss_fn, accumulate: int, mesh: Mesh):
    """``(state, batch) -> (gap, random, finite)``: on the first ``accumulate`` rows of each data
    shard (one per micro-batch), how far their loss is from the mean of their micro-batches'
    losses (relative), whether the loss depends on its key, and whether it is finite; float32,
    dropout off, forward passes only. A model with a ``model_state`` (BatchNorm's statistics,
    which depend on the rows a pass sees) is not measured."""

    local = per_data_shard(loss_fn, mesh)  # as the step runs it (XLA aborts on some of what it moves)

    def loss_of(model, batch, key):
        model = eqx.nn.inference_mode(model, True)
        return call_loss(local, cast_floats(model, jnp.float32), cast_floats(batch, jnp.float32), key, None)[0]

    def measure(state, batch):
        check_batch(batch, mesh)
        per_shard = {x.shape[0] // mesh.shape[DATA] for x in jax.tree.leaves(batch) if jnp.ndim(x)}
        if state.model_state is not None or any(n % accumulate for n in per_shard):
            return jnp.zeros(()), jnp.zeros((), bool), jnp.ones((), bool)  # the step names a batch it cannot split
        rows = _first_rows(batch, mesh.shape[DATA], accumulate)
        key, other = jax.random.split(state.key)
        whole = loss_of(state.model, rows, key)
        parts = jax.lax.map(lambda micro: loss_of(state.model, micro, key), micro_batches(rows, accumulate, mesh))
        gap = jnp.abs(jnp.mean(parts) - whole) / jnp.maximum(jnp.abs(whole), jnp.finfo(jnp.float32).tiny)
        return gap, whole != loss_of(state.model, rows, other), jnp.isfinite(whole) & jnp.all(jnp.isfinite(parts))

    return measure


def judge(gap, random, finite, loss_fn, accumulate: int) -> None:
    """Warn when the measured loss is not the mean of its micro-batches'."""
    if random or not finite or gap <= TOLERANCE:
        return
    warn_user(
        f"make_train_step(accumulate={accumulate}) averages the gradients of {accumulate} micro-batches, but "
        f"loss_fn {fn_name(loss_fn)!r} is not a mean over the batch's rows: on this batch's first rows its loss "
        f"is {gap:.2g} (relative) away from the mean of their micro-batches' losses, so each step's update is "
        "not the whole batch's. A mean over the non-padding tokens of the whole batch (each micro-batch's "
        "tokens are then weighed by its own count), a loss comparing rows, or a normalisation over the batch "
        "does this. Make loss_fn a mean over rows (each row's mean over its tokens, averaged; or the token sum "
        "divided by a count fixed in advance), or use accumulate=1 with a batch that fits."
    )


def accumulation_check(loss_fn, accumulate: int, mesh: Mesh, placement: Placement) -> FirstCallCheck | None:
    """The first-call check of a train step with ``accumulate`` micro-batches (None for one)."""
    if accumulate == 1:
        return None
    measure = CompiledStep(loss_gap(loss_fn, accumulate, mesh), mesh, placement=placement, what="state",
                           batch_args=(0,))
    return FirstCallCheck(measure, functools.partial(judge, loss_fn=loss_fn, accumulate=accumulate))

