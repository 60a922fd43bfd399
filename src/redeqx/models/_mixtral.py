"""Mixtral: a Mistral decoder whose feed-forward block is a mixture of SwiGLU
experts, each token sent to its ``num_experts_per_tok`` best (weights
renormalised over them), by `redeqx.models.MoE`'s dropless grouped matmuls.

Attribute paths are Hugging Face's tensor names (``model.layers.0.self_attn.q_proj.weight``,
``model.layers.0.block_sparse_moe.gate.weight``) but for the experts, held as
stacks ``block_sparse_moe.experts.gate_proj`` ``(E, intermediate, hidden)``
(``w1`` of every expert), ``up_proj`` (``w3``) and ``down_proj`` ``(E, hidden,
intermediate)`` (``w2``): `redeqx.sharding_rules` puts each stack's experts on
``model`` when ``n_model_shards`` divides their count and keeps the router whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jaxtyping import PRNGKeyArray

from ._config import DecoderConfig
from ._llama import LlamaModel
from ._moe import MoE
from ._moe_lm import LlamaFields, MoECausalLM, MoEDecoderLayer


@dataclasses.dataclass(frozen=True)
class MixtralConfig(LlamaFields, DecoderConfig):
    """Sizes and options of a Mixtral model; names follow Hugging Face's ``config.json``.

    ``intermediate_size`` is each expert's; ``router_aux_loss_coef`` weighs the
    load-balancing loss (`redeqx.models.RouterStats.load_balancing_loss`) that
    a training loss adds (Transformers adds it when given labels).
    ``router_jitter_noise`` (training noise on the router's input) is not
    applied."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None  # attention span of every layer; None: the whole sequence
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = None
    model_type: str = "mixtral"

    hf_architecture = "MixtralForCausalLM"
    hf_type = "mixtral"
    hf_required = ("intermediate_size", "num_local_experts", "num_experts_per_tok")
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_local_experts", "num_experts_per_tok")
    experts_field = "num_local_experts"


class MixtralDecoderLayer(MoEDecoderLayer):
    block_sparse_moe: MoE

    def __init__(self, config: MixtralConfig, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        super().__init__(config, key=ka)
        c = config
        self.block_sparse_moe = MoE(c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                                    key=km)

    @property
    def feed_forward(self) -> MoE:
        return self.block_sparse_moe


class MixtralModel(LlamaModel):
    layers: list[MixtralDecoderLayer] | MixtralDecoderLayer  # stacked: one layer, every array (layers, ...)

    def __init__(self, config: MixtralConfig, *, key: PRNGKeyArray):
        super().__init__(config, key=key, layer=MixtralDecoderLayer)


class MixtralForCausalLM(MoECausalLM):
    """A Mixtral causal LM for one sequence (batch with ``jax.vmap``); ``with_aux``
    also returns the routers' statistics for the load-balancing loss.

    **Example:**

    ```python
    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    model = MixtralForCausalLM(config, key=jax.random.key(0))
    logits = jax.vmap(model)(tokens)                       # (batch, seq) -> (batch, seq, vocab)
    logits, stats = jax.vmap(model.with_aux)(tokens)       # and the routers' statistics
    aux = config.router_aux_loss_coef * stats.load_balancing_loss()
    ```
    """

    model_class, config_class = MixtralModel, MixtralConfig
    hf_experts = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
