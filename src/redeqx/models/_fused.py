"""Several tensor-parallel matmuls as one, with their own backward pass.

Column-parallel layers that read the same input (Q/K/V; gate/up) and
row-parallel layers whose outputs are added (GPT-J's attention and MLP
outputs) each need one all-reduce in Megatron's plan, but as separate
matmuls XLA all-reduces every partial sum before adding them. Joining the
weights shard by shard into one matmul gives one partial sum and one
all-reduce (each device joins its own rows, so nothing moves).

A joined weight depends on the parameters only. Under plain autodiff it is
kept from the forward to the backward pass (a second copy of those weights
per layer: 4.3 GiB of LLaMA-7B's 12 GiB of temporaries at 4-way tensor
parallelism), and remat does not help, because a compiler may compute
anything that depends on parameters alone as early as it likes, and XLA:CPU
merges a recomputed join with the forward one. Here the backward pass keeps
only the inputs and the weights themselves; the forward join waits for its
input (an optimization barrier), and the backward join adds an exact zero
computed from each device's own part of the incoming gradient, so no
compiler can merge it with the forward join or run it early: a join lives
only while its layer runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._constrain import constrain
from .._mesh import MODEL


def _views(ws, n: int, axis: int):
    """Each ``(out, in)`` weight viewed with its ``n`` shards on their own axis:
    ``(n, out / n, in)`` (``axis=0``, column parallel) or ``(out, n, in / n)``
    (``axis=1``, row parallel)."""
    if axis == 0:
        return [w.reshape(n, w.shape[0] // n, w.shape[1]) for w in ws]
    return [w.reshape(w.shape[0], n, w.shape[1] // n) for w in ws]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def column_matmul(x, ws: tuple, n: int) -> tuple:
    """``tuple(x @ w.T for w in ws)`` for ``x`` ``(T, in)`` and column-parallel
    weights ``(out_i, in)`` split ``n`` ways on ``out``: one matmul forward,
    one input gradient (one all-reduce) backward."""
    return _column_forward(x, ws, n)


def _column_forward(x, ws, n):
    x, ws = jax.lax.optimization_barrier((x, ws))  # join only when the input is here
    local = [w.shape[0] // n for w in ws]
    w = jnp.concatenate(_views(ws, n, 0), axis=1).astype(x.dtype)
    w = constrain(w, P(MODEL, None, None))
    y = constrain(jnp.einsum("ti,nki->tnk", x, w), P(None, MODEL, None))  # (T, n, sum(local))
    outs, start = [], 0
    for k in local:
        outs.append(y[:, :, start:start + k].reshape(y.shape[0], n * k))
        start += k
    return tuple(outs)


def _column_fwd(x, ws, n):
    return _column_forward(x, ws, n), (x, ws)


def _column_bwd(n, res, cts):
    x, ws = res
    t = x.shape[0]
    ct = jnp.concatenate([c.reshape(t, n, w.shape[0] // n).astype(x.dtype) for c, w in zip(cts, ws)], axis=2)
    ct = constrain(ct, P(None, MODEL, None))
    # Exact zeros from the gradient: the joined weights get one per shard, from this
    # device's own part of it, and the input the weight gradients read gets the input's
    # gradient times zero (already summed over the shards), so neither needs a collective.
    # Both are then made only now, never merged with the forward pass's (which would keep
    # those alive until here).
    w_zero = jnp.sum(jnp.where(jnp.isfinite(ct), ct, 0) * 0, axis=(0, 2))[:, None, None]  # (n, 1, 1)
    w = jnp.concatenate([v.astype(x.dtype) + w_zero for v in _views(ws, n, 0)], axis=1)
    w = constrain(w, P(MODEL, None, None))
    dx = jnp.einsum("tnk,nki->ti", ct, w)  # one partial sum over the shards: one all-reduce
    x = x + jnp.where(jnp.isfinite(dx), dx, 0).astype(x.dtype) * 0
    dws = tuple(
        jnp.einsum("tnk,ti->nki", c.reshape(t, n, w.shape[0] // n).astype(x.dtype), x)
        .reshape(w.shape).astype(w.dtype)
        for c, w in zip(cts, ws)
    )
    return dx, dws


column_matmul.defvjp(_column_fwd, _column_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def row_matmul(xs: tuple, ws: tuple, n: int):
    """``sum(x @ w.T for x, w in zip(xs, ws))`` for inputs ``(T, in_i)`` and
    row-parallel weights ``(out, in_i)`` split ``n`` ways on ``in``: one
    matmul and one partial sum (one all-reduce) forward."""
    return _row_forward(xs, ws, n)


def _row_forward(xs, ws, n):
    xs, ws = jax.lax.optimization_barrier((xs, ws))
    t = xs[0].shape[0]
    dtype = xs[0].dtype
    x = jnp.concatenate([x.reshape(t, n, x.shape[1] // n) for x in xs], axis=2)
    w = jnp.concatenate(_views(ws, n, 1), axis=2).astype(dtype)
    x = constrain(x, P(None, MODEL, None))
    w = constrain(w, P(None, MODEL, None))
    return jnp.einsum("tnk,onk->to", x, w)


def _row_fwd(xs, ws, n):
    return _row_forward(xs, ws, n), (xs, ws)


def _row_bwd(n, res, ct):
    xs, ws = res
    t = ct.shape[0]
    dxs, dws = [], []
    for x, w in zip(xs, ws):  # nothing to sum here: each input's gradient stays on its shards
        xv = constrain(x.reshape(t, n, x.shape[1] // n), P(None, MODEL, None))
        wv = constrain(_views([w], n, 1)[0].astype(ct.dtype), P(None, MODEL, None))
        dxs.append(jnp.einsum("to,onk->tnk", ct, wv).reshape(x.shape).astype(x.dtype))
        dws.append(jnp.einsum("to,tnk->onk", ct, xv.astype(ct.dtype)).reshape(w.shape).astype(w.dtype))
    return tuple(dxs), tuple(dws)


row_matmul.defvjp(_row_fwd, _row_bwd)
