"""BART: an encoder-decoder with learned positions, LayerNorm after each
sub-layer, GELU, biases everywhere, and one token embedding (``shared``)
for the encoder, the decoder and the LM head.

Attribute paths are the Hugging Face tensor names
(``model.encoder.layers.0.self_attn.q_proj.weight``,
``model.decoder.layers.0.encoder_attn.out_proj.weight``, ``...fc1.weight``),
so checkpoints load by name and `redeqx.sharding_rules` gives the Megatron-LM
plan with no overrides: Q/K/V and ``fc1`` split on output features,
``out_proj`` and ``fc2`` on input features, ``shared`` on the vocabulary,
each stack's ``embed_positions`` (a learned position table) replicated.
``final_logits_bias`` is a ``(vocab,)`` vector where Hugging Face keeps
``(1, vocab)``; `hf_tensors` reshapes it.

BART details:

- the position tables have ``max_position_embeddings + 2`` rows and position
  ``p`` reads row ``p + 2``; positions count from 0 in each stack, padding
  included (BART pads on the right);
- token embeddings are multiplied by ``sqrt(d_model)`` when
  ``scale_embedding`` (BART-Large does not), then the position is added and
  ``layernorm_embedding`` applied, in both stacks;
- every sub-layer is ``x = norm(x + f(x))`` (post-LN), with no final norm;
- the logits are ``shared.attend(x) + final_logits_bias``. Hugging Face keeps
  ``final_logits_bias`` as a buffer that training does not change; here it is
  read through ``stop_gradient``, so its gradient is zero as well.
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
from ._layers import (
    Stackable,
    ACTIVATIONS,
    Attention,
    Embedding,
    FairseqLayer,
    KVCache,
    POSITION_OFFSET,
    LayerNorm,
    Linear,
    causal_mask,
    check_positions,
    feed_forward,
    lm_logits,
    run_layers,
    table_and_layers,
)
from ._config import ZooConfig, check_activation
from ._safetensors import HFTensor, leaf_tensors
from ._seq2seq import EncoderDecoderLM, cache_slots, layer_caches, refuse_split

@dataclasses.dataclass(frozen=True)
class BartConfig(ZooConfig):
    """Sizes and options of a BART model; names follow Hugging Face's
    ``config.json``. The defaults are BART-Large."""

    vocab_size: int = 50265
    max_position_embeddings: int = 1024
    d_model: int = 1024
    encoder_layers: int = 12
    decoder_layers: int = 12
    encoder_attention_heads: int = 16
    decoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    decoder_ffn_dim: int = 4096
    activation_function: str = "gelu"
    scale_embedding: bool = False  # multiply token embeddings by sqrt(d_model)
    tie_word_embeddings: bool = True  # the LM head is `shared`
    layer_norm_eps: float = 1e-5  # torch.nn.LayerNorm's default, which BART uses
    pad_token_id: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | None = 2
    decoder_start_token_id: int = 2  # BART starts decoding from </s>
    forced_bos_token_id: int | None = None  # kept for config.json; redeqx's generate does not force tokens
    forced_eos_token_id: int | None = 2

    hf_architecture = "BartForConditionalGeneration"
    hf_type = "bart"
    hf_keys = {"layer_norm_eps": None}
    hf_required = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                   "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim")
    hf_absent = {"bos_token_id": None, "eos_token_id": None, "forced_eos_token_id": None}
    hf_fixed = {"is_encoder_decoder": True}
    positive = ("vocab_size", "max_position_embeddings", "d_model", *hf_required[2:])

    def check(self):
        for name in ("encoder_attention_heads", "decoder_attention_heads"):
            if self.d_model % getattr(self, name):
                raise ValueError(f"BartConfig: d_model={self.d_model} must be a multiple of {name}={getattr(self, name)}.")
        check_activation(self)

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.d_model) if self.scale_embedding else 1.0

    @classmethod
    def hf_in(cls, d, values, tensor_names):
        # Options of old (Transformers 3/4) BART config.json files; mBART-style models set the first two.
        for key, ok in (("normalize_before", False), ("add_final_layer_norm", False), ("normalize_embedding", True),
                        ("add_bias_logits", False), ("static_position_embeddings", False)):
            if d.get(key, ok) != ok:
                raise ValueError(f"BART config.json has {key}={d[key]!r}; redeqx supports only BART's own layout "
                                 f"({key}={ok}): post-LN blocks, layernorm_embedding, learned positions.")
        return values


class BartEncoderLayer(FairseqLayer):
    activation: str = eqx.field(static=True)

    def __init__(self, config: BartConfig, *, key: PRNGKeyArray):
        c = config
        super().__init__(c.d_model, c.encoder_attention_heads, c.encoder_ffn_dim, c.layer_norm_eps, bias=True, key=key)
        self.activation = config.activation_function

    def __call__(self, x, mask):
        return self._forward(x, mask, None, None, activation=ACTIVATIONS[self.activation], pre_norm=False)[0]


class BartDecoderLayer(Stackable):
    self_attn: Attention
    self_attn_layer_norm: LayerNorm
    encoder_attn: Attention
    encoder_attn_layer_norm: LayerNorm
    fc1: Linear
    fc2: Linear
    final_layer_norm: LayerNorm
    activation: str = eqx.field(static=True)

    def __init__(self, config: BartConfig, *, key: PRNGKeyArray):
        ks, kc, k1, k2 = jax.random.split(key, 4)
        d, h, eps = config.d_model, config.decoder_attention_heads, config.layer_norm_eps
        self.self_attn = Attention(d, h, bias=True, key=ks)
        self.self_attn_layer_norm = LayerNorm(d, eps)
        self.encoder_attn = Attention(d, h, bias=True, key=kc)
        self.encoder_attn_layer_norm = LayerNorm(d, eps)
        self.fc1 = Linear(d, config.decoder_ffn_dim, bias=True, key=k1)
        self.fc2 = Linear(config.decoder_ffn_dim, d, bias=True, key=k2)
        self.final_layer_norm = LayerNorm(d, eps)
        self.activation = config.activation_function

    def __call__(self, x, mask, source, source_mask, cache=None, index=None):
        """``source``: the encoder output, or its keys/values for
        ``encoder_attn`` projected already (a `KVCache`); ``cache``/``index``:
        the decoder's own keys/values when decoding."""
        a, cache = self.self_attn(x, mask, cache=cache, index=index)
        x = self.self_attn_layer_norm(x + a)
        kv = source if isinstance(source, KVCache) else self.encoder_attn.project_kv(source)
        x = self.encoder_attn_layer_norm(x + self.encoder_attn(x, source_mask, kv=kv)[0])
        return self.final_layer_norm(x + feed_forward(self.fc1, self.fc2, ACTIVATIONS[self.activation], x)), cache


class BartStack(eqx.Module):
    """What each of BART's stacks (`BartEncoder`, `BartDecoder`) holds: its position table, its
    layers of class ``layer`` and the LayerNorm of its embedded tokens."""

    embed_positions: Embedding  # (max_position_embeddings + 2, d_model)
    layers: list[Stackable] | Stackable  # stacked: one layer, every array (layers, ...)
    layernorm_embedding: LayerNorm

    def __init__(self, config: BartConfig, layer: type[Stackable], n_layers: int, *, key: PRNGKeyArray):
        self.embed_positions, self.layers = table_and_layers(
            config.max_position_embeddings + POSITION_OFFSET, config.d_model, lambda k: layer(config, key=k), n_layers,
            stacked=config.scan_layers, key=key)
        self.layernorm_embedding = LayerNorm(config.d_model, config.layer_norm_eps)


class BartEncoder(BartStack):
    layers: list[BartEncoderLayer] | BartEncoderLayer

    def __init__(self, config: BartConfig, *, key: PRNGKeyArray):
        super().__init__(config, BartEncoderLayer, config.encoder_layers, key=key)


class BartDecoder(BartStack):
    layers: list[BartDecoderLayer] | BartDecoderLayer

    def __init__(self, config: BartConfig, *, key: PRNGKeyArray):
        super().__init__(config, BartDecoderLayer, config.decoder_layers, key=key)


class BartModel(eqx.Module):
    shared: Embedding
    encoder: BartEncoder
    decoder: BartDecoder

    def __init__(self, config: BartConfig, *, key: PRNGKeyArray):
        ks, ke, kd = jax.random.split(key, 3)
        self.shared = Embedding(config.vocab_size, config.d_model, key=ks)
        self.encoder = BartEncoder(config, key=ke)
        self.decoder = BartDecoder(config, key=kd)


class BartForConditionalGeneration(EncoderDecoderLM):
    """BART for one sequence pair (batch with ``jax.vmap``).

    **Example** (teacher-forced training logits and generation):

    ```python
    config = BartConfig(vocab_size=256, max_position_embeddings=128, d_model=64, encoder_layers=2,
                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=128, decoder_ffn_dim=128)
    model = BartForConditionalGeneration(config, key=jax.random.key(0))
    decoder_inputs = redeqx.models.shift_right(labels, config)
    logits = jax.vmap(model)(inputs, decoder_inputs)   # (batch, tgt_len, vocab)
    tokens = redeqx.models.generate(model, inputs, attention_mask=mask, max_new_tokens=32, eos_token_id=2)
    ```

    The encoder reads ``input_ids`` (padding on the right, ``False`` in
    ``attention_mask``); ``decoder_input_ids`` are the labels shifted right
    behind ``config.decoder_start_token_id`` (`shift_right`).
    `redeqx.models.generate` and `beam_search` encode the input once and
    decode from the start token, returning the new tokens.
    """

    model: BartModel
    final_logits_bias: Float[Array, " vocab"]
    lm_head: Linear | None
    config: BartConfig = eqx.field(static=True)

    # Copies of `shared` that checkpoints carry, and fairseq's version counters.
    hf_ignore = (r"model\.(encoder|decoder)\.embed_tokens\.weight", r"model\.(encoder|decoder)\.version",
                 r"lm_head\.weight")
    hf_stacks = ("model.encoder.layers", "model.decoder.layers")

    def __init__(self, config: BartConfig, *, key: PRNGKeyArray):
        if not isinstance(config, BartConfig):
            raise TypeError(f"config must be a redeqx.models.BartConfig, got {type(config).__name__}.")
        km, kh = jax.random.split(key)
        self.model = BartModel(config, key=km)
        self.final_logits_bias = jnp.zeros((config.vocab_size,))
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.d_model, config.vocab_size, bias=False, key=kh
        )
        self.config = config

    def _check_positions(self, where: str, n: int) -> None:
        check_positions(f"BartForConditionalGeneration.{where}", n, self.config.max_position_embeddings,
                        "max_position_embeddings")

    def _embed(self, ids, positions, stack):
        x = constrain(self.model.shared(ids), P())  # vocab-split lookup: one all-reduce
        x = x * jnp.asarray(self.config.embed_scale, x.dtype) + stack.embed_positions(positions + POSITION_OFFSET)
        return stack.layernorm_embedding(x)

    def encode(
        self, input_ids: Int[Array, " src"], attention_mask: Bool[Array, " src"] | None = None
    ) -> Float[Array, "src d_model"]:
        """The encoder output. ``attention_mask`` is ``False`` on padding,
        which no position attends to."""
        refuse_split(self)
        s = input_ids.shape[0]
        self._check_positions("encode", s)
        valid = jnp.ones((s,), bool) if attention_mask is None else attention_mask.astype(bool)
        x = self._embed(input_ids, jnp.arange(s), self.model.encoder)
        mask = jnp.broadcast_to(valid[None, :], (s, s))
        x, _ = run_layers(self.model.encoder.layers, x, None, lambda layer, x, _: (layer(x, mask), None),
                          unroll=self.config.scan_unroll)
        return x

    def _logits(self, x):
        logits = lm_logits(self.model.shared, self.lm_head, x)
        bias = jax.lax.stop_gradient(self.final_logits_bias).astype(logits.dtype)  # a buffer, as in Transformers
        return constrain(logits + bias[None, :], P(None, P.UNCONSTRAINED))  # vocab: the head's layout

    def _teacher_forced(self, decoder_input_ids, source, valid):
        t = decoder_input_ids.shape[0]
        x = self._embed(decoder_input_ids, jnp.arange(t), self.model.decoder)
        mask = causal_mask(jnp.ones((t,), bool), 0, t)
        source_mask = jnp.broadcast_to(valid[None, :], (t, valid.shape[0]))
        x, _ = run_layers(self.model.decoder.layers, x, None,
                          lambda layer, x, _: layer(x, mask, source, source_mask),
                          unroll=self.config.scan_unroll)
        return self._logits(x)

    # -- cached decoding (EncoderDecoderLM)

    def _decoder_layers(self):
        return self.model.decoder.layers

    def _self_attention_shape(self):
        c = self.config
        return c.decoder_attention_heads, c.d_model // c.decoder_attention_heads

    def _cross_kv(self, layer, source):
        return layer.encoder_attn.project_kv(source)

    def _decode(self, decoder_input_ids, cache):
        t = decoder_input_ids.shape[0]
        x = self._embed(decoder_input_ids, cache.index + jnp.arange(t), self.model.decoder)
        mask = causal_mask(jnp.arange(cache_slots(cache)) < cache.index + t, cache.index, t)
        source_mask = jnp.broadcast_to(cache.source_valid[None, :], (t, cache.source_valid.shape[0]))

        def step(layer, x, caches):
            self_cache, cross = caches
            return layer(x, mask, cross, source_mask, self_cache, cache.index)

        caches = layer_caches(self.model.decoder.layers, cache.self_attention, cache.cross_attention)
        x, self_attention = run_layers(self.model.decoder.layers, x, caches, step, unroll=self.config.scan_unroll)
        return self._logits(x), self_attention

    def hf_tensors(self) -> list[HFTensor]:
        """Checkpoint tensors: each leaf under its own path, but
        ``final_logits_bias`` is stored ``(1, vocab)``."""
        out = []
        for t in leaf_tensors(self):
            if t.name == "final_logits_bias":
                t = HFTensor(t.name, t.paths, split=lambda a: (a.reshape(-1),), join=lambda b: b.reshape(1, -1))
            out.append(t)
        return out

