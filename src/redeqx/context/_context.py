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
and `restore_order` puts per-token outputs back. A per-token key left out of
``seq_keys`` is an error (`check_per_token_keys`); a step that reads places
as positions is warned about when first traced (``_context_checks.py``).

**Attention.** Queries stay where they are; keys and values travel: all
gathered over ``context`` (``impl="gather"``), or passed around the ring
with ``ppermute`` (``impl="ring"``, one shard's K/V in flight at a time).
Either way each device computes its queries against a block of keys at a
time with an online softmax, so no ``(T, T)`` score matrix is formed, and
the backward pass (a custom VJP) recomputes the scores block by block from
the saved log-sum-exp, as flash attention does. Blocks never straddle two
chunks, so under a causal mask a key block is either wholly hidden from a
query block (and skipped: about half the blocks of a long sequence) or
computed with the mask; the dual-chunk order gives every shard as many
blocks to compute (`block_layout`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, Integer

from . import _tpu
from ._blockwise import (Span, block_mask, block_size, gather_attention, masked_attention, ring_attention,
                         whole_attention, with_ranks)
from ..mesh import CONTEXT, DATA, traced_platform
from .._typing import typechecked

IMPLS = ("gather", "ring", "heads", "auto")


def context_shards() -> int:
    """The size of the ``context`` axis of the mesh in context (1 without one)."""
    return context_axis() or 1


def context_axis() -> int | None:
    """The size of the ``context`` axis of the mesh in context, None without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or CONTEXT not in mesh.axis_names:
        return None
    return int(dict(mesh.shape)[CONTEXT])


# the lengths of the batch's sequences split over ``context`` while a step on them is traced (`splitting`)
_SPLIT_LENGTHS: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar("redeqx_split_lengths", default=())


@contextlib.contextmanager
def splitting(lengths: tuple[int, ...]):
    """Within: a step whose batch holds sequences of ``lengths`` tokens split over ``context`` is traced."""
    token = _SPLIT_LENGTHS.set(lengths)
    try:
        yield
    finally:
        _SPLIT_LENGTHS.reset(token)


def split_lengths(batch) -> tuple[int, ...]:
    """The lengths (dim 1) of the arrays of ``batch`` (arrays or shapes with shardings) split over a
    ``context`` axis of more than one shard: the sequences `redeqx.batches` put in the dual-chunk order."""
    found = set()
    for x in jax.tree.leaves(batch):
        sh = getattr(x, "sharding", None)
        if not isinstance(sh, NamedSharding) or len(x.shape) < 2 or len(sh.spec) < 2 or mesh_context(sh.mesh) == 1:
            continue
        dim1 = sh.spec[1] if isinstance(sh.spec[1], tuple) else (sh.spec[1],)
        if CONTEXT in dim1:
            found.add(int(x.shape[1]))
    return tuple(sorted(found))


def _check_split(n_tokens: int, n_shards: int, what: str) -> None:
    lengths = _SPLIT_LENGTHS.get()
    if n_tokens % (2 * n_shards) and lengths and n_tokens not in lengths:
        raise ValueError(
            f"{what}: a sequence of {n_tokens} tokens inside the step, but the batch's sequences (seq_keys) are "
            f"{' or '.join(map(str, lengths))} tokens long, split over {n_shards} context shards in the dual-chunk "
            "order. So the sequence was cut inside loss_fn or the model, most likely to shift labels "
            "(input_ids[:, :-1] against input_ids[:, 1:]). A split sequence cannot be cut or shifted there: its "
            "tokens are held in the split order (redeqx.context_order), not one after another. Shift in collate_fn "
            "instead (input_ids = ids[:, :-1], labels = ids[:, 1:], both in seq_keys) and give the model the whole "
            "sequence."
        )
    if n_tokens % (2 * n_shards):
        raise ValueError(
            f"{what}: a sequence of {n_tokens} tokens cannot be split over {n_shards} context shards in the "
            f"dual-chunk order, which cuts it into 2 x {n_shards} = {2 * n_shards} equal chunks: pad the sequence "
            f"to a multiple of {2 * n_shards} tokens in collate_fn (and mark the padding in its mask)."
        )


@typechecked
def context_order(n_tokens: int, n_shards: int) -> np.ndarray:
    """``order[j]``: the original position of the token at place ``j`` of
    the split layout (the identity for one shard). Shard ``i`` holds chunks
    ``i`` and ``2 n_shards - 1 - i`` of the ``2 n_shards`` equal chunks.

    **Example:**

    ```python
    redeqx.context_order(8, 2)   # array([0, 1, 6, 7, 2, 3, 4, 5]): shard 0 holds 0, 1, 6, 7
    ```
    """
    if n_shards == 1:
        return np.arange(n_tokens)
    _check_split(n_tokens, n_shards, "context_order")
    return in_layout_order(np.arange(n_tokens), n_shards)


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
    n = context_shards()
    if n > 1:
        _check_split(n_tokens, n, "redeqx.sequence_positions")
    return jnp.asarray(context_order(n_tokens, n), jnp.int32)


@typechecked
def restore_order(x: np.ndarray | Array, mesh: Mesh, *, axis: int = 1) -> np.ndarray | Array:
    """Per-token outputs of a step on ``mesh`` (e.g. a predict step's
    ``(batch, seq, ...)``), which come in the split layout, back in the
    original order along ``axis``; unchanged for a mesh without a
    ``context`` axis. `predict` does this for the outputs its
    ``seq_outputs`` names.

    **Example:**

    ```python
    logits = redeqx.restore_order(predict_step(model, batch, key), mesh)
    ```
    """
    n = x.shape[axis]
    inverse = np.argsort(context_order(n, mesh_context(mesh)))
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


def _key_tuple(keys) -> tuple[str, ...]:
    return (keys,) if isinstance(keys, str) else tuple(keys or ())


def check_seq_keys(seq_keys, mesh, what: str = "redeqx.batches") -> tuple[str, ...]:
    """``seq_keys`` as a tuple; on a mesh with a ``context`` axis it must name the sequence keys
    (``what``: the function that was called, for the error)."""
    seq_keys = _key_tuple(seq_keys)
    if mesh_context(mesh) > 1 and not seq_keys:
        raise ValueError(
            f"the mesh splits sequences over {mesh_context(mesh)} context shards, so {what} needs seq_keys=: the "
            "batch keys whose dim 1 is the sequence (e.g. seq_keys=('input_ids', 'labels', 'attention_mask')), "
            "which it puts in the split order. Labels must be aligned with input_ids already (shifted in "
            "collate_fn): a loss that shifts logits[:, :-1] against ids[:, 1:] would pair tokens of other places."
        )
    return seq_keys


def check_whole_keys(whole_keys, seq_keys: tuple[str, ...]) -> tuple[str, ...]:
    """``whole_keys`` (the keys whose dim 1 is not per-token, kept whole) as a tuple, none of them in ``seq_keys``."""
    whole_keys = _key_tuple(whole_keys)
    both = sorted(set(whole_keys) & set(seq_keys))
    if both:
        raise ValueError(f"{both} are in both seq_keys and whole_keys: a key is either per-token (seq_keys: put in "
                         "the split order) or not (whole_keys: kept whole); name it in one of them.")
    return whole_keys


def check_per_token_keys(batch, seq_keys: tuple[str, ...], whole_keys: tuple[str, ...], mesh) -> None:
    """On a mesh that reorders sequences, every key of ``batch`` (a dict; arrays or shapes) whose dim 1 is
    as long as a sequence of ``seq_keys`` is named in ``seq_keys`` (reordered with it) or ``whole_keys``
    (not per-token). A per-token key left out (``labels``) would stay in its order while ``input_ids``
    are reordered, and train on misaligned pairs without a word."""
    if mesh_context(mesh) == 1 or not isinstance(batch, dict):
        return
    lengths = {np.shape(batch[k])[1] for k in seq_keys if k in batch and np.ndim(batch[k]) >= 2}
    named = set(seq_keys) | set(whole_keys)
    for name in whole_keys:
        if name not in batch:
            raise KeyError(f"whole_keys names {name!r}, which the batch lacks; its keys are {sorted(batch)}.")
    for name, value in batch.items():
        if name in named:
            continue
        for x in jax.tree.leaves(value):
            shape = tuple(np.shape(x))
            if len(shape) >= 2 and shape[1] in lengths:
                raise ValueError(
                    f"batch[{name!r}] has shape {shape}: its dim 1 is {shape[1]}, the length of the sequences of "
                    f"seq_keys={seq_keys}, but seq_keys leaves it out. The mesh splits sequences over "
                    f"{mesh_context(mesh)} context shards, putting the tokens of seq_keys in the dual-chunk order "
                    f"(redeqx.context_order), so a per-token key left in its own order (labels, a loss mask, "
                    f"position ids) would no longer line up with input_ids. If it is per-token, add {name!r} to "
                    f"seq_keys; if its dim 1 only happens to be {shape[1]} long, say so with "
                    f"whole_keys=({name!r},)."
                )


def order_sequences(batch, seq_keys: tuple[str, ...], mesh, whole_keys: tuple[str, ...] = ()):
    """``batch`` (a dict of NumPy arrays) with dim 1 of each of ``seq_keys``
    in the split order of ``mesh``'s context axis (every other key whose
    dim 1 is as long named in ``whole_keys``: `check_per_token_keys`)."""
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
    check_per_token_keys(batch, seq_keys, whole_keys, mesh)
    return out


# ----------------------------------------------------------------------------- the public function


def _cudnn_runs(q, seg, span: Span) -> bool:
    """Whether `_plain` runs cuDNN's flash attention: on a GPU, half precision, heads of at most 128
    features in multiples of 8, a plain causal or full mask (no segments, no window)."""
    return (seg is None and span.window is None and traced_platform() == "gpu"
            and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128)


def _by_kernel(q, k, v, seg, span: Span, scale: float):
    """Exact attention of one sequence by a fused kernel where one serves (cuDNN's flash attention
    on a GPU in half precision for a plain causal or full mask, the TPU's splash kernel on a TPU),
    else None."""
    if _cudnn_runs(q, seg, span):  # named: JAX's default (None) is its XLA code, the whole (T, T) scores
        return jax.nn.dot_product_attention(q[None], k[None], v[None], scale=scale, is_causal=span.causal,
                                            implementation="cudnn")[0]
    if _tpu.kernel_runs(q, k, span):
        return _tpu.splash(q, k, v, seg, span, scale)
    return None


def fused_attention(q, k, v, *, causal: bool, scale: float):
    """Exact attention of one sequence (``(T, heads, D)``, no segments or window) by the kernel the
    platform traced for offers (`_by_kernel`: cuDNN's on a GPU, splash on a TPU), or None where
    none serves: the one choice `redeqx.attention` and the zoo's causal attention share."""
    return _by_kernel(q, k, v, None, Span(causal=causal), scale)


def _plain(q, k, v, pos, seg, span: Span, scale: float):
    """Exact attention on one device: by a fused kernel where one serves (`_by_kernel`), the scores
    in float32 otherwise."""
    if (out := _by_kernel(q, k, v, seg, span, scale)) is not None:
        return out
    seg = jnp.zeros(pos.shape, jnp.int32) if seg is None else seg
    pos = with_ranks(pos, seg, span)
    return masked_attention(q, k, v, block_mask(pos, pos, seg, seg, span), scale)


def block_layout(n_tokens: int, n_shards: int) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """``(b, layout)``: tokens per attention block, and for each context
    shard the original place (in blocks) of each block it holds in the
    dual-chunk order. Blocks never straddle chunks, so a block is a run of
    consecutive positions and a causal mask hides a key block whole or not."""
    chunk = n_tokens // (2 * n_shards) if n_tokens % (2 * n_shards) == 0 else n_tokens  # one shard, odd length
    b = block_size(chunk)
    ids = context_order(n_tokens, n_shards).reshape(n_shards, -1)[:, ::b] // b
    return b, tuple(tuple(int(i) for i in row) for row in ids)


def kv_heads_for_split(k, n: int):
    """``k`` (``(T, kv_heads, D)``) with each KV head repeated as few times as makes ``n`` divide
    them: ``n / gcd(kv_heads, n)``. That repeat also divides each KV head's query group (``n``
    divides the query heads), so query head ``h`` still reads its own KV head, and each device
    receives one copy per query group it holds, not one per query head (8 query and 2 KV heads over
    4 shards: 4 KV heads traded, not 8)."""
    repeat = n // math.gcd(k.shape[1], n)
    return k if repeat == 1 else jnp.repeat(k, repeat, axis=1)


def in_layout_order(x, n: int):
    """``x`` (dim 0: a whole sequence, a NumPy or JAX array) in the dual-chunk order of ``n`` shards:
    shard ``i`` holds chunks ``i`` and ``2n - 1 - i`` of its ``2n`` chunks (`context_order` is this
    of ``arange``). One concatenation of chunks, where indexing by the permutation compiles to a
    gather of rows (libtpu keeps one for each of q, k, v and the output, and 16 transposes)."""
    xp = np if isinstance(x, np.ndarray) else jnp
    chunks = x.reshape(2 * n, x.shape[0] // (2 * n), *x.shape[1:])
    return xp.concatenate([chunks[j] for i in range(n) for j in (i, 2 * n - 1 - i)])


def in_sequence_order(x, n: int):
    """`in_layout_order`'s inverse: the sequence's own order, the first chunk of each shard's pair in
    shard order, then the second ones in reverse."""
    held = x.reshape(n, 2, x.shape[0] // (2 * n), *x.shape[1:])
    return jnp.concatenate([held[i, 0] for i in range(n)] + [held[i, 1] for i in reversed(range(n))])


def heads_work(q, k, v, seg, span: Span, scale: float, n: int):
    """What one device of the heads split computes between its all-to-alls: every token of its
    heads (``(T, heads / n, D)``, in the dual-chunk layout) put in the sequence's own order,
    attended (by a fused kernel where one serves, `_by_kernel`, else `whole_attention`, a block at a
    time: the ``(T, T)`` scores of its heads would not fit where a split is needed), and put back."""
    q, k, v = (in_sequence_order(x, n) for x in (q, k, v))
    seg = None if seg is None else in_sequence_order(seg, n)
    out = _by_kernel(q, k, v, seg, span, scale)
    if out is None:
        pos = jnp.arange(q.shape[0], dtype=jnp.int32)
        out = whole_attention(q, k, v, pos, jnp.zeros(pos.shape, jnp.int32) if seg is None else seg, span, scale)
    return in_layout_order(out, n)


def _heads_attention(q, k, v, seg, span: Span, scale: float, n: int):
    """One device's part of attention split by heads (inside ``shard_map`` over ``context``): its
    shard of the sequence (every head) traded by all-to-all for every token of ``1 / n`` of the
    heads (KV heads that ``n`` does not divide repeated first, `kv_heads_for_split`), attended
    (`heads_work`), and traded back."""
    k, v = (kv_heads_for_split(x, n) for x in (k, v))
    to_heads = functools.partial(jax.lax.all_to_all, axis_name=CONTEXT, split_axis=1, concat_axis=0, tiled=True)
    seg = None if seg is None else jax.lax.all_gather(seg, CONTEXT, tiled=True)
    out = heads_work(to_heads(q), to_heads(k), to_heads(v), seg, span, scale, n)
    return jax.lax.all_to_all(out, CONTEXT, split_axis=0, concat_axis=1, tiled=True)


def _split(q, k, v, pos, seg, span: Span, scale: float, impl: str, n: int):
    """Attention with the sequence split over ``context`` (``n`` shards)."""
    seq, tok = P(CONTEXT, None, None), P(CONTEXT)
    if impl == "heads" and n > 1:
        # axes of one device manual too: with nothing left to the partitioner a TPU's kernel can run
        mesh = jax.sharding.get_abstract_mesh()
        manual = frozenset({CONTEXT, *(a for a, size in zip(mesh.axis_names, mesh.axis_sizes) if size == 1)})
        if q.shape[1] % n:
            raise ValueError(f"attention(impl='heads'): {q.shape[1]} query heads do not split over {n} context "
                             "shards; use impl='gather' or 'ring', or a context shard count that divides them.")
        body = functools.partial(_heads_attention, span=span, scale=scale, n=n)
        if seg is None:
            return jax.shard_map(lambda a, b, c: body(a, b, c, None), in_specs=(seq, seq, seq), out_specs=seq,
                                 axis_names=manual, check_vma=False)(q, k, v)
        return jax.shard_map(body, in_specs=(seq, seq, seq, tok), out_specs=seq, axis_names=manual,
                             check_vma=False)(q, k, v, seg)
    seg = jnp.zeros(pos.shape, jnp.int32) if seg is None else seg
    b, layout = block_layout(q.shape[0], n)
    if impl == "ring" and n > 1:
        body = functools.partial(ring_attention, span=span, scale=scale, n=n, layout=layout, b=b)
    else:
        body = functools.partial(gather_attention, span=span, scale=scale, n=n, layout=layout, b=b)
    return jax.shard_map(lambda q, k, v, pos, seg: body(q, k, v, with_ranks(pos, seg, span, n), seg),
                         in_specs=(seq, seq, seq, tok, tok), out_specs=seq, axis_names=frozenset({CONTEXT}),
                         check_vma=False)(q, k, v, pos, seg)


@typechecked
def attention(
    q: Float[Array, "*batch seq q_heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    *,
    causal: bool = True,
    segment_ids: Integer[Array, "*batch seq"] | Bool[Array, "*batch seq"] | None = None,
    scale: float | None = None,
    window: int | np.integer | None = None,
    impl: str = "gather",
) -> Float[Array, "*batch seq q_heads head_dim"]:
    """Exact softmax attention of a sequence over itself, split over the
    mesh's ``context`` axis when it has one.

    ``q_heads`` is a multiple of ``kv_heads`` (grouped-query attention:
    query head ``h`` reads KV head ``h // (q_heads / kv_heads)``). A query
    sees the keys of its own segment (``segment_ids``, ints: packed documents;
    or the boolean ``attention_mask`` for padding, whose tokens then only see
    each other), and with ``causal=True`` only those at or before its own
    position (`sequence_positions`: the original order, whatever the
    layout); with a ``window`` (causal only), only the last ``window`` of
    those, itself included (sliding-window attention, as Mistral's): the
    window counts its own segment's tokens, so padding inside a sequence
    takes no place in it. ``scale`` defaults to ``1 / sqrt(head_dim)``.

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
    beside the compute), or the heads split instead of the sequence
    (``impl="heads"``: q, k and v traded by all-to-all for every token of
    ``1 / C`` of the heads, attended as on one device, cuDNN's kernel on a
    GPU, and traded back; ``C`` must divide the query heads, and KV heads it
    does not divide are repeated until it does, each device receiving one per
    query group it holds). ``impl="auto"``:
    ``heads`` on a GPU where cuDNN's kernel then runs (half precision, no
    segments or window), ``gather`` elsewhere. ``gather`` and
    ``ring`` compute blocks of up to 1024 queries by 1024
    keys (the largest divisor of a chunk's ``T / 2C`` tokens not above
    1024), with an online softmax, skip the blocks a causal mask hides
    whole (and those a sliding window leaves behind: with segments, as the loop meets them, the pair
    tables being the causal mask's), and differentiate by recomputing the scores (custom VJPs),
    never forming the ``(T, T)`` scores; ``heads`` runs that loop over the
    whole sequence for its heads wherever cuDNN's kernel does not (a TPU, a
    CPU, segments, a window, float32).

    **Example** (inside a model, one sequence; ``jax.vmap`` batches it):

    ```python
    q = apply_rope(q, redeqx.sequence_positions(q.shape[0]))
    out = redeqx.attention(q, k, v, causal=True)          # (seq, heads, head_dim)
    ```
    """
    if impl not in IMPLS:
        raise ValueError(f"attention: impl={impl!r}; choose one of {IMPLS} ('ring' when gathered K/V do not fit, "
                         "'heads' to split heads instead of the sequence).")
    if q.shape[-3] != k.shape[-3] or k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[-2] % k.shape[-2]:
        raise ValueError(
            f"attention: q {q.shape}, k {k.shape}, v {v.shape}: k and v need the same shape, the same sequence "
            "length and head size as q, and a number of heads that divides q's (grouped-query attention)."
        )
    if isinstance(window, np.integer):
        window = int(window)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1 or not causal):
        raise ValueError(f"attention: window={window!r}; a sliding window is a positive int of tokens, and needs "
                         "causal=True (each query sees the window of keys ending at itself).")
    if q.ndim > 3:  # a batch: each sequence on its own
        fn = functools.partial(attention, causal=causal, scale=scale, window=window, impl=impl)
        if segment_ids is None:
            return jax.vmap(lambda a, b, c: fn(a, b, c))(q, k, v)
        return jax.vmap(lambda a, b, c, s: fn(a, b, c, segment_ids=s))(q, k, v, segment_ids)
    scale = float(q.shape[-1]) ** -0.5 if scale is None else float(scale)
    n = context_axis()
    pos = sequence_positions(q.shape[0])
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    span = Span(causal, window, by_segment=window is not None and seg is not None)
    if n is None:
        return _plain(q, k, v, pos, seg, span, scale)
    if n > 1:
        _check_split(q.shape[0], n, "redeqx.attention")
    if impl == "auto":
        impl = auto_impl(q, seg, span, n)
    return _split(q, k, v, pos, seg, span, scale, impl, n)


def auto_impl(q, seg, span: Span, n: int) -> str:
    """``impl="auto"``'s choice: ``heads`` on a GPU where each device then runs cuDNN's flash attention
    (half precision, no segments or window, the heads split evenly), as published comparisons favour
    there; ``gather`` elsewhere (MaxText's choice on TPUs, and blockwise where cuDNN would not run)."""
    return "heads" if _cudnn_runs(q, seg, span) and q.shape[1] % n == 0 else "gather"
