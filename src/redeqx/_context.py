"""Sequences split over the mesh's ``context`` axis: the token order that
balances causal work, the positions of the tokens a device holds, and exact
attention across the split (`attention`).

**The order.** With ``C`` context shards a sequence of ``T`` tokens is cut
into ``2C`` chunks, and context shard ``i`` holds chunks ``i`` and
``2C - 1 - i`` (the dual-chunk, or "zigzag", order): every shard then holds
as many early tokens (which see few keys under a causal mask) as late ones.
`redeqx.batches` puts the sequence keys it is told about in this order once,
on the host; every position-dependent step (RoPE, the causal mask) reads
`sequence_positions` instead of ``arange``; a per-token loss needs nothing,
and `restore_order` puts per-token outputs back.

**Attention.** Queries stay where they are; keys and values travel: all
gathered over ``context`` (``impl="gather"``), or passed around the ring
with ``ppermute`` (``impl="ring"``, one shard's K/V in flight at a time).
Either way each device computes its queries against a block of keys at a
time with an online softmax, so no ``(T, T)`` score matrix is formed, and
the backward pass (a custom VJP) recomputes the scores block by block from
the saved log-sum-exp, as flash attention does. Every block is computed
whole (the causal mask applied, its masked half not skipped), so the
dual-chunk order balances memory and work already and would halve the
work once fully masked blocks are skipped (not done yet).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from ._mesh import CONTEXT, DATA, traced_platform
from ._typing import typechecked

IMPLS = ("gather", "ring")


def context_shards() -> int:
    """The size of the ``context`` axis of the mesh in context (1 without one)."""
    return context_axis() or 1


def context_axis() -> int | None:
    """The size of the ``context`` axis of the mesh in context, None without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or CONTEXT not in mesh.axis_names:
        return None
    return int(dict(mesh.shape)[CONTEXT])


def _check_split(n_tokens: int, n_shards: int, what: str) -> None:
    if n_tokens % (2 * n_shards):
        raise ValueError(
            f"{what}: a sequence of {n_tokens} tokens cannot be split over {n_shards} context shards in the "
            f"dual-chunk order, which cuts it into 2 x {n_shards} = {2 * n_shards} equal chunks: pad the sequence "
            f"to a multiple of {2 * n_shards} tokens in collate_fn (and mark the padding in its mask)."
        )


def context_order(n_tokens: int, n_shards: int) -> np.ndarray:
    """``order[j]``: the original position of the token at place ``j`` of
    the split layout (the identity for one shard). Shard ``i`` holds chunks
    ``i`` and ``2 n_shards - 1 - i`` of the ``2 n_shards`` equal chunks."""
    if n_shards == 1:
        return np.arange(n_tokens)
    _check_split(n_tokens, n_shards, "context_order")
    chunks = np.arange(n_tokens).reshape(2 * n_shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n_shards - 1 - i]]) for i in range(n_shards)])


@typechecked
def sequence_positions(n_tokens: int) -> Int[Array, " seq"]:
    """The original positions of the ``n_tokens`` tokens of a sequence as
    the step holds them: ``arange(n_tokens)`` on a mesh without a
    ``context`` axis, the dual-chunk order (`context_order`) on one with.
    Use it wherever a model would write ``jnp.arange(seq_len)`` (RoPE,
    learned position tables, a causal mask).

    **Example:**

    ```python
    positions = redeqx.sequence_positions(input_ids.shape[0])   # inside loss_fn's model
    ```
    """
    return jnp.asarray(context_order(n_tokens, context_shards()), jnp.int32)


def restore_order(x, axis: int = 1):
    """Per-token outputs in the split layout (e.g. ``pred_fn``'s ``(batch,
    seq, ...)``) back in the original order (a NumPy or JAX array; nothing
    changes without a ``context`` axis or when ``x`` came from a step
    without one, so call it with the mesh the outputs came from in
    context: ``with jax.set_mesh(mesh): restore_order(preds)``)."""
    n = x.shape[axis]
    inverse = np.argsort(context_order(n, context_shards()))
    return x.take(inverse, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, inverse, axis=axis)


# ----------------------------------------------------------------------------- batches: the host-side reorder


def mesh_context(mesh) -> int:
    return int(dict(mesh.shape).get(CONTEXT, 1))


def batch_spec(ndim: int, mesh, seq: bool) -> P:
    """A batch array's spec: rows over ``data``, and for a sequence key
    (``seq``) its dim 1 over ``context`` when the mesh has that axis."""
    if seq and mesh_context(mesh) > 1:
        return P(DATA, CONTEXT, *([None] * (ndim - 2)))
    return P(DATA, *([None] * (ndim - 1)))


def check_seq_keys(seq_keys, mesh) -> tuple[str, ...]:
    """``seq_keys`` as a tuple; on a mesh with a ``context`` axis it must name the sequence keys."""
    if isinstance(seq_keys, str):
        seq_keys = (seq_keys,)
    seq_keys = tuple(seq_keys or ())
    if mesh_context(mesh) > 1 and not seq_keys:
        raise ValueError(
            f"the mesh splits sequences over {mesh_context(mesh)} context shards, so batches needs seq_keys=: the "
            "batch keys whose dim 1 is the sequence (e.g. seq_keys=('input_ids', 'labels', 'attention_mask')), "
            "which it puts in the split order. Labels must be aligned with input_ids already (shifted in "
            "collate_fn): a loss that shifts logits[:, :-1] against ids[:, 1:] would pair tokens of other places."
        )
    return seq_keys


def order_sequences(batch, seq_keys: tuple[str, ...], mesh):
    """``batch`` (a dict of NumPy arrays) with dim 1 of each of ``seq_keys``
    in the split order of ``mesh``'s context axis."""
    if not seq_keys:
        return batch
    if not isinstance(batch, dict):
        raise TypeError(f"seq_keys={seq_keys} names keys of a dict batch, but collate_fn returned a "
                        f"{type(batch).__name__}; return a dict of arrays.")
    n = mesh_context(mesh)
    out = dict(batch)
    for name in seq_keys:
        if name not in batch:
            raise KeyError(f"seq_keys names {name!r}, which collate_fn's batch lacks; its keys are {sorted(batch)}.")
        x = np.asarray(batch[name])
        if x.ndim < 2:
            raise ValueError(f"seq_keys names {name!r}, of shape {x.shape}: a sequence key needs dims (batch, seq, ...).")
        _check_split(x.shape[1], n, f"batch[{name!r}] (seq_keys)")
        out[name] = x[:, context_order(x.shape[1], n)]
    return out


# ----------------------------------------------------------------------------- one block: queries against one shard's keys


def _block_scores(q, k, qpos, kpos, qseg, kseg, causal: bool, scale: float):
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
    s, _ = _block_scores(q, k, qpos, kpos, qseg, kseg, causal, scale)
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
    s, mask = _block_scores(q, k, qpos, kpos, qseg, kseg, causal, scale)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)  # (Hkv, G, Tq, Tk)
    dog = do.reshape(t, hkv, hq // hkv, d)
    dv = jnp.einsum("kgts,tkgd->skd", p, dog.astype(jnp.float32))
    dp = jnp.einsum("tkgd,skd->kgts", dog, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("kgts,skd->tkgd", ds, k.astype(jnp.float32)).reshape(t, hq, d)
    dk = jnp.einsum("kgts,tkgd->skd", ds, q.reshape(t, hkv, hq // hkv, d).astype(jnp.float32))
    return dq, dk, dv


# ----------------------------------------------------------------------------- on one context shard (inside shard_map)

BLOCK = 1024  # queries and keys per block of the gathered path: one block's scores are (heads, BLOCK, BLOCK) f32


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


# -- queries over keys they hold whole: flash attention's loop, block by block of keys


def _flash_forward(q, k, v, qpos, kpos, qseg, kseg, causal, scale):
    block = functools.partial(_block_forward, q=q, qpos=qpos, qseg=qseg, causal=causal, scale=scale)

    def step(carry, kv):
        return block(carry, k=kv[0], v=kv[1], kpos=kv[2], kseg=kv[3]), None

    nb = _n_blocks(k.shape[0])
    (o, m, l), _ = jax.lax.scan(step, _init(q, k.shape[1]), tuple(_blocks(a, nb) for a in (k, v, kpos, kseg)))
    return _finish(o, m, l, q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, qpos, kpos, qseg, kseg, causal, scale):
    return _flash_forward(q, k, v, qpos, kpos, qseg, kseg, causal, scale)[0]


def _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, causal, scale):
    out, lse = _flash_forward(q, k, v, qpos, kpos, qseg, kseg, causal, scale)
    return out, (q, k, v, qpos, kpos, qseg, kseg, out, lse)


def _flash_bwd(causal, scale, res, dout):
    q, k, v, qpos, kpos, qseg, kseg, out, lse = res
    grads = functools.partial(_block_backward, q=q, do=dout, lse=lse, delta=_delta(dout, out, k.shape[1]),
                              qpos=qpos, qseg=qseg, causal=causal, scale=scale)

    def step(dq, kv):
        dqb, dkb, dvb = grads(k=kv[0], v=kv[1], kpos=kv[2], kseg=kv[3])
        return dq + dqb, (dkb, dvb)

    nb = _n_blocks(k.shape[0])
    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(q.shape, jnp.float32),
                                tuple(_blocks(a, nb) for a in (k, v, kpos, kseg)))
    return (dq.astype(q.dtype), dk.reshape(k.shape).astype(k.dtype), dv.reshape(v.shape).astype(v.dtype),
            None, None, None, None)


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


def _gather_attention(q, k, v, pos, seg, causal, scale, n):
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
    block = functools.partial(_block_forward, q=q, qpos=pos, qseg=seg, causal=causal, scale=scale)

    def step(carry, _):
        acc, kv = carry
        kv = jax.tree.map(lambda a: _next(a, n), kv)
        return (block(acc, k=kv[0], v=kv[1], kpos=kv[2], kseg=kv[3]), kv), None

    first = block(_init(q, k.shape[1]), k=k, v=v, kpos=pos, kseg=seg)  # this shard's own keys first
    ((o, m, l), _), _ = jax.lax.scan(step, (first, (k, v, pos, seg)), None, length=n - 1)
    return _finish(o, m, l, q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q, k, v, pos, seg, causal, scale, n):
    return _ring_forward(q, k, v, pos, seg, causal, scale, n)[0]


def _ring_fwd(q, k, v, pos, seg, causal, scale, n):
    out, lse = _ring_forward(q, k, v, pos, seg, causal, scale, n)
    return out, (q, k, v, pos, seg, out, lse)


def _ring_bwd(causal, scale, n, res, dout):
    """K/V go round the ring again, their gradients with them: home after ``n`` hops."""
    q, k, v, pos, seg, out, lse = res
    grads = functools.partial(_block_backward, q=q, do=dout, lse=lse, delta=_delta(dout, out, k.shape[1]),
                              qpos=pos, qseg=seg, causal=causal, scale=scale)

    def step(carry, _):
        dq, kv, (dk, dv) = carry
        dqb, dkb, dvb = grads(k=kv[0], v=kv[1], kpos=kv[2], kseg=kv[3])
        return (dq + dqb, *jax.tree.map(lambda a: _next(a, n), (kv, (dk + dkb, dv + dvb)))), None

    zeros = jnp.zeros(k.shape, jnp.float32)
    (dq, _, (dk, dv)), _ = jax.lax.scan(step, (jnp.zeros(q.shape, jnp.float32), (k, v, pos, seg), (zeros, zeros)),
                                        None, length=n)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------- the public function


def _plain(q, k, v, pos, seg, causal: bool, scale: float):
    """Exact attention on one device: cuDNN's flash attention on a GPU in half
    precision for a plain causal or full mask, the scores in float32 otherwise."""
    if (seg is None and traced_platform() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128):
        return jax.nn.dot_product_attention(q[None], k[None], v[None], scale=scale, is_causal=causal)[0]
    seg = jnp.zeros(pos.shape, jnp.int32) if seg is None else seg
    s, _ = _block_scores(q, k, pos, pos, seg, seg, causal, scale)
    p = jax.nn.softmax(s, axis=-1)
    t, hq, d = q.shape
    return jnp.einsum("kgts,skd->tkgd", p.astype(v.dtype), v).reshape(t, hq, d)


def _split(q, k, v, pos, seg, causal: bool, scale: float, impl: str, n: int):
    """Attention with the sequence split over ``context`` (``n`` shards)."""
    seg = jnp.zeros(pos.shape, jnp.int32) if seg is None else seg
    if impl == "ring" and n > 1:
        body = functools.partial(_ring, causal=causal, scale=scale, n=n)
    else:
        body = functools.partial(_gather_attention, causal=causal, scale=scale, n=n)
    seq, tok = P(CONTEXT, None, None), P(CONTEXT)
    return jax.shard_map(lambda *a: body(*a), in_specs=(seq, seq, seq, tok, tok), out_specs=seq,
                         axis_names=frozenset({CONTEXT}), check_vma=False)(q, k, v, pos, seg)


@typechecked
def attention(
    q: Float[Array, "*batch seq q_heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    *,
    causal: bool = True,
    segment_ids: Int[Array, "*batch seq"] | None = None,
    scale: float | None = None,
    impl: str = "gather",
) -> Float[Array, "*batch seq q_heads head_dim"]:
    """Exact softmax attention of a sequence over itself, split over the
    mesh's ``context`` axis when it has one.

    ``q_heads`` is a multiple of ``kv_heads`` (grouped-query attention:
    query head ``h`` reads KV head ``h // (q_heads / kv_heads)``). A query
    sees the keys of its own segment (``segment_ids``: packed documents, or
    ``attention_mask.astype(int)`` for padding, whose tokens then only see
    each other), and with ``causal=True`` only those at or before its own
    position (`sequence_positions`: the original order, whatever the
    layout). ``scale`` defaults to ``1 / sqrt(head_dim)``.

    On a mesh without a ``context`` axis this is plain attention (cuDNN's
    flash attention on a GPU in half precision where no segments are given;
    the ``(T, T)`` scores otherwise). On one with ``C`` context shards
    (``C = 1`` included: a hand-built ``("data", "context", "model")`` mesh),
    the sequence
    arrives split in the dual-chunk order (what `redeqx.batches` does with
    ``seq_keys``), each device keeps its queries, and the keys and values
    come to it: all gathered over ``context`` (``impl="gather"``: ``C``
    times one shard's K/V in memory) or passed around a ring with
    ``ppermute`` (``impl="ring"``: two shards' K/V in memory, the transfers
    beside the compute). The gather computes blocks of `BLOCK` queries by
    `BLOCK` keys, the ring blocks of ``T / C`` by ``T / C``, with an online
    softmax, and both differentiate by recomputing the scores (custom
    VJPs), never forming the ``(T, T)`` scores.

    **Example** (inside a model, one sequence; ``jax.vmap`` batches it):

    ```python
    q = apply_rope(q, redeqx.sequence_positions(q.shape[0]))
    out = redeqx.attention(q, k, v, causal=True)          # (seq, heads, head_dim)
    ```
    """
    if impl not in IMPLS:
        raise ValueError(f"attention: impl={impl!r}; choose one of {IMPLS} ('ring' when gathered K/V do not fit).")
    if q.shape[-3] != k.shape[-3] or k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[-2] % k.shape[-2]:
        raise ValueError(
            f"attention: q {q.shape}, k {k.shape}, v {v.shape}: k and v need the same shape, the same sequence "
            "length and head size as q, and a number of heads that divides q's (grouped-query attention)."
        )
    if q.ndim > 3:  # a batch: each sequence on its own
        fn = functools.partial(attention, causal=causal, scale=scale, impl=impl)
        if segment_ids is None:
            return jax.vmap(lambda a, b, c: fn(a, b, c))(q, k, v)
        return jax.vmap(lambda a, b, c, s: fn(a, b, c, segment_ids=s))(q, k, v, segment_ids)
    scale = float(q.shape[-1]) ** -0.5 if scale is None else float(scale)
    n = context_axis()
    pos = sequence_positions(q.shape[0])
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    if n is None:
        return _plain(q, k, v, pos, seg, causal, scale)
    if n > 1:
        _check_split(q.shape[0], n, "redeqx.attention")
    return _split(q, k, v, pos, seg, causal, scale, impl, n)
