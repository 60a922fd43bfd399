"""T5 (v1.0 and v1.1 / Flan-T5): an encoder-decoder with relative position
buckets, RMS-style layer norms and no biases.

Attribute paths are the Hugging Face tensor names
(``encoder.block.0.layer.0.SelfAttention.q.weight``,
``decoder.block.0.layer.2.DenseReluDense.wi_0.weight``), so checkpoints load by
name and `redeqx.sharding_rules` gives the Megatron-LM plan with no overrides:
``q``/``k``/``v`` and ``wi``/``wi_0``/``wi_1`` split on output features, ``o``
and ``wo`` on input features, ``shared`` and ``lm_head`` on the vocabulary,
the relative position bias table ``(buckets, heads)`` on its heads.

T5 details that differ from a decoder-only model:

- attention scores are not scaled by ``1 / sqrt(head_dim)``; a learned bias
  per head and relative-position bucket is added instead, computed by the
  first block of each stack and shared by every block of that stack
  (bidirectional buckets in the encoder, causal ones in the decoder);
- each decoder block attends to the encoder output ("cross attention");
- v1.0 ties the LM head to the embedding and scales the decoder output by
  ``1 / sqrt(d_model)`` first; v1.1 has its own head and no scaling, and a
  gated GELU feed-forward (``wi_0``, ``wi_1``) instead of ReLU (``wi``).
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..mesh import constrain
from ..mesh import MODEL
from ._layers import (
    Stackable,
    Embedding,
    KVCache,
    Linear,
    RMSNorm,
    attend_and_project,
    build_layers,
    causal_mask,
    heads,
    is_stacked,
    joined_linears,
    lm_logits,
    run_layers,
)
from ._config import ZooConfig
from ._safetensors import HFTensor
from ._seq2seq import EncoderDecoderLM, cache_slots, layer_caches, refuse_split


_ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # the tanh form
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class T5Config(ZooConfig):
    """Sizes and options of a T5 model; names follow Hugging Face's ``config.json``.

    ``feed_forward_proj`` is ``"relu"`` (T5 v1.0), ``"gated-gelu"`` (v1.1,
    Flan-T5: ``gelu(wi_0 x) * wi_1 x``, GELU in its tanh form), or another
    ``[gated-]relu|gelu|gelu_new|silu``."""

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64  # size of one attention head
    d_ff: int = 2048
    num_layers: int = 6  # encoder blocks
    num_decoder_layers: int | None = None  # None: as many as the encoder
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True  # v1.0 ties the LM head to `shared`; v1.1 does not
    scale_decoder_outputs: bool | None = None  # None: scale by 1/sqrt(d_model) exactly when tied
    pad_token_id: int = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    decoder_start_token_id: int = 0  # T5 starts decoding from the pad token
    initializer_factor: float = 1.0  # scales T5's initialisation (below); Transformers' name

    hf_architecture = "T5ForConditionalGeneration"
    hf_type = "t5"
    hf_required = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads")
    hf_fixed = {"is_encoder_decoder": True}
    positive = (*hf_required, "relative_attention_num_buckets", "relative_attention_max_distance")

    def check(self):
        if isinstance(self.initializer_factor, bool) or not isinstance(self.initializer_factor, (int, float)) \
                or not self.initializer_factor > 0:
            raise ValueError(f"T5Config.initializer_factor must be a positive number, got {self.initializer_factor!r}.")
        if self.num_decoder_layers is not None and (
            isinstance(self.num_decoder_layers, bool) or not isinstance(self.num_decoder_layers, int)
            or self.num_decoder_layers < 1
        ):
            raise ValueError(f"T5Config.num_decoder_layers must be a positive int or None, got {self.num_decoder_layers!r}.")
        if self.relative_attention_num_buckets < 4:
            raise ValueError(
                f"T5Config.relative_attention_num_buckets must be at least 4 (half exact, half "
                f"logarithmic, each direction), got {self.relative_attention_num_buckets}."
            )
        parts = self.feed_forward_proj.split("-")
        if not (len(parts) == 1 or (len(parts) == 2 and parts[0] == "gated")) or parts[-1] not in _ACTIVATIONS:
            raise ValueError(
                f"T5Config.feed_forward_proj={self.feed_forward_proj!r} is not supported; use 'relu' (T5), "
                f"'gated-gelu' (T5 v1.1), or '[gated-]<act>' with <act> in {sorted(_ACTIVATIONS)}."
            )

    @property
    def n_decoder_layers(self) -> int:
        return self.num_decoder_layers or self.num_layers

    @property
    def gated(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @property
    def activation(self) -> str:
        act = self.feed_forward_proj.split("-")[-1]
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else act  # as Transformers does

    @property
    def scale_head(self) -> bool:
        return self.tie_word_embeddings if self.scale_decoder_outputs is None else self.scale_decoder_outputs

    @classmethod
    def hf_in(cls, d, values, tensor_names):
        """Transformers 5 writes ``tie_word_embeddings: true`` for every T5 and
        keeps the head untied when the checkpoint holds an ``lm_head.weight``
        of its own, so its presence decides; ``scale_decoder_outputs`` (or,
        in older files, ``tie_word_embeddings``) decides the scaling."""
        tied = bool(d.get("tie_word_embeddings", True))
        scale = bool(d.get("scale_decoder_outputs", tied))
        if tensor_names is not None:
            tied = "lm_head.weight" not in tensor_names
        return {**values, "tie_word_embeddings": tied, "scale_decoder_outputs": None if scale == tied else scale,
                "decoder_start_token_id": d.get("decoder_start_token_id", d.get("pad_token_id", 0))}

    def hf_out(self, d):
        """Transformers 4 and 5 load it as is."""
        return {**d, "num_decoder_layers": self.n_decoder_layers, "scale_decoder_outputs": self.scale_head}


def relative_position_buckets(
    relative: Int[Array, "q k"], *, bidirectional: bool, num_buckets: int, max_distance: int
) -> Int[Array, "q k"]:
    """T5's bucket of each ``key_position - query_position``.

    Bidirectional (encoder): half the buckets for keys before the query, half
    for keys after. Causal (decoder): only keys at or before the query count.
    Within a direction, the first half of the buckets are exact distances
    ``0, 1, ...``; the rest cover distances up to ``max_distance`` on a log
    scale, and farther keys share the last bucket.
    """
    n = num_buckets
    if bidirectional:
        n //= 2
        offset = jnp.where(relative > 0, n, 0)
        distance = jnp.abs(relative)
    else:
        offset = 0
        distance = jnp.maximum(-relative, 0)
    exact = n // 2
    # float32 steps in the order Transformers takes them, so boundaries agree
    log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact)
    far = exact + (log_ratio / math.log(max_distance / exact) * (n - exact)).astype(jnp.int32)
    far = jnp.minimum(far, n - 1)
    return offset + jnp.where(distance < exact, distance, far)


def _bias_table(config: T5Config, key: PRNGKeyArray) -> Embedding:
    """The relative position bias table ``(buckets, heads)`` of a stack's first block."""
    std = config.initializer_factor * config.d_model ** -0.5
    return Embedding(config.relative_attention_num_buckets, config.num_heads, key=key, std=std)


def _bias_key(block_key: PRNGKeyArray) -> PRNGKeyArray:
    """The key `T5Block` draws its table from (self-attention's, then T5Attention's fifth)."""
    return jax.random.split(jax.random.split(block_key, 3)[0], 5)[4]


def position_bias(table: Embedding, config: T5Config, q_pos: Int[Array, " q"], k_pos: Int[Array, " k"], *,
                  bidirectional: bool) -> Float[Array, "heads q k"]:
    """The bias each head adds to the scores of queries ``q_pos`` and keys ``k_pos``."""
    buckets = relative_position_buckets(
        k_pos[None, :] - q_pos[:, None], bidirectional=bidirectional,
        num_buckets=config.relative_attention_num_buckets, max_distance=config.relative_attention_max_distance,
    )
    bias = jnp.moveaxis(table(buckets.reshape(-1)).reshape(*buckets.shape, -1), -1, 0)
    return constrain(bias, P(MODEL, None, None))  # heads split, as the scores are


class T5Attention(eqx.Module):
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    relative_attention_bias: Embedding | None  # (buckets, heads), first block of a listed stack only
    config: T5Config = eqx.field(static=True)

    def __init__(self, config: T5Config, *, has_bias: bool, key: PRNGKeyArray):
        kq, kk, kv, ko, kb = jax.random.split(key, 5)
        c, inner, f = config, config.num_heads * config.d_kv, config.initializer_factor
        # T5's own scales (Mesh TensorFlow's, as Transformers draws them): the scores are not
        # divided by sqrt(d_kv), so q's smaller init does it; 0.02 everywhere leaves the decoder
        # ignoring the encoder when trained from scratch.
        self.q = Linear(c.d_model, inner, bias=False, key=kq, std=f * (c.d_model * c.d_kv) ** -0.5)
        self.k = Linear(c.d_model, inner, bias=False, key=kk, std=f * c.d_model ** -0.5)
        self.v = Linear(c.d_model, inner, bias=False, key=kv, std=f * c.d_model ** -0.5)
        self.o = Linear(inner, c.d_model, bias=False, key=ko, std=f * inner ** -0.5)
        self.relative_attention_bias = _bias_table(c, kb) if has_bias else None
        self.config = config

    def __call__(self, x, mask, bias, *, source=None, cache: KVCache | None = None, index=None, cached_kv=None):
        """Self-attention over ``x`` (``source=None``; writes ``cache`` at
        ``index`` when given), or cross attention to ``source`` (the encoder
        output) or to keys/values already projected (``cached_kv``)."""
        h = self.config.num_heads
        if cached_kv is not None:
            q = heads(self.q(x), h)
            k, v = cached_kv.read(q.dtype)
        elif source is not None:
            q = heads(self.q(x), h)
            k, v = (heads(y, h) for y in joined_linears(source, (self.k, self.v), joined=cache is None))
        else:
            q, k, v = (heads(y, h) for y in joined_linears(x, (self.q, self.k, self.v), joined=cache is None))
        return attend_and_project(self.o, q, k, v, mask, cache, index, scale=1.0, bias=bias)  # scores not scaled

    def project_kv(self, source: Float[Array, "src d_model"]) -> KVCache:
        h = self.config.num_heads
        return KVCache(heads(self.k(source), h), heads(self.v(source), h))


class T5LayerSelfAttention(eqx.Module):
    SelfAttention: T5Attention
    layer_norm: RMSNorm

    def __init__(self, config: T5Config, *, has_bias: bool, key: PRNGKeyArray):
        self.SelfAttention = T5Attention(config, has_bias=has_bias, key=key)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)


class T5LayerCrossAttention(eqx.Module):
    EncDecAttention: T5Attention
    layer_norm: RMSNorm

    def __init__(self, config: T5Config, *, key: PRNGKeyArray):
        self.EncDecAttention = T5Attention(config, has_bias=False, key=key)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)


class T5DenseActDense(eqx.Module):
    """``wo(act(wi x))`` (v1.0), or ``wo(act(wi_0 x) * wi_1 x)`` when gated (v1.1)."""

    wi: Linear | None
    wi_0: Linear | None
    wi_1: Linear | None
    wo: Linear
    activation: str = eqx.field(static=True)

    def __init__(self, config: T5Config, *, key: PRNGKeyArray):
        k0, k1, ko = jax.random.split(key, 3)
        d, f, s = config.d_model, config.d_ff, config.initializer_factor
        wi = dict(bias=False, std=s * d ** -0.5)
        if config.gated:
            self.wi, self.wi_0, self.wi_1 = None, Linear(d, f, key=k0, **wi), Linear(d, f, key=k1, **wi)
        else:
            self.wi, self.wi_0, self.wi_1 = Linear(d, f, key=k0, **wi), None, None
        self.wo = Linear(f, d, bias=False, key=ko, std=s * f ** -0.5)
        self.activation = config.activation

    def __call__(self, x: Float[Array, "seq d_model"], *, joined: bool = True) -> Float[Array, "seq d_model"]:
        """``joined``: a gated block's two input products as one (`joined_linears`); False in a
        pass with a KV cache, where no backward pass gains from it."""
        act = _ACTIVATIONS[self.activation]
        if self.wi is not None:
            h = act(self.wi(x))  # column parallel
        else:
            gate, up = joined_linears(x, (self.wi_0, self.wi_1), joined=joined)  # column parallel
            h = act(gate) * up
        return constrain(self.wo(h), P())  # row parallel: one all-reduce


class T5LayerFF(eqx.Module):
    DenseReluDense: T5DenseActDense
    layer_norm: RMSNorm

    def __init__(self, config: T5Config, *, key: PRNGKeyArray):
        self.DenseReluDense = T5DenseActDense(config, key=key)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def __call__(self, x, *, joined: bool = True):
        return x + self.DenseReluDense(self.layer_norm(x), joined=joined)


class T5Block(Stackable):
    """Encoder block: ``layer = [self-attention, FF]``; decoder block:
    ``layer = [self-attention, cross attention, FF]`` (Hugging Face's order)."""

    layer: list

    def __init__(self, config: T5Config, *, decoder: bool, has_bias: bool, key: PRNGKeyArray):
        ks, kc, kf = jax.random.split(key, 3)
        layers: list = [T5LayerSelfAttention(config, has_bias=has_bias, key=ks)]
        if decoder:
            layers.append(T5LayerCrossAttention(config, key=kc))
        layers.append(T5LayerFF(config, key=kf))
        self.layer = layers

    def __call__(self, x, mask, bias, cross=None, cache=None, index=None):
        """``cross``: ``(source_or_None, cached_kv_or_None, source_mask)`` in a decoder block."""
        sa = self.layer[0]
        a, cache = sa.SelfAttention(sa.layer_norm(x), mask, bias, cache=cache, index=index)
        x = x + a
        if cross is not None:
            source, cached_kv, source_mask = cross
            ca = self.layer[1]
            mask_x = jnp.broadcast_to(source_mask[None, :], (x.shape[0], source_mask.shape[0]))
            a, _ = ca.EncDecAttention(ca.layer_norm(x), mask_x, None, source=source, cached_kv=cached_kv)
            x = x + a
        return self.layer[-1](x, joined=cache is None), cache


class T5Stack(eqx.Module):
    block: list[T5Block] | T5Block  # stacked: one block, every array (layers, ...)
    final_layer_norm: RMSNorm
    # Stacked blocks must be alike, so the first block's bias table moves here;
    # listed, it stays in block 0, where Hugging Face names it.
    relative_attention_bias: Embedding | None
    config: T5Config = eqx.field(static=True)

    def __init__(self, config: T5Config, *, decoder: bool, key: PRNGKeyArray):
        n = config.n_decoder_layers if decoder else config.num_layers
        keys = jax.random.split(key, n)
        if config.scan_layers:
            self.block = build_layers(lambda k: T5Block(config, decoder=decoder, has_bias=False, key=k), keys,
                                      stacked=True)
            self.relative_attention_bias = _bias_table(config, _bias_key(keys[0]))
        else:
            self.block = [T5Block(config, decoder=decoder, has_bias=i == 0, key=k) for i, k in enumerate(keys)]
            self.relative_attention_bias = None
        self.final_layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
        self.config = config

    def bias(self, q_pos, k_pos, *, bidirectional: bool):
        table = self.relative_attention_bias if is_stacked(self.block) else \
            self.block[0].layer[0].SelfAttention.relative_attention_bias
        return position_bias(table, self.config, q_pos, k_pos, bidirectional=bidirectional)


class T5ForConditionalGeneration(EncoderDecoderLM):
    """T5 for one sequence pair (batch with ``jax.vmap``).

    **Example** (teacher-forced training logits and generation):

    ```python
    config = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                      num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    model = T5ForConditionalGeneration(config, key=jax.random.key(0))
    logits = jax.vmap(model)(inputs, decoder_inputs)   # (batch, tgt_len, vocab)
    tokens = redeqx.models.generate(model, inputs, attention_mask=mask, max_new_tokens=32, eos_token_id=1)
    ```

    ``decoder_input_ids`` are the labels shifted right behind
    ``config.decoder_start_token_id``, as in Transformers (`shift_right`).
    """

    shared: Embedding
    encoder: T5Stack
    decoder: T5Stack
    lm_head: Linear | None
    config: T5Config = eqx.field(static=True)

    # Copies of `shared` that some checkpoints carry, and a bias table old checkpoints have but never use.
    hf_ignore = (r"(encoder|decoder)\.embed_tokens\.weight",
                 r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight")
    hf_stacks = ("encoder.block", "decoder.block")

    def __init__(self, config: T5Config, *, key: PRNGKeyArray):
        if not isinstance(config, T5Config):
            raise TypeError(f"config must be a redeqx.models.T5Config, got {type(config).__name__}.")
        ks, ke, kd, kh = jax.random.split(key, 4)
        std = config.initializer_factor  # T5 draws its embedding and its head from N(0, 1)
        self.shared = Embedding(config.vocab_size, config.d_model, key=ks, std=std)
        self.encoder = T5Stack(config, decoder=False, key=ke)
        self.decoder = T5Stack(config, decoder=True, key=kd)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.d_model, config.vocab_size, bias=False, key=kh, std=std
        )
        self.config = config

    def encode(
        self, input_ids: Int[Array, " src"], attention_mask: Bool[Array, " src"] | None = None
    ) -> Float[Array, "src d_model"]:
        """The encoder output (after its final norm). ``attention_mask`` is
        ``False`` on padding, which no position attends to."""
        refuse_split(self)
        s = input_ids.shape[0]
        valid = jnp.ones((s,), bool) if attention_mask is None else attention_mask.astype(bool)
        x = constrain(self.shared(input_ids), P())
        pos = jnp.arange(s)
        bias = self.encoder.bias(pos, pos, bidirectional=True)
        mask = jnp.broadcast_to(valid[None, :], (s, s))
        x, _ = run_layers(self.encoder.block, x, None, lambda block, x, _: block(x, mask, bias),
                          unroll=self.config.scan_unroll)
        return self.encoder.final_layer_norm(x)

    def _logits(self, x):
        x = self.decoder.final_layer_norm(x)
        if self.config.scale_head:
            x = x * (self.config.d_model ** -0.5)
        return constrain(lm_logits(self.shared, self.lm_head, x), P(None, P.UNCONSTRAINED))  # vocab: the head's layout

    def _teacher_forced(self, decoder_input_ids, source, valid):
        t = decoder_input_ids.shape[0]
        x = constrain(self.shared(decoder_input_ids), P())
        pos = jnp.arange(t)
        bias = self.decoder.bias(pos, pos, bidirectional=False)
        mask = causal_mask(jnp.ones((t,), bool), 0, t)
        x, _ = run_layers(self.decoder.block, x, None, lambda block, x, _: block(x, mask, bias, (source, None, valid)),
                          unroll=self.config.scan_unroll)
        return self._logits(x)

    # -- cached decoding (EncoderDecoderLM)

    def _decoder_layers(self):
        return self.decoder.block

    def _self_attention_shape(self):
        return self.config.num_heads, self.config.d_kv

    def _cross_kv(self, block, source):
        return block.layer[1].EncDecAttention.project_kv(source)

    def _decode(self, decoder_input_ids, cache):
        t = decoder_input_ids.shape[0]
        slots = jnp.arange(cache_slots(cache))
        q_pos = cache.index + jnp.arange(t)
        bias = self.decoder.bias(q_pos, slots, bidirectional=False)  # (heads, t, max_len)
        mask = causal_mask(slots < cache.index + t, cache.index, t)
        x = constrain(self.shared(decoder_input_ids), P())

        def step(block, x, caches):
            self_cache, cross = caches
            return block(x, mask, bias, (None, cross, cache.source_valid), self_cache, cache.index)

        caches = layer_caches(self.decoder.block, cache.self_attention, cache.cross_attention)
        x, self_attention = run_layers(self.decoder.block, x, caches, step, unroll=self.config.scan_unroll)
        return self._logits(x), self_attention

    def hf_stacked(self, tensor: HFTensor) -> HFTensor:
        """``tensor`` for the stacked layout: each stack's bias table lives on the stack."""
        for stack in ("encoder", "decoder"):
            if tensor.paths == (f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",):
                return HFTensor(tensor.name, (f"{stack}.relative_attention_bias.weight",))
        return tensor.stacked(self.hf_stacks)

