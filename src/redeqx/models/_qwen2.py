"""Qwen2 (and Qwen2.5): LLaMA's blocks with biases on the query, key and value
projections (none on the output projection), an optional tied head, and an
optional sliding window.

Transformers slides the window in the layers from ``max_window_layers`` on
when ``use_sliding_window`` is set. redeqx runs one attention span in every
layer: a config whose layers all slide, or none (every released Qwen2 and
Qwen2.5 checkpoint), loads; one that mixes the two is refused.

Attribute paths are the Hugging Face tensor names, as in
`redeqx.models.LlamaForCausalLM`, so `redeqx.sharding_rules` gives the
Megatron-LM plan with no overrides.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
from jaxtyping import PRNGKeyArray

from ._config import DecoderConfig
from ._layers import check_config, model_and_head
from ._llama import LlamaConfig, LlamaForCausalLM, LlamaModel, rope_from_hf, rope_to_hf


@dataclasses.dataclass(frozen=True)
class Qwen2Config(DecoderConfig):
    """Sizes and options of a Qwen2 model; names follow Hugging Face's ``config.json``,
    and so do the defaults (Transformers' ``Qwen2Config``).

    ``sliding_window`` is the attention span of the layers from ``max_window_layers``
    on when ``use_sliding_window``; every layer or none must slide."""

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as query heads (no GQA)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # as LlamaConfig's
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False  # Qwen2-0.5B/1.5B and Qwen2.5 up to 3B tie
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    hf_architecture = "Qwen2ForCausalLM"
    hf_type = "qwen2"
    hf_keys = {"rope_theta": None, "rope_scaling": None}
    hf_required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    hf_fixed = {"hidden_act": "silu"}
    positive = hf_required

    def check(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"Qwen2Config: hidden_size={self.hidden_size} must be a multiple of "
                             f"num_attention_heads={self.num_attention_heads}.")
        if len(set(self.sliding_layers)) > 1:
            raise ValueError(
                f"Qwen2Config: use_sliding_window=True with max_window_layers={self.max_window_layers} slides the "
                f"window in layers {self.max_window_layers} to {self.num_hidden_layers - 1} only, and redeqx runs "
                "one attention span in every layer; pass max_window_layers=0 (every layer slides) or "
                "use_sliding_window=False (none does, as Transformers for sequences within sliding_window tokens)."
            )
        self.llama()  # LLaMA's checks of heads, RoPE and window

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Whether each layer attends within ``sliding_window`` (Transformers' rule)."""
        slides = self.use_sliding_window and self.sliding_window is not None
        return tuple(slides and i >= self.max_window_layers for i in range(self.num_hidden_layers))

    def llama(self) -> LlamaConfig:
        """The `LlamaConfig` of the same model, which LLaMA's blocks read."""
        window = all(self.sliding_layers)
        same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "scan_layers", "scan_unroll",
                "context_attention")
        return LlamaConfig(**{f: getattr(self, f) for f in same}, qkv_bias=True, model_type="qwen2",
                           sliding_window=self.sliding_window if window else None, use_sliding_window=window)

    @classmethod
    def hf_in(cls, d, values, tensor_names):
        values = {**values, **rope_from_hf(d)}
        types = d.get("layer_types")
        if types is not None and tuple(t == "sliding_attention" for t in types) != cls(**values).sliding_layers:
            raise ValueError(f"layer_types={types} is not Transformers' rule for use_sliding_window="
                             f"{values.get('use_sliding_window')} and max_window_layers={values.get('max_window_layers')}")
        return values

    def hf_out(self, d):
        d.update(rope_to_hf(self.llama()))
        del d["head_dim"]  # Qwen2's is hidden_size // num_attention_heads, always
        d["layer_types"] = ["sliding_attention" if s else "full_attention" for s in self.sliding_layers]
        return d


class Qwen2ForCausalLM(LlamaForCausalLM):
    """A Qwen2 causal LM for one sequence (batch with ``jax.vmap``): `LlamaForCausalLM`'s
    blocks, built from a `Qwen2Config`.

    **Example:**

    ```python
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config, key=jax.random.key(0))
    logits = jax.vmap(model)(tokens)              # (batch, seq) -> (batch, seq, vocab)
    ```
    """

    config: Qwen2Config = eqx.field(static=True)

    def __init__(self, config: Qwen2Config, *, key: PRNGKeyArray):
        check_config(config, Qwen2Config)
        self.model, self.lm_head = model_and_head(LlamaModel, config.llama(), config.hidden_size, key=key)
        self.config = config

    @property
    def llama_config(self) -> LlamaConfig:
        return self.config.llama()
