"""Exact attention a block at a time (an online softmax, and custom VJPs
that recompute the scores from the saved log-sum-exp, as flash attention
does): `gather_attention` over keys gathered over ``context``,
`ring_attention` over keys passed around it. Both run on one context shard,
inside `redeqx.attention`'s ``shard_map``; masks come from positions and
segment ids, never as a ``(T, T)`` array.

Both walk a table of (query block, key block) pairs, built on the host from
the blocks' places in the original order: under a causal mask a key block
that lies wholly after its query block is not in the table, so it is never
computed (about half the pairs of a long sequence), nor is one a sliding
window leaves wholly behind. The dual-chunk order gives every context shard
a causal table of the same length, so the tables stack into one array
indexed by ``axis_index("context")``; a window's tables differ, and the
shorter ones are padded with entries the loops skip."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..mesh import CONTEXT, traced_platform


# ----------------------------------------------------------------------------- one block: queries against one shard's keys


@dataclasses.dataclass(frozen=True)
class Span:
    """Which keys a query sees, by place in the original order: all
    (``causal=False``), those at or before its own (``causal=True``), and of
    those, with a ``window``, only the last ``window`` of its own segment
    (itself included: a sliding window, as Mistral's, that counts the keys a
    query sees, so padding inside a sequence takes no place in it).

    ``by_segment``: positions are ``(T, 2)``, each token's place and its
    `segment_ranks` (where segments are given with a window); otherwise
    ``(T,)`` places, which then count the window too (one segment, or
    none)."""

    causal: bool
    window: int | None = None
    by_segment: bool = False

    def mask(self, qpos, kpos):
        """(Tq, Tk): whether query ``qpos[t]`` sees key ``kpos[s]`` (segments aside)."""
        (qp, qr), (kp, kr) = (_place_and_rank(x, self.by_segment) for x in (qpos, kpos))
        seen = jnp.ones((qp.shape[0], kp.shape[0]), bool)
        if self.causal:
            seen = kp[None, :] <= qp[:, None]
        if self.window is not None:
            seen = seen & (qr[:, None] - kr[None, :] < self.window)
        return seen

    def sees_block(self, qi: int, kj: int, b: int) -> bool:
        """Whether some query of block ``qi`` may see some key of block ``kj``
        (blocks of ``b`` consecutive places). A window counted by segment
        skips no block here: its pairs are skipped as the loop meets them
        (`_skipped`), since padding inside a segment's run stretches it."""
        if self.causal and kj > qi:
            return False
        if self.window is None or self.by_segment:
            return True
        return (qi - kj - 1) * b + 1 < self.window  # nearest pair: first query, last key


def _place_and_rank(pos, by_segment: bool):
    return (pos[:, 0], pos[:, 1]) if by_segment else (pos, pos)


def segment_ranks(pos, seg):
    """(T,) int32: how many tokens of each token's segment lie at earlier
    places (``pos``, the original places, in any order), what a sliding window
    counts: a real token's count of real tokens before it, where padding is a
    segment of its own (the zoo's ``attention_mask``)."""
    t = pos.shape[0]
    order = jnp.lexsort((pos, seg))  # by segment, then by place
    s = seg[order]
    i = jnp.arange(t, dtype=jnp.int32)
    starts = jax.lax.cummax(jnp.where(jnp.concatenate([jnp.ones((1,), bool), s[1:] != s[:-1]]), i, 0))
    return jnp.zeros((t,), jnp.int32).at[order].set(i - starts)


def with_ranks(pos, seg, span: Span, n: int = 1):
    """``pos`` as `Span.mask` reads it: with each token's `segment_ranks` beside its place where the
    window counts by segment. Inside ``shard_map`` over ``n > 1`` context shards, ``pos`` and
    ``seg`` are this shard's, and the ranks are counted over the whole sequence (its places and
    segments gathered: ``T`` ints each)."""
    if not span.by_segment:
        return pos
    if n == 1:
        return jnp.stack([pos, segment_ranks(pos, seg)], axis=1)
    every = with_ranks(*(jax.lax.all_gather(a, CONTEXT, tiled=True) for a in (pos, seg)), span)
    return jax.lax.dynamic_slice_in_dim(every, jax.lax.axis_index(CONTEXT) * pos.shape[0], pos.shape[0])


def grouped_scores(q, k, scale: float):
    """``q`` (Tq, Hq, D) times ``k`` (Tk, Hkv, D), scaled: scores (Hkv, Tq, G, Tk) in float32, query
    head ``h`` of KV head ``h // G``. Written as `jax.lax.dot_general` with the queries first, the
    product's own output, kept as it is, ends with the keys: XLA:GPU keeps them minor and runs a
    softmax over them as one kernel. ``jnp.einsum("tkgd,skd->kgts")`` emitted the keys first: the
    softmax ran as four kernels over the whole scores, and a decoding token of the 1B over 8
    sequences of 4,096 slots moved 3,412 MiB against 3,059 (`benchmarks.gpu_compile`, RESULTS.md).
    Swapping the queries and their heads afterwards costs the backward pass a transpose of the
    scores' gradient (a quarter more bytes for a 1,024-token batch, RESULTS.md): use this layout."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(t, hkv, hq // hkv, d)
    return jax.lax.dot_general(qg, k, (((3,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32) * scale


def masked_attention(q, k, v, mask, scale: float, bias=None):
    """Exact attention of one sequence, the scores in float32 and kept in `grouped_scores`' layout
    (for the backward pass too): ``q`` (Tq, Hq, D), ``k``/``v`` (Tk, Hkv, D), ``mask`` (Tq, Tk),
    ``bias`` (Hq, Tq, Tk) or None. The zoo's attention and `redeqx.attention` on one device, where
    no fused kernel serves."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    s = grouped_scores(q, k, scale)  # (Hkv, Tq, G, Tk)
    if bias is not None:
        s = s + jnp.swapaxes(bias.reshape(hkv, hq // hkv, *bias.shape[1:]), 1, 2).astype(jnp.float32)
    p = jax.nn.softmax(jnp.where(mask[None, :, None], s, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.einsum("ktgs,skd->tkgd", p.astype(v.dtype), v).reshape(t, hq, d)


def block_mask(qpos, kpos, qseg, kseg, span: Span):
    """Which keys each query sees: (Tq, Tk), by segment and `Span`."""
    return (qseg[:, None] == kseg[None, :]) & span.mask(qpos, kpos)


def block_scores(q, k, qpos, kpos, qseg, kseg, span: Span, scale: float):
    """Masked scores (Hkv, G, Tq, Tk) in float32 and the mask (1, 1, Tq, Tk)."""
    s = jnp.swapaxes(grouped_scores(q, k, scale), 1, 2)
    mask = block_mask(qpos, kpos, qseg, kseg, span)[None, None]  # (1, 1, Tq, Tk)
    return jnp.where(mask, s, -jnp.inf), mask


def _block_forward(carry, q, k, v, qpos, kpos, qseg, kseg, span, scale):
    """One online-softmax step: running (out, max, sum) updated with one block of keys."""
    o, m, l = carry  # (Hkv, G, Tq, D) f32, (Hkv, G, Tq) f32 x2
    s, _ = block_scores(q, k, qpos, kpos, qseg, kseg, span, scale)
    m_new = jnp.maximum(m, s.max(-1))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no key yet
    p = jnp.exp(s - safe[..., None])
    corr = jnp.exp(jnp.where(jnp.isfinite(m), m, safe) - safe)
    o = o * corr[..., None] + jnp.einsum("kgts,skd->kgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, m_new, l * corr + p.sum(-1)


def _block_backward(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, span, scale):
    """Gradients of one block: (dq, dk, dv) from the saved log-sum-exp."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    s, mask = block_scores(q, k, qpos, kpos, qseg, kseg, span, scale)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)  # (Hkv, G, Tq, Tk)
    dog = do.reshape(t, hkv, hq // hkv, d)
    dv = jnp.einsum("kgts,tkgd->skd", p, dog.astype(jnp.float32))
    dp = jnp.einsum("tkgd,skd->kgts", dog, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("kgts,skd->tkgd", ds, k.astype(jnp.float32)).reshape(t, hq, d)
    dk = jnp.einsum("kgts,tkgd->skd", ds, q.reshape(t, hkv, hq // hkv, d).astype(jnp.float32))
    return dq, dk, dv


# ----------------------------------------------------------------------------- on one context shard (inside shard_map)

BLOCK = 1024  # queries and keys per block at most: one block's scores are (heads, BLOCK, BLOCK) in float32


def block_size(chunk: int) -> int:
    """Tokens per block: the largest divisor of ``chunk`` (the tokens of one
    of the ``2C`` chunks of the dual-chunk order) not above `BLOCK`, so that
    a block never straddles two chunks."""
    return next(b for b in range(min(chunk, BLOCK), 0, -1) if chunk % b == 0)


def _pairs(q_ids, k_ids, span: Span, b: int) -> np.ndarray:
    """(P, 2): every (query block, key block) whose scores are not all
    masked, by the blocks' places in the original order (``*_ids``): under a
    causal mask a key block after the query block is skipped, under a
    sliding window one wholly before it too."""
    pairs = [(i, j) for i, qi in enumerate(q_ids) for j, kj in enumerate(k_ids) if span.sees_block(qi, kj, b)]
    return np.asarray(pairs, np.int32).reshape(-1, 2)


PAD = -1  # a table entry that stands for no pair: skipped (`_skipped`)


def _mine(tables: list[np.ndarray], span: Span, n: int | None = None):
    """This context shard's row of per-shard pair tables, each padded to
    ``n`` pairs (default: the longest) with ``(PAD, PAD)``. The dual-chunk
    order gives every shard the same number of pairs under a plain causal
    mask (no padding); a sliding window does not, and its loops skip the
    padding (`_skipped`)."""
    n = max(map(len, tables)) if n is None else n
    assert span.window is not None or all(len(t) == n for t in tables), [len(t) for t in tables]
    padded = [np.concatenate([t, np.full((n - len(t), 2), PAD, np.int32)]) for t in tables]
    return jnp.asarray(np.stack(padded))[jax.lax.axis_index(CONTEXT)]


def _skipped(step, span: Span, sees=None):
    """A loop step over (query block, key block) pairs that leaves the carry
    as it is for a `PAD` pair and, for a window counted by segment, for a
    pair whose queries see none of its keys (``sees(pair)``): a conditional,
    only where tables can hold such pairs (a sliding window), so the causal
    loop stays branch-free."""
    if span.window is None:
        return step

    def skipping(carry, pair):
        run = pair[0] != PAD
        if span.by_segment:
            run = run & sees(jnp.maximum(pair, 0))
        return jax.lax.cond(run, step, lambda c, _: (c, None), carry, pair)

    return skipping

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


def _rows(a, start, size: int, axis: int = 0):
    return jax.lax.dynamic_slice_in_dim(a, start, size, axis)


def _add_rows(a, x, start):
    return jax.lax.dynamic_update_slice_in_dim(a, _rows(a, start, x.shape[0]) + x, start, 0)


def _sees(qpos, kpos, qseg, kseg, b: int, span: Span):
    """Whether some query of a (query block, key block) pair sees some key of it."""

    def sees(pair):
        i, j = pair[0] * b, pair[1] * b
        same = _rows(qseg, i, b)[:, None] == _rows(kseg, j, b)[None, :]
        return jnp.any(same & span.mask(_rows(qpos, i, b), _rows(kpos, j, b)))

    return sees


# -- the two loops over (query block, key block) pairs: flash attention's, with the masked pairs left out


def _forward(acc, q, k, v, qpos, kpos, qseg, kseg, pairs, b: int, span: Span, scale: float):
    """Running (out, max, sum) of queries ``q`` updated with keys ``k``, one
    (query block, key block) of ``pairs`` (blocks of ``b`` tokens) at a time."""

    def step(carry, pair):
        i, j = pair[0] * b, pair[1] * b
        new = _block_forward(tuple(_rows(a, i, b, 2) for a in carry), _rows(q, i, b), _rows(k, j, b), _rows(v, j, b),
                             _rows(qpos, i, b), _rows(kpos, j, b), _rows(qseg, i, b), _rows(kseg, j, b), span, scale)
        return tuple(jax.lax.dynamic_update_slice_in_dim(a, x, i, 2) for a, x in zip(carry, new)), None

    return jax.lax.scan(_skipped(step, span, _sees(qpos, kpos, qseg, kseg, b, span)), acc, pairs)[0]


def _grads(init, q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, pairs, b: int, span: Span, scale: float):
    """(dq, dk, dv) in float32, ``init`` plus the gradients over ``pairs``."""

    def step(carry, pair):
        i, j = pair[0] * b, pair[1] * b
        dq, dk, dv = _block_backward(_rows(q, i, b), _rows(k, j, b), _rows(v, j, b), _rows(do, i, b),
                                     _rows(lse, i, b, 2), _rows(delta, i, b, 2), _rows(qpos, i, b), _rows(kpos, j, b),
                                     _rows(qseg, i, b), _rows(kseg, j, b), span, scale)
        return (_add_rows(carry[0], dq, i), _add_rows(carry[1], dk, j), _add_rows(carry[2], dv, j)), None

    return jax.lax.scan(_skipped(step, span, _sees(qpos, kpos, qseg, kseg, b, span)), init, pairs)[0]


def _zeros(*xs):
    return tuple(jnp.zeros(x.shape, jnp.float32) for x in xs)


# -- all gathered: this shard's queries over every shard's keys


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _flash(q, k, v, qpos, kpos, qseg, kseg, pairs, b, span, scale):
    return _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, pairs, b, span, scale)[0]


def _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, pairs, b, span, scale):
    acc = _forward(_init(q, k.shape[1]), q, k, v, qpos, kpos, qseg, kseg, pairs, b, span, scale)
    out, lse = _finish(*acc, q)
    return out, (q, k, v, qpos, kpos, qseg, kseg, pairs, out, lse)


def _flash_bwd(b, span, scale, res, dout):
    q, k, v, qpos, kpos, qseg, kseg, pairs, out, lse = res
    dq, dk, dv = _grads(_zeros(q, k, v), q, k, v, dout, lse, _delta(dout, out, k.shape[1]), qpos, kpos, qseg, kseg,
                        pairs, b, span, scale)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None, None


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


def gather_attention(q, k, v, pos, seg, span, scale, n, layout, b):
    """This shard's queries over every shard's keys gathered once
    (differentiating the all-gather reduce-scatters their gradients back).
    ``layout[i]``: the original place, in blocks of ``b`` tokens, of each
    block shard ``i`` holds."""
    if n > 1:
        k, v = _gather(k), _gather(v)
        kpos, kseg = (jax.lax.all_gather(a, CONTEXT, tiled=True) for a in (pos, seg))
    else:
        kpos, kseg = pos, seg
    everyone = np.asarray(layout).reshape(-1)  # the gathered keys' blocks: every shard's, in shard order
    tables = [_pairs(mine, everyone, span, b) for mine in layout]
    pairs = _mine(tables, span)
    return _flash(q, k, v, pos, kpos, seg, kseg, pairs, b, span, scale)


def whole_attention(q, k, v, pos, seg, span, scale):
    """A whole sequence's attention on one device, in its own order, a block at a time: `_flash`'s
    loop over one table of pairs, never the ``(T, T)`` scores (the heads split's attention where
    cuDNN's kernel does not run)."""
    b = block_size(q.shape[0])
    ids = np.arange(q.shape[0] // b)
    pos = with_ranks(pos, seg, span)
    return _flash(q, k, v, pos, pos, seg, seg, jnp.asarray(_pairs(ids, ids, span, b)), b, span, scale)


# -- the ring: each shard's keys in turn, passed on with ppermute


def _ring_pairs(layout, span: Span, b: int):
    """This shard's pairs against its own keys, and against the keys of
    each later hop, (n - 1, P, 2): after ``h`` hops shard ``i`` holds shard
    ``i - h``'s keys. Under a causal mask each hop's keys are half seen."""
    n = len(layout)
    keys = [[layout[(i - h) % n] for i in range(n)] for h in range(n)]
    tables = [[_pairs(layout[i], keys[h][i], span, b) for i in range(n)] for h in range(n)]
    most = max(len(t) for hop in tables[1:] for t in hop)  # the later hops run in one scan: one length
    return _mine(tables[0], span), jnp.stack([_mine(tables[h], span, most) for h in range(1, n)])


def _ring_forward(q, k, v, pos, seg, span, scale, n, layout, b):
    first, later = _ring_pairs(layout, span, b)
    hop = functools.partial(_forward, q=q, qpos=pos, qseg=seg, b=b, span=span, scale=scale)

    def step(carry, pairs):
        acc, kv = carry
        kv = jax.tree.map(lambda a: _next(a, n), kv)
        return (hop(acc, k=kv[0], v=kv[1], kpos=kv[2], kseg=kv[3], pairs=pairs), kv), None

    acc = hop(_init(q, k.shape[1]), k=k, v=v, kpos=pos, kseg=seg, pairs=first)  # this shard's own keys first
    ((o, m, l), _), _ = jax.lax.scan(step, (acc, (k, v, pos, seg)), later)
    return _finish(o, m, l, q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def ring_attention(q, k, v, pos, seg, span, scale, n, layout, b):
    return _ring_forward(q, k, v, pos, seg, span, scale, n, layout, b)[0]


def _ring_fwd(q, k, v, pos, seg, span, scale, n, layout, b):
    out, lse = _ring_forward(q, k, v, pos, seg, span, scale, n, layout, b)
    return out, (q, k, v, pos, seg, out, lse)


def _ring_bwd(span, scale, n, layout, b, res, dout):
    """K/V go round the ring again, their gradients with them: home after ``n`` hops."""
    q, k, v, pos, seg, out, lse = res
    first, later = _ring_pairs(layout, span, b)
    grads = functools.partial(_grads, q=q, do=dout, lse=lse, delta=_delta(dout, out, k.shape[1]), qpos=pos, qseg=seg,
                              b=b, span=span, scale=scale)

    def hop(carry, pairs):
        dq, kv, dkv = carry
        dq, dk, dv = grads((dq, *dkv), k=kv[0], v=kv[1], kpos=kv[2], kseg=kv[3], pairs=pairs)
        return (dq, *jax.tree.map(lambda a: _next(a, n), (kv, (dk, dv)))), None

    carry = hop((_zeros(q)[0], (k, v, pos, seg), _zeros(k, v)), first)[0]
    (dq, _, (dk, dv)), _ = jax.lax.scan(hop, carry, later)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
