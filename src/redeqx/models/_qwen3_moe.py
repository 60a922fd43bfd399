"""Qwen3-MoE: a LLaMA-style decoder with RMS-normed queries and keys (per head,
before RoPE) whose feed-forward blocks are mixtures of SwiGLU experts
(`redeqx.models.MoE`), in every ``decoder_sparse_step``-th layer not listed in
``mlp_only_layers`` (the others keep a dense SwiGLU MLP); the top-k weights are
renormalised when ``norm_topk_prob``.

Attribute paths are Hugging Face's tensor names, but for the experts, held as
stacks ``mlp.experts.gate_proj``/``up_proj`` ``(E, moe_intermediate, hidden)``
and ``down_proj`` ``(E, hidden, moe_intermediate)`` beside the router
``mlp.gate``: `redeqx.sharding_rules` puts the experts on ``model`` when
``n_model_shards`` divides their count and keeps the router whole. A model
mixing dense and sparse layers has layers of two shapes, which one stack
cannot hold: it lists its layers (``scan_layers=False``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jaxtyping import PRNGKeyArray

from ._config import DecoderConfig
from ._layers import SCAN_LAYERS, KVCache, RMSNorm, attend_and_project
from ._llama import LlamaAttention, LlamaConfig, LlamaMLP, LlamaModel, apply_rope
from ._moe import MoE
from ._moe_lm import LlamaFields, MoECausalLM, MoEDecoderLayer, attention_config


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(LlamaFields, DecoderConfig):
    """Sizes and options of a Qwen3-MoE model; names follow Hugging Face's ``config.json``.

    ``moe_intermediate_size`` is each expert's, ``intermediate_size`` the dense
    MLP's (layers in ``mlp_only_layers``, or off the ``decoder_sparse_step``).
    ``router_aux_loss_coef`` weighs the load-balancing loss
    (`redeqx.models.RouterStats.load_balancing_loss`). ``sliding_window``: the
    attention span of every layer (None: the whole sequence; Transformers'
    ``use_sliding_window``). ``scan_layers`` must be False when the layers mix
    dense and sparse blocks."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 4
    head_dim: int | None = 128
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    model_type: str = "qwen3_moe"

    hf_architecture = "Qwen3MoeForCausalLM"
    hf_type = "qwen3_moe"
    hf_keys = {**LlamaFields.hf_keys, "sliding_window": None}
    hf_required = ("intermediate_size", "moe_intermediate_size", "num_experts_per_tok")
    hf_absent = {"norm_topk_prob": False}
    positive = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_experts", "num_experts_per_tok", "decoder_sparse_step")

    experts_field = "num_experts"

    def check(self):
        if self.scan_layers and len(set(self.sparse_layers)) > 1:
            raise ValueError(
                f"Qwen3MoeConfig: layers {[i for i, s in enumerate(self.sparse_layers) if not s]} are dense "
                f"(mlp_only_layers={self.mlp_only_layers}, decoder_sparse_step={self.decoder_sparse_step}) and the "
                "others sparse, which one stack of layers cannot hold; pass scan_layers=False (a list of layers)."
            )
        super().check()  # the experts, model_type, and LLaMA's checks

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Whether each layer's feed-forward block is a mixture of experts (Transformers' rule)."""
        return tuple(i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                     for i in range(self.num_hidden_layers))

    @classmethod
    def hf_in(cls, d, values, tensor_names):
        """Transformers 5 says ``num_local_experts``, 4 ``num_experts``; a model mixing dense and
        sparse layers gets ``scan_layers=False``."""
        values = {**super().hf_in(d, values, tensor_names), "num_experts": d.get("num_experts", d.get("num_local_experts")),
                  "mlp_only_layers": tuple(d.get("mlp_only_layers") or ()),
                  "sliding_window": d.get("sliding_window") if d.get("use_sliding_window") else None}
        mixed = len(set(cls(**values, scan_layers=False).sparse_layers)) > 1
        return {**values, "scan_layers": SCAN_LAYERS and not mixed}

    def hf_out(self, d):
        """``num_experts``: the name Transformers 4 reads and 5 maps to its ``num_local_experts``."""
        return {**super().hf_out(d), "use_sliding_window": self.sliding_window is not None,
                "sliding_window": self.sliding_window}


class Qwen3MoeAttention(LlamaAttention):
    """LLaMA's attention with ``q_norm``/``k_norm``: each head's query and key RMS-normed before RoPE
    (its config, `attention_config`'s, puts ``attention_bias`` on all four projections)."""

    q_norm: RMSNorm
    k_norm: RMSNorm

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray):
        super().__init__(config, key=key)
        self.q_norm = RMSNorm(config.dim_head, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.dim_head, config.rms_norm_eps)

    def __call__(self, x, positions, mask, inv_freq, cache: KVCache | None, index):
        q, k, v = self._heads(x, joined=cache is None)
        q, k = apply_rope(self.q_norm(q), positions, inv_freq), apply_rope(self.k_norm(k), positions, inv_freq)
        return attend_and_project(self.o_proj, q, k, v, mask, cache, index)


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    mlp: MoE | LlamaMLP

    attention_class = Qwen3MoeAttention

    def __init__(self, config: Qwen3MoeConfig, sparse: bool, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        super().__init__(config, key=ka)
        c = config
        if sparse:
            self.mlp = MoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                           normalize_top_k=c.norm_topk_prob, key=km)
        else:
            dense = dataclasses.replace(attention_config(c), intermediate_size=c.intermediate_size)
            self.mlp = LlamaMLP(dense, key=km)

    @property
    def feed_forward(self) -> MoE | LlamaMLP:
        return self.mlp


class Qwen3MoeModel(LlamaModel):
    layers: list[Qwen3MoeDecoderLayer] | Qwen3MoeDecoderLayer  # stacked: one layer, every array (layers, ...)

    def __init__(self, config: Qwen3MoeConfig, *, key: PRNGKeyArray):
        # build_layers makes listed layers in order, and a stack from one traced call: its
        # layers are alike (checked by the config), as sparse or dense as the first.
        sparse = iter(config.sparse_layers)
        super().__init__(config, key=key, layer=lambda c, key: Qwen3MoeDecoderLayer(c, next(sparse), key=key))


class Qwen3MoeForCausalLM(MoECausalLM):
    """A Qwen3-MoE causal LM for one sequence (batch with ``jax.vmap``); ``with_aux``
    also returns the routers' statistics for the load-balancing loss.

    **Example:**

    ```python
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(config, key=jax.random.key(0))
    logits, stats = jax.vmap(model.with_aux)(tokens)       # (batch, seq) -> (batch, seq, vocab), stats
    aux = config.router_aux_loss_coef * stats.load_balancing_loss()
    ```
    """

    model_class, config_class = Qwen3MoeModel, Qwen3MoeConfig
    hf_experts = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
