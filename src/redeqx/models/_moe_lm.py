"""What the mixture-of-experts decoder families (Mixtral, Qwen3-MoE) share
beyond a LLaMA: decoder layers that also return their routers' `RouterStats`,
the forward that returns them as the model's auxiliary output (`MoECausalLM.with_aux`),
and checkpoint names for expert stacks (each expert's weight is one tensor of a
Hugging Face checkpoint, one slice of an ``(experts, ...)`` stack here)."""

from __future__ import annotations

import re
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..mesh import constrain
from ..mesh import CONTEXT
from .._trees import is_array_like, named_leaves
from ._layers import (
    Cache, CausalLM, Linear, RMSNorm, Stackable, check_config, is_stacked, lm_logits, model_and_head, run_layers,
)
from ._config import DecoderConfig
from ._llama import LlamaAttention, LlamaConfig, rope_frequencies
from ._moe import MoE, RouterStats
from ._safetensors import HFTensor

# The fields a mixture-of-experts family shares with LlamaConfig, read and written alike.
LLAMA_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
                "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id")


def llama_fields(d: dict) -> dict:
    """The LLaMA fields of a Hugging Face ``config.json`` dict, parsed as `LlamaConfig.from_hf` does
    (RoPE in the Transformers 4 or 5 layout, token ids)."""
    c = LlamaConfig.from_hf({**d, "model_type": "llama", "intermediate_size": d.get("intermediate_size") or 1})
    return {f: getattr(c, f) for f in LLAMA_FIELDS}


def attention_config(config) -> LlamaConfig:
    """The `LlamaConfig` that LLaMA's attention and RoPE read, from a family config with `LLAMA_FIELDS`."""
    window = config.sliding_window
    return LlamaConfig(**{f: getattr(config, f) for f in LLAMA_FIELDS}, intermediate_size=1, model_type="mistral",
                       sliding_window=window, use_sliding_window=window is not None, scan_layers=False)


class LlamaFields:
    """A mixture-of-experts family config's `LLAMA_FIELDS` read from and written to ``config.json`` as `LlamaConfig`
    does (RoPE, token ids, heads) and checked by LLaMA's checks; the family's own table reads and
    writes the rest (``attention_bias`` with them, which Mistral's ``config.json`` has no place for)."""

    hf_keys: ClassVar[dict] = dict.fromkeys(f for f in LLAMA_FIELDS if f != "attention_bias")
    experts_field: ClassVar[str]  # the family's name for its number of experts

    @property
    def n_experts(self) -> int:
        return getattr(self, self.experts_field)

    def check(self):
        """Each token's experts are among the layer's, ``model_type`` is the family's, and LLaMA's
        checks of heads, head_dim and window hold."""
        name, n, field = type(self).__name__, self.n_experts, self.experts_field
        if self.num_experts_per_tok > n:
            raise ValueError(f"{name}: num_experts_per_tok={self.num_experts_per_tok} exceeds {field}={n}; "
                             f"pass num_experts_per_tok <= {field}.")
        if self.model_type != self.hf_type:
            raise ValueError(f"{name}.model_type must be {self.hf_type!r}, got {self.model_type!r}.")
        attention_config(self)

    @classmethod
    def hf_in(cls, d, values, tensor_names):
        return {**values, **llama_fields(d)}

    def hf_out(self, d):
        return {**attention_config(self).to_hf(), **d}


def sparse_block(x, block, valid, *, joined: bool = True):
    """A layer's feed-forward block: a `MoE` gives its output and stats; a dense MLP (``joined``: its
    gate and up products as one, `LlamaMLP`), zero stats."""
    if isinstance(block, MoE):
        y, stats = block(x, valid=valid)
        return constrain(y, P(CONTEXT)), stats
    return block(x, joined=joined), None


class MoEDecoderLayer(Stackable):
    """LLaMA's decoder layer whose feed-forward block (a subclass's ``feed_forward``) may be a
    `MoE`: it returns its router's `RouterStats` too (None for a dense block). It holds the
    attention (of class ``attention_class``) and both norms; a subclass adds its feed-forward
    block under the family's Hugging Face name."""

    self_attn: LlamaAttention
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    attention_class: ClassVar[type] = LlamaAttention

    def __init__(self, config, *, key: PRNGKeyArray):
        """The attention, from ``key``, and the norms of a config with `LLAMA_FIELDS`."""
        self.self_attn = self.attention_class(attention_config(config), key=key)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def feed_forward(self):
        raise NotImplementedError

    def __call__(self, x, positions, mask, inv_freq, cache, index, valid):
        a, cache = self.self_attn(self.input_layernorm(x), positions, mask, inv_freq, cache, index)
        x = x + a
        y, stats = sparse_block(self.post_attention_layernorm(x), self.feed_forward, valid, joined=cache is None)
        return x + y, cache, stats


class MoECausalLM(CausalLM):
    """A decoder-only LM whose layers return ``(x, cache, stats)``; subclasses
    hold ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``
    and a ``config`` with ``n_experts``, and name their model and config classes."""

    model: eqx.Module  # a `model_class`: embed_tokens, layers, norm
    lm_head: Linear | None  # None: tied to the embedding
    config: DecoderConfig = eqx.field(static=True)

    model_class: ClassVar[type]  # built from the config
    config_class: ClassVar[type]

    def __init__(self, config, *, key: PRNGKeyArray):
        check_config(config, self.config_class)
        self.model, self.lm_head = model_and_head(self.model_class, config, config.hidden_size, key=key)
        self.config = config

    def _run_aux(self, ids, positions, mask, cache: Cache | None, valid):
        c = self.config
        inv_freq = rope_frequencies(attention_config(c))
        x = constrain(self.model.embed_tokens(ids), P(CONTEXT))
        index = None if cache is None else cache.index
        empty = RouterStats.zeros(c.n_experts)

        def step(layer, x, lc):
            x, lc, stats = layer(x, positions, mask, inv_freq, lc, index, valid)
            return x, (lc, empty if stats is None else stats)

        layers = self.model.layers
        x, out = run_layers(layers, x, None if cache is None else cache.layers, step, unroll=c.scan_unroll)
        if is_stacked(layers):
            new_layers, stats = out
            stats = jax.tree.map(lambda a: jnp.sum(a, axis=0), stats)  # over the layers
        else:
            new_layers = [lc for lc, _ in out]
            stats = sum((s for _, s in out), empty)
        logits = lm_logits(self.model.embed_tokens, self.lm_head, self.model.norm(x))
        return constrain(logits, P(CONTEXT, P.UNCONSTRAINED)), new_layers, stats  # vocab: the head's layout

    def _run(self, ids, positions, mask, cache):
        logits, new_layers, _ = self._run_aux(ids, positions, mask, cache, None)
        return logits, new_layers

    def _window(self):
        return self.config.sliding_window

    def _kv_shape(self):
        a = attention_config(self.config)
        return a.num_hidden_layers, a.n_kv_heads, a.dim_head

    def with_aux(
        self,
        input_ids: Int[Array, " seq"],
        *,
        attention_mask: Bool[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "seq vocab"], RouterStats]:
        """The logits (as ``__call__``) and the auxiliary output: the routers'
        `RouterStats` summed over every mixture-of-experts layer, padding
        (``attention_mask`` False) not counted. Under ``jax.vmap`` the stats
        gain the batch axis; their losses combine the whole batch:

        ```python
        logits, stats = jax.vmap(model.with_aux)(input_ids)
        loss = redeqx.models.cross_entropy(logits, labels) + model.config.router_aux_loss_coef * stats.load_balancing_loss()
        ```
        """
        del key
        positions, mask, valid = self._inputs(input_ids.shape[0], attention_mask)  # as __call__, split or not
        logits, _, stats = self._run_aux(input_ids, positions, mask, None, valid)
        return logits, stats

    # Checkpoint tensors that carry nothing new: a tied head saved anyway, old rotary buffers.
    hf_ignore = (r"lm_head\.weight", r".*rotary_emb\.inv_freq")
    hf_stacks = ("model.layers",)  # the layer lists, stacked when config.scan_layers
    hf_experts: ClassVar[dict[str, str]] = {}  # the stacks' field names -> each expert's tensor name

    def hf_tensors(self) -> list[HFTensor]:
        """Checkpoint tensors of the listed-layer model: each leaf under its
        own path, but an expert stack ``<block>.experts.<field>`` ``(E, ...)``
        as ``E`` tensors ``<block>.experts.<e>.<name>.weight``, one per expert."""
        out = []
        for path, x in named_leaves(self):
            if not is_array_like(x):
                continue
            m = re.fullmatch(r"(.*\.experts)\.(\w+)", path)
            if m and m.group(2) in self.hf_experts:
                name = self.hf_experts[m.group(2)]
                out += [HFTensor(f"{m.group(1)}.{e}.{name}.weight", (path,), index=(e,)) for e in range(x.shape[0])]
            else:
                out.append(HFTensor(path, (path,)))
        return out
