"""GPT-J (EleutherAI's GPT-J-6B): attention and MLP side by side off one
LayerNorm, rotary embedding on part of each head, no attention biases, an
untied LM head with a bias.

Attribute paths are the Hugging Face tensor names
(``transformer.h.0.attn.q_proj.weight``, ``transformer.h.0.mlp.fc_in.weight``),
so checkpoints load by name and `redeqx.sharding_rules` gives the Megatron-LM
plan with no overrides: Q/K/V and ``fc_in`` split on output features,
``out_proj`` and ``fc_out`` on input features, ``wte`` and ``lm_head`` on the
vocabulary.

GPT-J details:

- a block computes ``x + attn(ln_1(x)) + mlp(ln_1(x))``. Both branches read
  the same input and their outputs are added, so the input gradients of
  Q/K/V and ``fc_in`` are summed before one all-reduce backward, and the
  outputs of ``out_proj`` and ``fc_out`` before one all-reduce forward (GPU
  and TPU compilers merge the all-reduces of added partial sums: one per
  block each way, where a sequential block has two);
- the rotary embedding turns the first ``rotary_dim`` features of each query
  and key head by ``position * inv_freq``, pairing features ``(0, 1), (2, 3),
  ...`` (GPT-J's interleaved "rotate_every_two" layout, not LLaMA's halves);
  the rest of each head passes through.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..mesh import constrain
from ..mesh import CONTEXT, MODEL
from ._layers import (
    Stackable,
    ACTIVATIONS,
    Attention,
    Cache,
    Embedding,
    LayerNorm,
    Linear,
    attend,
    check_config,
    heads,
    joined_linears,
    summed_linears,
    table_and_layers,
    up_and_down,
)
from ._config import DecoderConfig, GPTFields, check_activation
from ._gpt2 import GPTCausalLM



@dataclasses.dataclass(frozen=True)
class GPTJConfig(GPTFields, DecoderConfig):
    """Sizes of a GPT-J model; names follow Hugging Face's ``config.json``.
    The defaults are GPT-J-6B."""

    vocab_size: int = 50400
    n_positions: int = 2048
    n_embd: int = 4096
    n_layer: int = 28
    n_head: int = 16
    rotary_dim: int | None = 64  # None: rotate the whole head
    n_inner: int | None = None  # None: 4 * n_embd
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256
    pad_token_id: int | None = None

    hf_architecture = "GPTJForCausalLM"
    hf_type = "gptj"
    hf_absent = {"rotary_dim": None, "bos_token_id": None, "eos_token_id": None}
    hf_fixed = {"tie_word_embeddings": False}

    def check(self):
        super().check()
        head_dim = self.head_dim
        if self.rotary_dim is not None and (
            isinstance(self.rotary_dim, bool) or not isinstance(self.rotary_dim, int)
            or not 0 < self.rotary_dim <= head_dim or self.rotary_dim % 2
        ):
            raise ValueError(
                f"GPTJConfig.rotary_dim must be None or an even int in 1..head_dim={head_dim}, got {self.rotary_dim!r}."
            )
        check_activation(self)

    @property
    def rotated(self) -> int:
        """How many features of each head the rotary embedding turns."""
        return self.rotary_dim or self.head_dim

    @classmethod
    def hf_in(cls, d, values, tensor_names):
        if d.get("tie_word_embeddings", False):
            raise ValueError("GPT-J config.json has tie_word_embeddings=true; GPT-J's LM head is its own (with a bias).")
        return values


def rotary_every_two(
    x: Float[Array, "seq heads head_dim"], positions: Int[Array, " seq"], rotary_dim: int
) -> Float[Array, "seq heads head_dim"]:
    """Turn each pair of features ``(2i, 2i + 1)`` among the first
    ``rotary_dim`` of every head by ``position * 10000 ** (-2i / rotary_dim)``;
    the other features pass through."""
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]  # (T, R/2)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # (T, 1, R/2)
    rot = x[..., :rotary_dim].astype(jnp.float32)
    even, odd = rot[..., 0::2], rot[..., 1::2]  # (T, H, R/2) each
    turned = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(rot.shape)
    return jnp.concatenate([turned.astype(x.dtype), x[..., rotary_dim:]], axis=-1)


class GPTJMLP(eqx.Module):
    """``fc_out(act(fc_in x))``, with biases; `GPTJBlock` runs it jointly with the attention."""

    fc_in: Linear
    fc_out: Linear

    def __init__(self, config: GPTJConfig, *, key: PRNGKeyArray):
        self.fc_in, self.fc_out = up_and_down(config.n_embd, config.inner, bias=True, key=key)


class GPTJBlock(Stackable):
    """Attention and MLP side by side off one norm. ``attn`` holds the attention's weights in the
    fairseq layout of `Attention` (Q/K/V/``out_proj``, no biases); the block runs those projections
    itself, with GPT-J's rotary embedding between, so ``attn`` called alone is not GPT-J's attention
    (it has no positions)."""

    ln_1: LayerNorm
    attn: Attention
    mlp: GPTJMLP
    config: GPTJConfig = eqx.field(static=True)

    def __init__(self, config: GPTJConfig, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.ln_1 = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        self.attn = Attention(config.n_embd, config.n_head, bias=False, key=ka)
        self.mlp = GPTJMLP(config, key=km)
        self.config = config

    def __call__(self, x, positions, mask, cache, index):
        c, a, m = self.config, self.attn, self.mlp
        h = self.ln_1(x)  # attention and MLP in parallel, off one norm
        projected = joined_linears(h, (a.q_proj, a.k_proj, a.v_proj), joined=cache is None)  # column parallel
        q, k, v = (heads(y, c.n_head) for y in projected)
        up = m.fc_in(h)  # column parallel
        q, k = rotary_every_two(q, positions, c.rotated), rotary_every_two(k, positions, c.rotated)
        attended, cache = attend(q, k, v, mask, cache, index)  # the heads joined back, split over `model`
        hidden = constrain(ACTIVATIONS[c.activation_function](up), P(CONTEXT, MODEL))
        out = summed_linears([(a.out_proj, attended), (m.fc_out, hidden)])  # row parallel: one all-reduce
        return x + constrain(out, P(CONTEXT)), cache


class GPTJModel(eqx.Module):
    wte: Embedding
    h: list[GPTJBlock] | GPTJBlock  # stacked: one block, every array (layers, ...)
    ln_f: LayerNorm

    def __init__(self, config: GPTJConfig, *, key: PRNGKeyArray):
        self.wte, self.h = table_and_layers(config.vocab_size, config.n_embd, lambda k: GPTJBlock(config, key=k),
                                            config.n_layer, stacked=config.scan_layers, key=key)
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_epsilon)


class GPTJForCausalLM(GPTCausalLM):
    """GPT-J for one sequence (batch with ``jax.vmap``).

    **Example:**

    ```python
    config = GPTJConfig(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)
    model = GPTJForCausalLM(config, key=jax.random.key(0))
    logits = jax.vmap(model)(tokens)              # (batch, seq) -> (batch, seq, vocab)
    new = redeqx.models.generate(model, tokens, max_new_tokens=16)
    ```
    """

    transformer: GPTJModel
    lm_head: Linear
    config: GPTJConfig = eqx.field(static=True)

    hf_ignore = (*GPTCausalLM.hf_ignore, r".*attn\.embed_positions")  # and old checkpoints' rotary buffers

    def __init__(self, config: GPTJConfig, *, key: PRNGKeyArray):
        check_config(config, GPTJConfig)
        kt, kh = jax.random.split(key)
        self.transformer = GPTJModel(config, key=kt)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=True, key=kh)
        self.config = config

    def _run(self, ids, positions, mask, cache: Cache | None):
        t = self.transformer
        x = constrain(t.wte(ids), P(CONTEXT))  # vocab-split lookup: one all-reduce
        x, new_layers = self._through_layers(t.h, x, cache, positions, mask)
        return constrain(self.lm_head(t.ln_f(x)), P(CONTEXT, P.UNCONSTRAINED)), new_layers  # vocab: the head's layout
