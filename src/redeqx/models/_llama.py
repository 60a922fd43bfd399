"""LLaMA-family decoder (LLaMA 2/3, Mistral, Qwen2): RoPE with optional
llama3/linear scaling, RMSNorm, SwiGLU, grouped-query attention, optional
attention biases, tied or untied embeddings.

Attribute paths are the Hugging Face tensor names
(``model.layers.0.self_attn.q_proj.weight``), so checkpoints load by name and
`redeqx.sharding_rules` gives the Megatron-LM plan with no overrides: Q/K/V,
gate and up split on output features, ``o_proj`` and ``down_proj`` on input
features, embeddings and ``lm_head`` on the vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..mesh import constrain
from ..mesh import CONTEXT
from ._layers import (
    Stackable,
    Cache,
    CausalLM,
    Embedding,
    KVCache,
    Linear,
    RMSNorm,
    attend_and_project,
    check_config,
    default_head_dim,
    heads,
    joined_linears,
    lm_logits,
    model_and_head,
    table_and_layers,
)
from ._config import DecoderConfig

_MODEL_TYPES = ("llama", "mistral", "qwen2")
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Sizes and options of a LLaMA-family model; names follow Hugging Face's ``config.json``.

    ``rope_scaling`` is ``None`` or a tuple of ``(key, value)`` pairs such as
    ``(("rope_type", "llama3"), ("factor", 8.0), ...)`` (a tuple, so the config
    is hashable and can be a static field)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as query heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False  # LLaMA 3.2 1B/3B and small Qwen2 tie
    attention_bias: bool = False  # bias on q, k, v and o projections (HF LlamaConfig)
    qkv_bias: bool = False  # bias on q, k, v only (Qwen2)
    mlp_bias: bool = False
    model_type: str = "llama"  # written back to config.json by save_pretrained
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = None
    sliding_window: int | None = None  # attention span when use_sliding_window (Mistral)
    use_sliding_window: bool = False

    hf_architecture = "LlamaForCausalLM"
    hf_type = "llama"
    hf_keys = dict.fromkeys(("rope_theta", "rope_scaling", "qkv_bias", "sliding_window", "use_sliding_window"))
    hf_required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    hf_absent = {"bos_token_id": None}
    hf_fixed = {"hidden_act": "silu"}
    positive = hf_required

    def check(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: num_attention_heads={self.n_heads} must be a multiple of "
                f"num_key_value_heads={self.n_kv_heads} (grouped-query attention)."
            )
        if self.dim_head % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.dim_head} must be even for rotary embeddings.")
        if self.use_sliding_window and (
            isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"LlamaConfig.use_sliding_window needs sliding_window to be a positive int, got {self.sliding_window!r}."
            )
        if self.model_type not in _MODEL_TYPES:
            raise ValueError(f"LlamaConfig.model_type must be one of {_MODEL_TYPES}, got {self.model_type!r}.")
        rope_type = dict(self.rope_scaling or ()).get("rope_type", "default")
        if rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"LlamaConfig.rope_scaling has rope_type={rope_type!r}; supported: {_ROPE_TYPES}."
            )

    @property
    def n_heads(self) -> int:
        return self.num_attention_heads

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or default_head_dim(self.hidden_size, self.num_attention_heads)

    @classmethod
    def hf_in(cls, d, values, tensor_names):
        # Mistral slides its window in every layer; Qwen2 (redeqx.models.Qwen2Config) in some
        model_type, window = d.get("model_type", "llama"), d.get("sliding_window")
        return {**values, **rope_from_hf(d), "qkv_bias": model_type == "qwen2", "sliding_window": window,
                "use_sliding_window": window is not None and model_type == "mistral"}

    def hf_out(self, d):
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        d.update(architectures=[arch[self.model_type]], **rope_to_hf(self))
        if self.model_type != "llama":  # their configs have no such options
            del d["attention_bias"], d["mlp_bias"]
        if self.model_type == "mistral":  # Mistral applies whatever window config.json names
            d["sliding_window"] = self.sliding_window if self.use_sliding_window else None
        if self.model_type == "qwen2":
            d["sliding_window"] = self.sliding_window
        return d


def rope_from_hf(d: dict) -> dict:
    """``rope_theta`` and ``rope_scaling`` of a ``config.json`` dict in the Transformers 4 or 5 layout."""
    rope = d.get("rope_parameters")
    if rope is not None:  # Transformers 5
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    else:
        theta = d.get("rope_theta", 10000.0)
        scaling = dict(d.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    return {"rope_theta": float(theta), "rope_scaling": tuple(sorted(scaling.items())) or None}


def rope_to_hf(config) -> dict:
    """The ``config.json`` keys of a config's RoPE, and its resolved heads (which LLaMA's blocks read)."""
    return {"rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default", **dict(config.rope_scaling or ())},
            "num_key_value_heads": config.n_kv_heads, "head_dim": config.dim_head}


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies ``(head_dim / 2,)`` of the rotary embedding, with
    the configured scaling. ``llama3`` divides low frequencies (wavelengths
    above ``original_max_position_embeddings / low_freq_factor``) by
    ``factor``, keeps high ones, and interpolates linearly in between."""
    d = config.dim_head
    inv = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    s = dict(config.rope_scaling or ())
    kind = s.get("rope_type", "default")
    if kind == "linear":
        inv = inv / s["factor"]
    elif kind == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)  # 0 at the low edge, 1 at the high edge
        mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = np.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv.astype(np.float32)


def apply_rope(x: Float[Array, "seq heads head_dim"], positions: Int[Array, " seq"], inv_freq) -> Float[Array, "seq heads head_dim"]:
    """Rotate the two halves of each head by ``position * inv_freq`` (the
    Hugging Face "rotate_half" layout, not interleaved pairs)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # (T, D/2)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # (T, 1, D/2)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class LlamaAttention(eqx.Module):
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    config: LlamaConfig = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        c, d = config, config.dim_head
        qkv_bias = c.attention_bias or c.qkv_bias
        self.q_proj = Linear(c.hidden_size, c.n_heads * d, bias=qkv_bias, key=kq)
        self.k_proj = Linear(c.hidden_size, c.n_kv_heads * d, bias=qkv_bias, key=kk)
        self.v_proj = Linear(c.hidden_size, c.n_kv_heads * d, bias=qkv_bias, key=kv)
        self.o_proj = Linear(c.n_heads * d, c.hidden_size, bias=c.attention_bias, key=ko)
        self.config = config

    def _heads(self, x, *, joined: bool = True):
        """The projections' heads (column parallel): Q (T, Hq, D), K and V (T, Hkv, D); ``joined``:
        the products of one shape as one (`joined_linears`: Q, K and V for as many KV heads as
        query heads, else K and V), False in a pass with a KV cache."""
        c = self.config
        q, k, v = joined_linears(x, (self.q_proj, self.k_proj, self.v_proj), joined=joined)
        return heads(q, c.n_heads), heads(k, c.n_kv_heads), heads(v, c.n_kv_heads)

    def __call__(self, x, positions, mask, inv_freq, cache: KVCache | None, index):
        q, k, v = self._heads(x, joined=cache is None)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        return attend_and_project(self.o_proj, q, k, v, mask, cache, index)


class LlamaMLP(eqx.Module):
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray):
        kg, ku, kd = jax.random.split(key, 3)
        h, i, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, i, bias=b, key=kg)
        self.up_proj = Linear(h, i, bias=b, key=ku)
        self.down_proj = Linear(i, h, bias=b, key=kd)

    def __call__(self, x: Float[Array, "seq hidden"], *, joined: bool = True) -> Float[Array, "seq hidden"]:
        """``joined``: the gate and up products as one (`joined_linears`); False in a pass with a
        KV cache, where no backward pass gains from it."""
        gate, up = joined_linears(x, (self.gate_proj, self.up_proj), joined=joined)  # column parallel
        return constrain(self.down_proj(jax.nn.silu(gate) * up), P(CONTEXT))  # row parallel: one all-reduce


class LlamaDecoderLayer(Stackable):
    self_attn: LlamaAttention
    mlp: LlamaMLP
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.self_attn = LlamaAttention(config, key=ka)
        self.mlp = LlamaMLP(config, key=km)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def __call__(self, x, positions, mask, inv_freq, cache, index):
        a, cache = self.self_attn(self.input_layernorm(x), positions, mask, inv_freq, cache, index)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x), joined=cache is None)
        return x, cache


class LlamaModel(eqx.Module):
    """The token embedding, the decoder layers and the final norm of a LLaMA-style model
    (the mixture-of-experts families' too, with their own ``layer``)."""

    embed_tokens: Embedding
    layers: list[LlamaDecoderLayer] | LlamaDecoderLayer  # stacked: one layer, every array (layers, ...)
    norm: RMSNorm

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray, layer: Callable = LlamaDecoderLayer):
        self.embed_tokens, self.layers = table_and_layers(
            config.vocab_size, config.hidden_size, lambda k: layer(config, key=k), config.num_hidden_layers,
            stacked=config.scan_layers, key=key)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """A LLaMA-family causal LM for one sequence (batch with ``jax.vmap``).

    **Example:**

    ```python
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config, key=jax.random.key(0))
    logits = jax.vmap(model)(tokens)              # (batch, seq) -> (batch, seq, vocab)
    ```
    """

    model: LlamaModel
    lm_head: Linear | None
    config: LlamaConfig = eqx.field(static=True)

    # Checkpoint tensors that carry nothing new: a tied head saved anyway, old rotary buffers.
    hf_ignore = (r"lm_head\.weight", r".*rotary_emb\.inv_freq")
    hf_stacks = ("model.layers",)  # the layer lists, stacked when config.scan_layers

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray):
        check_config(config, LlamaConfig)
        self.model, self.lm_head = model_and_head(LlamaModel, config, config.hidden_size, key=key)
        self.config = config

    @property
    def llama_config(self) -> LlamaConfig:
        """The `LlamaConfig` LLaMA's blocks read (a family built on them converts its own config)."""
        return self.config

    def _run(self, ids, positions, mask, cache: Cache | None):
        c = self.llama_config
        inv_freq = rope_frequencies(c)
        x = constrain(self.model.embed_tokens(ids), P(CONTEXT))
        x, new_layers = self._through_layers(self.model.layers, x, cache, positions, mask, inv_freq)
        logits = lm_logits(self.model.embed_tokens, self.lm_head, self.model.norm(x))
        return constrain(logits, P(CONTEXT, P.UNCONSTRAINED)), new_layers  # sequence over context; vocab: the head's

    def _window(self):
        c = self.llama_config
        return c.sliding_window if c.use_sliding_window else None

    def _kv_shape(self):
        c = self.llama_config
        return c.num_hidden_layers, c.n_kv_heads, c.dim_head
