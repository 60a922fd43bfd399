"""Exact attention over keys a block at a time (an online softmax, and
custom VJPs that recompute the scores from the saved log-sum-exp, as flash
attention does): `gather_attention` over keys gathered over ``context``,
`ring_attention` over keys passed around it. Both run on one context shard,
inside `redeqx.attention`'s ``shard_map``; masks come from positions and
segment ids, never as a ``(T, T)`` array."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ._mesh import CONTEXT, traced_platform


# ----------------------------------------------------------------------------- one block: queries against one shard's keys


def block_scores(q, k, qpos, kpos, qseg, kseg, causal: bool, scale: float):
    """Masked scores (Hkv, G, Tq, Tk) in float32 and the mask (1, 1, Tq, Tk)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(t, hkv, hq // hkv, d)
    s = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = qseg[:, None] == kseg[None, :]
    if causal:
        mask = mask & (kpos[None, :] <= qpos[:, None])
    mask = mask[None, None]  # (1, 1, Tq, Tk)
    return jnp.where(mask, s, -jnp.inf), mask


def _block_forward(carry, q, k, v, qpos, kpos, qseg, kseg, causal, scale):
    """One online-softmax step: running (out, max, sum) updated with one block of keys."""
    o, m, l = carry  # (Hkv, G, Tq, D) f32, (Hkv, G, Tq) f32 x2
    s, _ = block_scores(q, k, qpos, kpos, qseg, kseg, causal, scale)
    m_new = jnp.maximum(m, s.max(-1))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no key yet
    p = jnp.exp(s - safe[..., None])
    corr = jnp.exp(jnp.where(jnp.isfinite(m), m, safe) - safe)
    o = o * corr[..., None] + jnp.einsum("kgts,skd->kgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, m_new, l * corr + p.sum(-1)


def _block_backward(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, causal, scale):
    """Gradients of one block: (dq, dk, dv) from the saved log-sum-exp."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    s, mask = block_scores(q, k, qpos, kpos, qseg, kseg, causal, scale)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)  # (Hkv, G, Tq, Tk)
    dog = do.reshape(t, hkv, hq // hkv, d)
    dv = jnp.einsum("kgts,tkgd->skd", p, dog.astype(jnp.float32))
    dp = jnp.einsum("tkgd,skd->kgts", dog, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("kgts,skd->tkgd", ds, k.astype(jnp.float32)).reshape(t, hq, d)
    dk = jnp.einsum("kgts,tkgd->skd", ds, q.reshape(t, hkv, hq // hkv, d).astype(jnp.float32))
    return dq, dk, dv


# ----------------------------------------------------------------------------- on one context shard (inside shard_map)

BLOCK = 1024  # queries and keys per block: one block's scores are (heads, BLOCK, BLOCK) in float32


def _init(q, hkv):
    t, hq, d = q.shape
    g = hq // hkv
    return (jnp.zeros((hkv, g, t, d), jnp.float32), jnp.full((hkv, g, t), -jnp.inf, jnp.float32),
            jnp.zeros((hkv, g, t), jnp.float32))


def _finish(o, m, l, q):
    """(out (Tq, Hq, D) in q's dtype, log-sum-exp (Hkv, G, Tq))."""
    t, hq, d = q.shape
    l = jnp.where(l == 0, 1.0, l)  # a query that sees no key (cannot happen with its own segment) gives 0
    out = (o / l[..., None]).transpose(2, 0, 1, 3).reshape(t, hq, d)
    return out.astype(q.dtype), m + jnp.log(l)


def _delta(dout, out, hkv):
    """Row sums of dout * out, (Hkv, G, Tq): the softmax backward's correction."""
    t, hq, _ = out.shape
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
    return delta.reshape(t, hkv, hq // hkv).transpose(1, 2, 0)


def _next(x, n: int):
    """``x`` handed to the next context shard (shard i gets shard i - 1's)."""
    return jax.lax.ppermute(x, CONTEXT, [(i, (i + 1) % n) for i in range(n)])


def _blocks(x, n: int):
    """A (T, ...) array as (n, T / n, ...)."""
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])


def _n_blocks(t: int) -> int:
    """How many blocks of at most `BLOCK` (a divisor of ``t``) cut ``t``."""
    return next(t // b for b in range(min(t, BLOCK), 0, -1) if t % b == 0)


# -- queries over keys, block by block of keys (flash attention's loop)


def _over_keys(acc, q, k, v, qpos, kpos, qseg, kseg, causal, scale):
    """Running (out, max, sum) of queries ``q`` updated with keys ``k`` in blocks of `BLOCK`."""
    block = functools.partial(_block_forward, q=q, qpos=qpos, qseg=qseg, causal=causal, scale=scale)

    def step(carry, kv):
        return block(carry, k=kv[0], v=kv[1], kpos=kv[2], kseg=kv[3]), None

    nb = _n_blocks(k.shape[0])
    return jax.lax.scan(step, acc, tuple(_blocks(a, nb) for a in (k, v, kpos, kseg)))[0]


def _grads_over_keys(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, causal, scale):
    """(dq, dk, dv) in float32 of queries ``q`` over keys ``k``, in blocks of `BLOCK` keys."""
    grads = functools.partial(_block_backward, q=q, do=do, lse=lse, delta=delta, qpos=qpos, qseg=qseg,
                              causal=causal, scale=scale)

    def step(dq, kv):
        dqb, dkb, dvb = grads(k=kv[0], v=kv[1], kpos=kv[2], kseg=kv[3])
        return dq + dqb, (dkb, dvb)

    nb = _n_blocks(k.shape[0])
    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(q.shape, jnp.float32),
                                tuple(_blocks(a, nb) for a in (k, v, kpos, kseg)))
    return dq, dk.reshape(k.shape), dv.reshape(v.shape)


def _split_queries(a, n: int, axis: int):
    """(..., T, ...) -> (n, ..., T / n, ...): a per-query array cut into ``n`` blocks along ``axis``."""
    return jnp.moveaxis(a.reshape(*a.shape[:axis], n, -1, *a.shape[axis + 1:]), axis, 0)


def _queries_over_keys(acc, q, qpos, qseg, k, v, kpos, kseg, causal, scale):
    """`_over_keys` a block of `BLOCK` queries at a time (the ring's step)."""
    nq = _n_blocks(q.shape[0])
    if nq == 1:
        return _over_keys(acc, q, k, v, qpos, kpos, qseg, kseg, causal, scale)
    out = jax.lax.map(lambda x: _over_keys(x[0], x[1], k, v, x[2], kpos, x[3], kseg, causal, scale),
                      (tuple(_split_queries(a, nq, 2) for a in acc), _blocks(q, nq), _blocks(qpos, nq),
                       _blocks(qseg, nq)))
    return tuple(jnp.moveaxis(a, 0, 2).reshape(a.shape[1], a.shape[2], -1, *a.shape[4:]) for a in out)


def _query_grads(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, causal, scale):
    """`_grads_over_keys` a block of `BLOCK` queries at a time (the ring's step)."""
    nq = _n_blocks(q.shape[0])
    if nq == 1:
        return _grads_over_keys(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, causal, scale)

    def step(dkv, x):
        qb, dob, lb, db, pb, sb = x
        dq, dk, dv = _grads_over_keys(qb, k, v, dob, lb, db, pb, kpos, sb, kseg, causal, scale)
        return (dkv[0] + dk, dkv[1] + dv), dq

    zeros = jnp.zeros(k.shape, jnp.float32)
    xs = (_blocks(q, nq), _blocks(do, nq), _split_queries(lse, nq, 2), _split_queries(delta, nq, 2),
          _blocks(qpos, nq), _blocks(qseg, nq))
    (dk, dv), dq = jax.lax.scan(step, (zeros, zeros), xs)
    return dq.reshape(q.shape), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, qpos, kpos, qseg, kseg, causal, scale):
    return _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, causal, scale)[0]


def _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, causal, scale):
    out, lse = _finish(*_over_keys(_init(q, k.shape[1]), q, k, v, qpos, kpos, qseg, kseg, causal, scale), q)
    return out, (q, k, v, qpos, kpos, qseg, kseg, out, lse)


def _flash_bwd(causal, scale, res, dout):
    q, k, v, qpos, kpos, qseg, kseg, out, lse = res
    dq, dk, dv = _grads_over_keys(q, k, v, dout, lse, _delta(dout, out, k.shape[1]), qpos, kpos, qseg, kseg,
                                  causal, scale)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@jax.custom_vjp
def _gather(x):
    """``x`` all-gathered over ``context``: its gradient is reduce-scattered back."""
    return jax.lax.all_gather(x, CONTEXT, tiled=True)


def _scatter(_, g):
    # XLA:CPU fails to compile a bfloat16 reduce-scatter ("Invalid binary instruction opcode copy"):
    # there it reduces in float32; accelerators reduce in the gradient's own dtype
    wide = g.astype(jnp.float32) if traced_platform() == "cpu" and g.dtype == jnp.bfloat16 else g
    return (jax.lax.psum_scatter(wide, CONTEXT, scatter_dimension=0, tiled=True).astype(g.dtype),)


_gather.defvjp(lambda x: (_gather(x), None), _scatter)


def gather_attention(q, k, v, pos, seg, causal, scale, n):
    """This shard's queries, a block at a time, over every shard's keys
    gathered once (differentiating the all-gather reduce-scatters their
    gradients back)."""
    if n > 1:
        k, v = _gather(k), _gather(v)
        kpos, kseg = (jax.lax.all_gather(a, CONTEXT, tiled=True) for a in (pos, seg))
    else:
        kpos, kseg = pos, seg

    def one(qb, pb, sb):
        return _flash(qb, k, v, pb, kpos, sb, kseg, causal, scale)

    nq = _n_blocks(q.shape[0])
    if nq == 1:
        return one(q, pos, seg)
    return jax.lax.map(lambda a: one(*a), (_blocks(q, nq), _blocks(pos, nq), _blocks(seg, nq))).reshape(q.shape)


# -- the ring: each shard's keys in turn, passed on with ppermute


def _ring_forward(q, k, v, pos, seg, causal, scale, n):
    hop = functools.partial(_queries_over_keys, q=q, qpos=pos, qseg=seg, causal=causal, scale=scale)

    def step(carry, _):
        acc, kv = carry
        kv = jax.tree.map(lambda a: _next(a, n), kv)
        return (hop(acc, k=kv[0], v=kv[1], kpos=kv[2], kseg=kv[3]), kv), None

    first = hop(_init(q, k.shape[1]), k=k, v=v, kpos=pos, kseg=seg)  # this shard's own keys first
    ((o, m, l), _), _ = jax.lax.scan(step, (first, (k, v, pos, seg)), None, length=n - 1)
    return _finish(o, m, l, q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def ring_attention(q, k, v, pos, seg, causal, scale, n):
    return _ring_forward(q, k, v, pos, seg, causal, scale, n)[0]


def _ring_fwd(q, k, v, pos, seg, causal, scale, n):
    out, lse = _ring_forward(q, k, v, pos, seg, causal, scale, n)
    return out, (q, k, v, pos, seg, out, lse)


def _ring_bwd(causal, scale, n, res, dout):
    """K/V go round the ring again, their gradients with them: home after ``n`` hops."""
    q, k, v, pos, seg, out, lse = res
    grads = functools.partial(_query_grads, q=q, do=dout, lse=lse, delta=_delta(dout, out, k.shape[1]),
                              qpos=pos, qseg=seg, causal=causal, scale=scale)

    def step(carry, _):
        dq, kv, (dk, dv) = carry
        dqb, dkb, dvb = grads(k=kv[0], v=kv[1], kpos=kv[2], kseg=kv[3])
        return (dq + dqb, *jax.tree.map(lambda a: _next(a, n), (kv, (dk + dkb, dv + dvb)))), None

    zeros = jnp.zeros(k.shape, jnp.float32)
    (dq, _, (dk, dv)), _ = jax.lax.scan(step, (jnp.zeros(q.shape, jnp.float32), (k, v, pos, seg), (zeros, zeros)),
                                        None, length=n)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
