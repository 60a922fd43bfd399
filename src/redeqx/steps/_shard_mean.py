"""``make_train_step(..., shard_mean_loss=True)``: each data shard's gradients
from its own rows, averaged with one all-reduce, as ``jax.pmap`` data
parallelism does. Why: the partitioner (Shardy, this JAX's default) reduces the terms of a parameter used twice
(a tied embedding's lookup and head) one after the other; averaging each
shard's summed gradient reduces it once (benchmarks/RESULTS.md, History: "A tied
embedding's gradient").

It holds only for a loss that is a mean over the batch's rows, so the first
call of the step checks that on its batch (a `FirstCallCheck`: `gradient_gap`
measured, then `judge`d). `by_shard` is the one entry from
`make_train_step`: the gradient function and that check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from ._compiled import CompiledStep, Placement
from ._loss import GradFn, accumulated, fn_name, loss_and_grads
from ._per_shard import per_data_shard
from ..data import check_batch
from ..mesh import DATA
from ..state import split_trainable
from .._trees import is_spec, named_leaves
from .._typing import warn_user

TOLERANCE = 1e-3  # relative L2 distance between the shards' mean gradient and the whole batch's


def by_shard(grad_fn: GradFn, loss_fn, accumulate: int, mesh: Mesh, specs, trainable,
             placement: Placement) -> tuple[GradFn, FirstCallCheck | None]:
    """``shard_mean_loss=True`` for `make_train_step`: ``grad_fn`` (of one
    micro-batch) accumulated on each data shard's rows and averaged over
    ``data`` (`shard_mean`), and the check of the promise that ``loss_fn`` is
    a mean over rows, to run on the step's first call (None with one data
    shard, where the shards' mean is the loss)."""
    check_whole_over_data(specs)
    grads_of = shard_mean(accumulated(grad_fn, accumulate, None), mesh)
    if mesh.shape[DATA] == 1:
        return grads_of, None
    measure = CompiledStep(gradient_gap(loss_fn, accumulate, mesh, trainable), mesh, placement=placement,
                           what="state", batch_args=(0,))
    return grads_of, FirstCallCheck(measure, functools.partial(judge, loss_fn=loss_fn))


class FirstCallCheck:
    """A promise checked on a step's first arguments: ``judge`` of what the
    compiled ``measure`` finds (fetched to the host). A step's
    ``first_call_check`` (`StepFunction`)."""

    def __init__(self, measure: CompiledStep, judge: Callable):
        self.measure, self.judge = measure, judge

    def __call__(self, *args) -> None:
        self.judge(*jax.device_get(self.measure(*args)))

    def lower(self, *args):
        return self.measure.lower(*args)


def refuse_model_state(model_state) -> None:
    if model_state is not None:
        raise ValueError(
            "shard_mean_loss=True cannot keep a model_state: a state such as BatchNorm's statistics depends on "
            "the whole batch, not on each data shard's rows. Drop shard_mean_loss."
        )


def check_whole_over_data(specs) -> None:
    """Every parameter whole on each data shard (``fsdp`` splits them over data)."""
    split = [(path, s) for path, s in named_leaves(specs, is_leaf=is_spec)
             if isinstance(s, P) and any(DATA in (e if isinstance(e, tuple) else (e,)) for e in s)]
    if split:
        path, spec = split[0]
        raise ValueError(
            f"shard_mean_loss=True needs every parameter whole on each data shard, but specs split '{path}' as "
            f"{spec} over '{DATA}' ({len(split)} such leaves; fsdp=True in redeqx.sharding_rules does this). Use "
            "fsdp or shard_mean_loss, not both."
        )


def shard_mean(grad_fn: GradFn, mesh: Mesh) -> GradFn:
    """``grad_fn`` run on each data shard's own rows (under ``jax.shard_map``
    over ``data``; ``model`` stays the partitioner's inside), then one mean over
    ``data``. Dropout draws from ``fold_in(key, shard)``."""

    def grads_of(params, static, batch, key, model_state):
        refuse_model_state(model_state)

        def on_shard(params, batch, key):
            key = jax.random.fold_in(key, jax.lax.axis_index(DATA))
            loss, aux, grads, _ = grad_fn(params, static, batch, key, None)
            return jax.lax.pmean((loss, aux, grads), DATA)

        rows = jax.tree.map(lambda x: P(DATA) if jnp.ndim(x) else P(), batch)
        loss, aux, grads = jax.shard_map(on_shard, mesh=mesh, in_specs=(P(), rows, P()), out_specs=P(),
                                         axis_names=frozenset({DATA}), check_vma=False)(params, batch, key)
        return loss, aux, grads, None

    return grads_of


def _first_rows(batch, n_data: int, rows: int):
    """The first ``rows`` rows of each data shard's part of ``batch``."""

    def take(x):
        if not jnp.ndim(x):
            return x
        x = x.reshape(n_data, x.shape[0] // n_data, *x.shape[1:])[:, :rows]
        return x.reshape(n_data * rows, *x.shape[2:])

    return jax.tree.map(take, batch)


def gradient_gap(loss_fn, accumulate: int, mesh: Mesh, trainable):
    """``(state, batch) -> (gap, random, finite)``: how far the whole
    batch's gradients are from the shards' mean (relative L2), whether the
    loss depends on its key, and whether the whole batch's loss and
    gradients are finite; all in float32 with dropout off, so rounding stays
    far below `TOLERANCE`. On the first ``accumulate`` rows of each data
    shard (one per micro-batch): the promise is about how ``loss_fn``
    combines rows, and so few rows keep the check's memory well below the
    step's."""
    exact = loss_and_grads(loss_fn, jnp.float32, inference=True)
    # the whole batch's loss run as the step runs it (`per_data_shard`: XLA aborts on some of what it moves)
    whole = accumulated(loss_and_grads(per_data_shard(loss_fn, mesh), jnp.float32, inference=True), accumulate, mesh)
    by_shard = shard_mean(accumulated(exact, accumulate, None), mesh)

    def measure(state, batch):
        refuse_model_state(state.model_state)
        check_batch(batch, mesh)
        batch = _first_rows(batch, mesh.shape[DATA], accumulate)
        params, static = split_trainable(state.model, trainable)
        key, other = jax.random.split(state.key)
        loss, _, grads, _ = whole(params, static, batch, key, None)
        loss_other = whole(params, static, batch, other, None)[0]
        _, _, shard_grads, _ = by_shard(params, static, batch, key, None)
        apart, size = optax.tree.norm(jax.tree.map(jnp.subtract, shard_grads, grads)), optax.tree.norm(grads)
        return jnp.where(apart == 0, 0.0, apart / size), loss != loss_other, jnp.isfinite(size) & jnp.isfinite(loss)

    return measure


def judge(gap, random, whole_finite, loss_fn) -> None:
    """Raise (or warn, when the promise cannot be checked) on the first
    call's measurement."""
    name = fn_name(loss_fn)
    if not np.isfinite(gap) and whole_finite:  # a row mean is not finite on the batch and NaN on a shard
        raise ValueError(
            f"shard_mean_loss=True, but loss_fn {name!r} is not the mean of its values on equal slices of the "
            "batch: on this batch's first rows of each data shard, the whole batch's gradients are finite and "
            "some shard's are not (a shard with no tokens to average over divides 0 by 0). A mean over the "
            "non-padding tokens of the whole batch does this. Drop shard_mean_loss (the step then differentiates "
            "the loss of the whole batch), or make loss_fn a mean over its rows."
        )
    if not np.isfinite(gap):
        warn_user(
            f"shard_mean_loss=True is unchecked: loss_fn {name!r} gave non-finite gradients on the first batch "
            "(checked in float32, dropout off), so they cannot be compared."
        )
    elif random:
        warn_user(
            f"shard_mean_loss=True is unchecked: loss_fn {name!r} draws random numbers from its key even with "
            "dropout off, so its whole-batch and per-shard gradients cannot be compared."
        )
    elif gap > TOLERANCE:
        raise ValueError(
            f"shard_mean_loss=True, but loss_fn {name!r} is not the mean of its values on equal slices of the "
            f"batch: on this batch's first rows of each data shard, the shards' mean gradient is {gap:.2g} "
            f"(relative L2) away from the whole's (tolerance {TOLERANCE:g}). A mean over non-padding tokens, a "
            "loss comparing rows, or a normalisation over the batch does this. Drop shard_mean_loss (the step "
            "then differentiates the loss of the whole batch), or make loss_fn a mean over its rows."
        )
