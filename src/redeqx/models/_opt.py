"""OPT (Meta's Open Pre-trained Transformers, 125M to 175B): learned
positions, LayerNorm before each block (after it in OPT-350m), ReLU, biases
on every projection, the LM head tied to the token embedding.

Attribute paths are the Hugging Face tensor names
(``model.decoder.layers.0.self_attn.q_proj.weight``, ``...fc1.weight``), so
`redeqx.sharding_rules` gives the Megatron-LM plan with no overrides: Q/K/V
and ``fc1`` split on output features, ``out_proj`` and ``fc2`` on input
features, ``embed_tokens`` on the vocabulary, ``embed_positions`` (a learned
position table) replicated.

OPT details:

- the position table has ``max_position_embeddings + 2`` rows and position
  ``p`` reads row ``p + 2`` (fairseq kept two rows for padding);
- positions count real tokens only, so a left-padded prompt starts at 0;
- OPT-350m embeds tokens in ``word_embed_proj_dim`` (512) and projects in
  and out of the 1024-wide blocks (``project_in``, ``project_out``, no bias),
  and puts its LayerNorms after each block, with no final one.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import PRNGKeyArray

from ..mesh import constrain
from ..mesh import CONTEXT
from ._layers import (
    ACTIVATIONS,
    Cache,
    CausalLM,
    Embedding,
    FairseqLayer,
    POSITION_OFFSET,
    LayerNorm,
    Linear,
    build_layers,
    check_config,
    check_positive_ints,
    default_head_dim,
    lm_logits,
    model_and_head,
)
from ._config import DecoderConfig, check_activation
from ._safetensors import HFTensor, leaf_tensors

@dataclasses.dataclass(frozen=True)
class OPTConfig(DecoderConfig):
    """Sizes and options of an OPT model; names follow Hugging Face's ``config.json``.

    The defaults are OPT-125m. OPT-13B is ``hidden_size=5120, num_hidden_layers=40,
    num_attention_heads=40, ffn_dim=20480``; OPT-66B ``9216, 64, 72, 36864``."""

    vocab_size: int = 50272
    hidden_size: int = 768
    num_hidden_layers: int = 12
    ffn_dim: int = 3072
    num_attention_heads: int = 12
    max_position_embeddings: int = 2048
    do_layer_norm_before: bool = True  # False: post-LN blocks, as in OPT-350m
    word_embed_proj_dim: int | None = None  # None: hidden_size (no projection)
    remove_final_layer_norm: bool = False  # Hugging Face's `_remove_final_layer_norm` (old fine-tunes)
    activation_function: str = "relu"
    enable_bias: bool = True  # bias on the attention and MLP projections
    tie_word_embeddings: bool = True  # every released OPT ties its LM head to embed_tokens
    layer_norm_eps: float = 1e-5  # torch.nn.LayerNorm's default, which OPT uses
    pad_token_id: int | None = 1
    bos_token_id: int | None = 2
    eos_token_id: int | None = 2
    hf_prefix: str = "model."  # prefix of the checkpoint's tensor names ("" in the hub's OPTModel files)

    hf_architecture = "OPTForCausalLM"
    hf_type = "opt"
    hf_keys = {"remove_final_layer_norm": "_remove_final_layer_norm", "hf_prefix": None, "layer_norm_eps": None}
    hf_required = ("vocab_size", "hidden_size", "num_hidden_layers", "ffn_dim", "num_attention_heads")
    hf_absent = {"pad_token_id": None, "bos_token_id": None}
    hf_fixed = {"layer_norm_elementwise_affine": True}
    positive = ("vocab_size", "hidden_size", "num_hidden_layers", "ffn_dim", "num_attention_heads",
                "max_position_embeddings")

    def check(self):
        default_head_dim(self.hidden_size, self.num_attention_heads)
        if self.word_embed_proj_dim is not None:
            check_positive_ints(self, ("word_embed_proj_dim",))
        check_activation(self)
        if self.hf_prefix not in ("model.", ""):
            raise ValueError(f"OPTConfig.hf_prefix must be 'model.' or '', got {self.hf_prefix!r}.")

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding (and of the tied LM head)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def projected(self) -> bool:
        return self.embed_dim != self.hidden_size

    @property
    def final_norm(self) -> bool:
        return self.do_layer_norm_before and not self.remove_final_layer_norm

    @classmethod
    def hf_in(cls, d, values, tensor_names):
        """The hub's OPT files were saved from ``OPTModel`` and name their tensors ``decoder.*``,
        files saved from ``OPTForCausalLM`` ``model.decoder.*``."""
        if not d.get("layer_norm_elementwise_affine", True):
            raise ValueError(
                "OPT config.json has layer_norm_elementwise_affine=false (LayerNorms without weights); "
                "redeqx supports only OPT with affine LayerNorms."
            )
        if tensor_names is not None and "model.decoder.embed_tokens.weight" not in tensor_names \
                and "decoder.embed_tokens.weight" in tensor_names:
            values["hf_prefix"] = ""
        return values

    def hf_out(self, d):
        return {**d, "word_embed_proj_dim": self.embed_dim}


class OPTDecoderLayer(FairseqLayer):
    config: OPTConfig = eqx.field(static=True)

    def __init__(self, config: OPTConfig, *, key: PRNGKeyArray):
        c = config
        super().__init__(c.hidden_size, c.num_attention_heads, c.ffn_dim, c.layer_norm_eps, bias=c.enable_bias, key=key)
        self.config = config

    def __call__(self, x, mask, cache, index):
        activation = ACTIVATIONS[self.config.activation_function]
        return self._forward(x, mask, cache, index, activation=activation, pre_norm=self.config.do_layer_norm_before)


class OPTDecoder(eqx.Module):
    embed_tokens: Embedding
    embed_positions: Embedding  # (max_position_embeddings + 2, hidden)
    project_in: Linear | None
    project_out: Linear | None
    final_layer_norm: LayerNorm | None
    layers: list[OPTDecoderLayer] | OPTDecoderLayer  # stacked: one layer, every array (layers, ...)

    def __init__(self, config: OPTConfig, *, key: PRNGKeyArray):
        keys = jax.random.split(key, config.num_hidden_layers + 4)
        ke, kp, ki, ko = keys[:4]
        c = config
        self.embed_tokens = Embedding(c.vocab_size, c.embed_dim, key=ke)
        self.embed_positions = Embedding(c.max_position_embeddings + POSITION_OFFSET, c.hidden_size, key=kp)
        self.project_in = Linear(c.embed_dim, c.hidden_size, bias=False, key=ki) if c.projected else None
        self.project_out = Linear(c.hidden_size, c.embed_dim, bias=False, key=ko) if c.projected else None
        self.final_layer_norm = LayerNorm(c.hidden_size, c.layer_norm_eps) if c.final_norm else None
        self.layers = build_layers(lambda k: OPTDecoderLayer(c, key=k), keys[4:], stacked=c.scan_layers)


class OPTModel(eqx.Module):
    decoder: OPTDecoder

    def __init__(self, config: OPTConfig, *, key: PRNGKeyArray):
        self.decoder = OPTDecoder(config, key=key)


class OPTForCausalLM(CausalLM):
    """OPT for one sequence (batch with ``jax.vmap``); the LM head is the
    token embedding (tied), as in every released OPT.

    **Example:**

    ```python
    config = OPTConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                       num_attention_heads=4, max_position_embeddings=128)
    model = OPTForCausalLM(config, key=jax.random.key(0))
    logits = jax.vmap(model)(tokens)              # (batch, seq) -> (batch, seq, vocab)
    new = redeqx.models.generate(model, tokens, max_new_tokens=16)
    ```
    """

    model: OPTModel
    lm_head: Linear | None
    config: OPTConfig = eqx.field(static=True)

    # A tied head saved anyway.
    hf_ignore = (r"lm_head\.weight",)
    hf_stacks = ("model.decoder.layers",)

    def __init__(self, config: OPTConfig, *, key: PRNGKeyArray):
        check_config(config, OPTConfig)
        self.model, self.lm_head = model_and_head(OPTModel, config, config.embed_dim, key=key)
        self.config = config

    def _kv_shape(self):
        c = self.config
        return c.num_hidden_layers, c.num_attention_heads, default_head_dim(c.hidden_size, c.num_attention_heads)

    def _max_positions(self):
        return self.config.max_position_embeddings, "max_position_embeddings"

    def _run(self, ids, positions, mask, cache: Cache | None):
        d = self.model.decoder
        x = constrain(d.embed_tokens(ids), P(CONTEXT))  # vocab-split lookup: one all-reduce
        if d.project_in is not None:
            x = d.project_in(x)
        x = constrain(x + d.embed_positions(positions + POSITION_OFFSET), P(CONTEXT))
        x, new_layers = self._through_layers(d.layers, x, cache, mask)
        if d.final_layer_norm is not None:
            x = d.final_layer_norm(x)
        if d.project_out is not None:
            x = d.project_out(x)
        logits = lm_logits(d.embed_tokens, self.lm_head, x)
        return constrain(logits, P(CONTEXT, P.UNCONSTRAINED)), new_layers  # vocab: the head's layout

    def hf_tensors(self) -> list[HFTensor]:
        """Checkpoint tensors: each leaf under its own path, the ``model.``
        prefix dropped for checkpoints saved without it (the hub's OPTModel files)."""
        prefix = self.config.hf_prefix
        return leaf_tensors(self, lambda path: prefix + path[len("model."):] if path.startswith("model.") else path)
