"""Small layers shared by the model families: one unbatched example at a time
(batch with ``jax.vmap``), weights in PyTorch's ``(out, in)`` layout so that
Hugging Face tensors load without a transpose and the sharding rules read
them as Equinox ``Linear`` weights."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._constrain import constrain
from .._mesh import MODEL
from ._fused import column_matmul, row_matmul
from .._trees import path_str
from ._hf import HFTensor

INIT_STD = 0.02  # the initializer_range of the Hugging Face configs

# Hugging Face's names for the feed-forward activations.
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # the tanh form
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


def _last(v: Array, ndim: int) -> Array:
    """A ``(dim,)`` vector shaped to broadcast against the last axis of a rank-``ndim`` array."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


class Linear(eqx.Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape ``(out, in)``."""

    weight: Float[Array, "out in"]
    bias: Float[Array, " out"] | None

    def __init__(self, n_in: int, n_out: int, *, bias: bool, key: PRNGKeyArray, dtype=jnp.float32,
                 std: float = INIT_STD):
        self.weight = std * jax.random.normal(key, (n_out, n_in), dtype)
        self.bias = jnp.zeros((n_out,), dtype) if bias else None

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        y = x @ self.weight.T.astype(x.dtype)
        return y if self.bias is None else y + _last(self.bias.astype(x.dtype), y.ndim)


def _model_shards() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or MODEL not in mesh.shape else mesh.shape[MODEL]


def fused_linears(
    x: Float[Array, "seq in"], layers: list, units: list[int] | None = None
) -> list[Float[Array, "seq _"]]:
    """``[layer(x) for layer in layers]``, as one matmul when every layer is a
    plain `Linear`, for column-parallel layers that read the same input
    (Q/K/V; gate/up).

    Why: the backward pass sums the input gradients of these layers, each a
    partial sum over the ``model`` shards. Done as separate matmuls, XLA
    all-reduces each partial before adding them (3 all-reduces for Q/K/V
    where Megatron has 1). One matmul makes one partial sum and one
    all-reduce. The weights are concatenated shard by shard: each weight
    ``(out, in)`` is viewed as ``(n_shards, out / n_shards, in)`` and the
    views joined on the middle axis, which every device does on its own
    rows, so nothing moves.

    ``units[i]`` is how many whole pieces (attention heads) layer ``i``'s
    outputs form; the shard-by-shard view is used only when ``n_shards``
    divides every layer's units, as the sharding rules split them.

    Any other module in ``layers`` (a LoRA adapter, a quantised layer, a
    user's own) is called as it is: the fast path reads ``weight`` and
    ``bias`` directly and would silently skip whatever else the module does.
    """
    if not all(type(layer) is Linear for layer in layers):
        return [layer(x) for layer in layers]
    n = _model_shards()
    units = [layer.weight.shape[0] for layer in layers] if units is None else units
    if any(u % n for u in units):
        n = 1
    ys = column_matmul(x, tuple(layer.weight for layer in layers), n)  # see _fused.py for its backward pass
    return [y if layer.bias is None else y + _last(layer.bias.astype(y.dtype), y.ndim) for layer, y in zip(layers, ys)]


def fused_row_linears(
    xs: list[Float[Array, "seq _"]], layers: list, units: list[int]
) -> Float[Array, "seq out"]:
    """``sum(layer(x) for x, layer in zip(xs, layers))``, as one matmul when
    every layer is a plain `Linear`, for row-parallel layers whose outputs are
    added (GPT-J's attention output and MLP output, off one LayerNorm).

    Why: a row-parallel output is a partial sum over the ``model`` shards.
    Done as separate matmuls, XLA all-reduces each before adding them (2
    all-reduces); one matmul over the joined inputs makes one partial sum and
    one all-reduce. Inputs ``(seq, in)`` are viewed as ``(seq, n_shards, in /
    n_shards)`` and weights ``(out, in)`` as ``(out, n_shards, in /
    n_shards)``, joined on the last axis: every device joins its own
    columns, so nothing moves.

    ``units[i]`` is how many whole pieces (heads, hidden units) layer ``i``'s
    inputs form. When ``n_shards`` does not divide every one of them, or a
    layer is any other module (a LoRA adapter), the layers are called one by
    one and their outputs added.
    """
    n = _model_shards()
    if not all(type(layer) is Linear for layer in layers) or any(u % n for u in units):
        out = layers[0](xs[0])
        for layer, x in zip(layers[1:], xs[1:]):
            out = out + layer(x)
        return out
    y = row_matmul(tuple(xs), tuple(layer.weight for layer in layers), n)  # one partial sum over the model shards
    for layer in layers:
        if layer.bias is not None:
            y = y + _last(layer.bias.astype(y.dtype), y.ndim)
    return y


class Embedding(eqx.Module):
    """A ``(vocab, dim)`` table; ``__call__`` looks rows up, `attend` is the tied LM head."""

    weight: Float[Array, "vocab dim"]

    def __init__(self, vocab: int, dim: int, *, key: PRNGKeyArray, dtype=jnp.float32, std: float = INIT_STD):
        self.weight = std * jax.random.normal(key, (vocab, dim), dtype)

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq dim"]:
        return jnp.take(self.weight, ids, axis=0)

    def attend(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq vocab"]:
        return x @ self.weight.T.astype(x.dtype)


class RMSNorm(eqx.Module):
    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)  # statistics in float32, also under bf16 compute
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)
        return _last(self.weight.astype(x.dtype), x.ndim) * x32.astype(x.dtype)


class LayerNorm(eqx.Module):
    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.weight = jnp.ones((dim,), dtype)
        self.bias = jnp.zeros((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, -1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
        y = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return y * _last(self.weight.astype(x.dtype), y.ndim) + _last(self.bias.astype(x.dtype), y.ndim)


class KVCache(eqx.Module):
    """Keys and values of one attention layer for ``max_len`` slots."""

    k: Float[Array, "max_len kv_heads head_dim"]
    v: Float[Array, "max_len kv_heads head_dim"]

    @staticmethod
    def empty(max_len: int, kv_heads: int, head_dim: int, dtype) -> "KVCache":
        z = constrain(jnp.zeros((max_len, kv_heads, head_dim), dtype), P(None, MODEL, None))
        return KVCache(z, z)


class Cache(eqx.Module):
    """The decoding state of a decoder-only model for one sequence.

    ``index`` is the next free slot, ``position`` the next token's position
    (they differ by the number of padding slots), ``valid[s]`` whether slot
    ``s`` holds a real token.
    """

    layers: list[KVCache]
    valid: Bool[Array, " max_len"]
    index: Int[Array, ""]
    position: Int[Array, ""]


def heads(x: Float[Array, "seq features"], n: int) -> Float[Array, "seq heads head_dim"]:
    """Split projected features into heads, the heads split over ``model``."""
    return constrain(x.reshape(x.shape[0], n, -1), P(None, MODEL, None))


@dataclasses.dataclass(frozen=True)
class CausalMask:
    """The plain causal mask of ``n`` tokens (no padding, no window), said
    rather than built: `attention` hands it to a fused kernel where one can
    serve, and builds the boolean matrix where not."""

    n: int

    def array(self) -> Bool[Array, "n n"]:
        return jnp.tril(jnp.ones((self.n, self.n), bool))


def _flash_ok(q, k, bias) -> bool:
    """cuDNN's fused attention applies: a GPU, half-precision inputs, no
    additive bias, a head size it supports. It never forms the (T, T) scores."""
    return (bias is None and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128
            and jax.devices()[0].platform == "gpu")


def attention(
    q: Float[Array, "q_seq q_heads head_dim"],
    k: Float[Array, "kv_seq kv_heads head_dim"],
    v: Float[Array, "kv_seq kv_heads head_dim"],
    mask: Bool[Array, "q_seq kv_seq"] | CausalMask,
    *,
    scale: float,
    bias: Float[Array, "q_heads q_seq kv_seq"] | None = None,
) -> Float[Array, "q_seq q_heads head_dim"]:
    """Softmax attention with grouped query heads (``q_heads`` a multiple of
    ``kv_heads``; query head ``h`` reads KV head ``h // (q_heads / kv_heads)``).

    With a `CausalMask` on a GPU in bfloat16/float16, cuDNN's flash attention
    (``jax.nn.dot_product_attention``) computes it without materialising the
    scores; otherwise scores and softmax are computed exactly, in float32."""
    if isinstance(mask, CausalMask):
        if _flash_ok(q, k, bias):
            out = jax.nn.dot_product_attention(q[None], k[None], v[None], scale=scale, is_causal=True,
                                               implementation="cudnn")
            return out[0]
        mask = mask.array()
    t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(t, hkv, hq // hkv, d)  # (T, Hkv, G, D)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        scores = scores + bias.reshape(hkv, hq // hkv, *bias.shape[1:]).astype(jnp.float32)
    scores = jnp.where(mask[None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("kgts,skd->tkgd", probs, v)
    return out.reshape(t, hq, d)


def update_cache(layer: KVCache, k, v, index) -> KVCache:
    """Write ``k``/``v`` of the new tokens into slots ``index, index + 1, ...``."""
    k = jax.lax.dynamic_update_slice_in_dim(layer.k, k.astype(layer.k.dtype), index, axis=0)
    v = jax.lax.dynamic_update_slice_in_dim(layer.v, v.astype(layer.v.dtype), index, axis=0)
    return KVCache(k, v)


class Attention(eqx.Module):
    """Multi-head attention with ``q_proj``, ``k_proj``, ``v_proj`` and
    ``out_proj`` (the fairseq layout of BART and OPT), scores scaled by
    ``1 / sqrt(head_dim)``: self-attention that appends to a `KVCache` when
    given one, or cross attention to keys/values projected once from an
    encoder output (`project_kv`). Q/K/V are column parallel, ``out_proj`` row
    parallel: one all-reduce forward, one backward."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    out_proj: Linear
    n_heads: int = eqx.field(static=True)

    def __init__(self, dim: int, n_heads: int, *, bias: bool, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            Linear(dim, dim, bias=bias, key=k) for k in (kq, kk, kv, ko)
        )
        self.n_heads = n_heads

    def __call__(
        self,
        x: Float[Array, "seq dim"],
        mask: Bool[Array, "seq kv_seq"],
        *,
        cache: KVCache | None = None,
        index: Int[Array, ""] | None = None,
        kv: KVCache | None = None,
    ) -> tuple[Float[Array, "seq dim"], KVCache | None]:
        """Self-attention over ``x`` (its keys/values written into ``cache`` at
        slot ``index`` when given), or cross attention to ``kv``."""
        h = self.n_heads
        if kv is not None:
            q = heads(fused_linears(x, [self.q_proj], [h])[0], h)
            k, v = kv.k.astype(q.dtype), kv.v.astype(q.dtype)
        else:
            q, k, v = (heads(y, h) for y in fused_linears(x, [self.q_proj, self.k_proj, self.v_proj], [h] * 3))
            if cache is not None:
                cache = update_cache(cache, k, v, index)
                k, v = cache.k.astype(q.dtype), cache.v.astype(q.dtype)
        out = attention(q, k, v, mask, scale=inv_sqrt(q.shape[-1]))
        out = constrain(out.reshape(out.shape[0], -1), P(None, MODEL))
        return constrain(self.out_proj(out), P()), cache  # row parallel: one all-reduce

    def project_kv(self, source: Float[Array, "src dim"]) -> KVCache:
        """Keys and values of an encoder output, for cross attention."""
        h = self.n_heads
        k, v = (heads(y, h) for y in fused_linears(source, [self.k_proj, self.v_proj], [h, h]))
        return KVCache(k, v)


def causal_mask(
    valid_keys: Bool[Array, " kv_seq"], first_slot, n_queries: int, window: int | None = None
) -> Bool[Array, "q_seq kv_seq"]:
    """Query ``t`` (in slot ``first_slot + t``) sees valid keys in slots up to
    its own, and with a sliding ``window`` only the last ``window`` of them
    (itself included), as Mistral does."""
    q_slot = first_slot + jnp.arange(n_queries)[:, None]
    k_slot = jnp.arange(valid_keys.shape[0])[None, :]
    mask = (k_slot <= q_slot) & valid_keys[None, :]
    if window is not None:
        mask = mask & (q_slot - k_slot < window)
    return mask


def write_valid(cache: Cache, valid_new: Bool[Array, " seq"]) -> Bool[Array, " max_len"]:
    return jax.lax.dynamic_update_slice_in_dim(cache.valid, valid_new, cache.index, axis=0)


def check_fits(name: str, n: int, max_len: int) -> None:
    if n > max_len:
        raise ValueError(f"{name}: {n} tokens do not fit a cache of max_len={max_len}; pass a larger max_len.")


def check_positions(name: str, n: int, table: int | None, field: str) -> None:
    """A model with a learned position table cannot read positions past it: ``jnp.take`` would
    return NaN rows (its fill mode) and train on them without a word."""
    if table is not None and n > table:
        raise ValueError(
            f"{name}: {n} positions do not fit the model's learned position table of {table} ({field}={table}); "
            f"use sequences of at most {table} tokens (truncate or split them), or a model with a larger {field}."
        )


def check_positive_ints(config, names: tuple[str, ...]) -> None:
    """A clear error for the first of ``config``'s fields ``names`` that is not a positive int."""
    for name in names:
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {v!r}.")


def default_head_dim(hidden: int, n_heads: int) -> int:
    if hidden % n_heads:
        raise ValueError(
            f"hidden_size={hidden} is not a multiple of num_attention_heads={n_heads}; set head_dim explicitly."
        )
    return hidden // n_heads


def inv_sqrt(d: int) -> float:
    return 1.0 / math.sqrt(d)


def renamed_tensors(model, rename: Callable[[str], str]) -> list[HFTensor]:
    """One checkpoint tensor per array leaf of ``model``, named
    ``rename(path)``: for a family whose attribute names follow Hugging
    Face's except where the sharding rules need another word (a learned
    position table named ``position_embedding`` reads as one)."""
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
    return [HFTensor(rename(p), (p,)) for p in (path_str(kp) for kp, _ in leaves)]


class CausalLM(eqx.Module):
    """What every decoder-only family shares: the full forward, the cache and
    cached decoding, built on the family's ``_run(ids, positions, mask, cache)
    -> (logits, new_layer_caches)`` and ``_kv_shape() -> (layers, kv_heads, head_dim)``."""

    def _run(self, ids, positions, mask, cache):
        raise NotImplementedError

    def _kv_shape(self) -> tuple[int, int, int]:
        raise NotImplementedError

    def _window(self) -> int | None:
        """Sliding-window attention span, or None for full causal attention."""
        return None

    def _max_positions(self) -> tuple[int, str] | None:
        """How many positions a learned position table holds, and the config field
        that sets it; None for rotary models, which have no table."""
        return None

    def _check_positions(self, where: str, n: int) -> None:
        if (table := self._max_positions()) is not None:
            check_positions(f"{type(self).__name__}{where}", n, *table)

    def _dtype(self):
        return jax.tree.leaves(self)[0].dtype

    def __call__(
        self,
        input_ids: Int[Array, " seq"],
        *,
        attention_mask: Bool[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq vocab"]:
        """Logits for every position. ``attention_mask`` marks real tokens
        (``False`` for padding; positions count real tokens only, as Hugging
        Face does for left padding). ``key`` is unused (no dropout)."""
        del key
        t = input_ids.shape[0]
        self._check_positions("", t)
        if attention_mask is None and self._window() is None:  # training's case: a kernel may serve it
            logits, _ = self._run(input_ids, jnp.arange(t), CausalMask(t), None)
            return logits
        valid = jnp.ones((t,), bool) if attention_mask is None else attention_mask.astype(bool)
        positions = jnp.maximum(jnp.cumsum(valid) - 1, 0)
        logits, _ = self._run(input_ids, positions, causal_mask(valid, 0, t, self._window()), None)
        return logits

    def init_cache(self, max_len: int, dtype=None) -> Cache:
        """An empty decoding cache with ``max_len`` slots (prompt + new tokens)."""
        self._check_positions(".init_cache", max_len)
        n_layers, kv_heads, head_dim = self._kv_shape()
        dtype = dtype or self._dtype()
        return Cache(
            layers=[KVCache.empty(max_len, kv_heads, head_dim, dtype) for _ in range(n_layers)],
            valid=jnp.zeros((max_len,), bool),
            index=jnp.zeros((), jnp.int32),
            position=jnp.zeros((), jnp.int32),
        )

    def prefill(
        self, input_ids: Int[Array, " seq"], attention_mask: Bool[Array, " seq"], max_new_tokens: int
    ) -> tuple[Float[Array, " vocab"], Cache]:
        """Decode a padded prompt into a cache with room for
        ``max_new_tokens`` more: the next token's logits and the cache (what
        `redeqx.models.generate` starts from). Padding (``attention_mask``
        False) may sit anywhere: positions count real tokens only, padded
        slots are never attended to, and the logits are the last real
        token's."""
        t = input_ids.shape[0]
        cache = self.init_cache(t + max_new_tokens)
        logits, cache = self.decode(input_ids, cache, attention_mask=attention_mask)
        return logits[t - 1 - jnp.argmax(attention_mask[::-1])], cache

    def decode(
        self,
        input_ids: Int[Array, " seq"],
        cache: Cache,
        *,
        attention_mask: Bool[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq vocab"], Cache]:
        """Run ``input_ids`` after what ``cache`` holds: their logits and the
        cache with them appended (a prompt at once, then one token a step)."""
        t = input_ids.shape[0]
        check_fits(f"{type(self).__name__}.decode", t, cache.valid.shape[0])
        valid_new = jnp.ones((t,), bool) if attention_mask is None else attention_mask.astype(bool)
        positions = cache.position + jnp.maximum(jnp.cumsum(valid_new) - 1, 0)
        valid = write_valid(cache, valid_new)
        logits, layers = self._run(input_ids, positions, causal_mask(valid, cache.index, t, self._window()), cache)
        new = Cache(layers, valid, cache.index + t, cache.position + jnp.sum(valid_new).astype(jnp.int32))
        return logits, new
