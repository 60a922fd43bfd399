"""GPT-2: learned positions, pre-LayerNorm blocks, GELU (tanh form), tied
embeddings.

Hugging Face stores GPT-2's projections as ``Conv1D`` weights, input-major
``(in, out)``, and Q/K/V fused in one ``c_attn``. Here every projection is an
ordinary ``(out, in)`` `Linear` and Q/K/V are separate (``q_proj``, ``k_proj``,
``v_proj``), so the sharding rules see a plain attention block and give the
Megatron-LM plan; `hf_tensors` splits and transposes on load and fuses back
on save.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import PRNGKeyArray

from ..mesh import constrain
from ..mesh import CONTEXT
from ._layers import (
    Stackable,
    ACTIVATIONS,
    Cache,
    CausalLM,
    Embedding,
    KVCache,
    LayerNorm,
    Linear,
    attend_and_project,
    build_layers,
    check_config,
    feed_forward,
    heads,
    joined_linears,
    square_linears,
    up_and_down,
)
from ._config import DecoderConfig, GPTFields
from ._safetensors import HFTensor



@dataclasses.dataclass(frozen=True)
class GPT2Config(GPTFields, DecoderConfig):
    """Sizes of a GPT-2 model; names follow Hugging Face's ``config.json``."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # None: 4 * n_embd
    layer_norm_epsilon: float = 1e-5
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256
    pad_token_id: int | None = None

    hf_architecture = "GPT2LMHeadModel"
    hf_type = "gpt2"
    hf_absent = {"bos_token_id": None, "eos_token_id": None}
    hf_fixed = {"activation_function": "gelu_new", "tie_word_embeddings": True}

    @classmethod
    def hf_in(cls, d, values, tensor_names):
        for k, ok in _UNSUPPORTED.items():
            if k in d and d[k] not in ok:
                raise ValueError(f"GPT-2 config.json has {k}={d[k]!r}; redeqx supports only {ok}.")
        return values


# Options of GPT-2's config.json that redeqx's blocks do not implement, and the values they do.
_UNSUPPORTED = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "reorder_and_upcast_attn": (False,),
    "add_cross_attention": (False,),
}


class GPT2Attention(eqx.Module):
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    c_proj: Linear
    n_head: int = eqx.field(static=True)

    def __init__(self, config: GPT2Config, *, key: PRNGKeyArray):
        self.q_proj, self.k_proj, self.v_proj, self.c_proj = square_linears(config.n_embd, 4, bias=True, key=key)
        self.n_head = config.n_head

    def __call__(self, x, mask, cache: KVCache | None, index):
        projected = joined_linears(x, (self.q_proj, self.k_proj, self.v_proj), joined=cache is None)
        q, k, v = (heads(y, self.n_head) for y in projected)
        return attend_and_project(self.c_proj, q, k, v, mask, cache, index)


class GPT2MLP(eqx.Module):
    c_fc: Linear
    c_proj: Linear

    def __init__(self, config: GPT2Config, *, key: PRNGKeyArray):
        self.c_fc, self.c_proj = up_and_down(config.n_embd, config.inner, bias=True, key=key)

    def __call__(self, x):
        return feed_forward(self.c_fc, self.c_proj, ACTIVATIONS["gelu_new"], x)


class GPT2Block(Stackable):
    ln_1: LayerNorm
    attn: GPT2Attention
    ln_2: LayerNorm
    mlp: GPT2MLP

    def __init__(self, config: GPT2Config, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.ln_1 = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, key=ka)
        self.ln_2 = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config, key=km)

    def __call__(self, x, mask, cache, index):
        a, cache = self.attn(self.ln_1(x), mask, cache, index)
        x = x + a
        return x + self.mlp(self.ln_2(x)), cache


class GPT2Model(eqx.Module):
    wte: Embedding  # tokens: split on the vocabulary
    wpe: Embedding  # positions: replicated
    h: list[GPT2Block] | GPT2Block  # stacked: one block, every array (layers, ...)
    ln_f: LayerNorm

    def __init__(self, config: GPT2Config, *, key: PRNGKeyArray):
        keys = jax.random.split(key, config.n_layer + 2)
        self.wte = Embedding(config.vocab_size, config.n_embd, key=keys[0])
        self.wpe = Embedding(config.n_positions, config.n_embd, key=keys[1])
        self.h = build_layers(lambda k: GPT2Block(config, key=k), keys[2:], stacked=config.scan_layers)
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_epsilon)


class GPTCausalLM(CausalLM):
    """What GPT-2 and GPT-J share: their layers at ``transformer.h`` (stacked when
    ``config.scan_layers``), a `GPTFields` config, and the causal-mask buffers their old
    checkpoints carry."""

    hf_ignore = (r".*attn\.bias", r".*attn\.masked_bias")
    hf_stacks = ("transformer.h",)

    def _kv_shape(self):
        return self.config.n_layer, self.config.n_head, self.config.head_dim


class GPT2LMHeadModel(GPTCausalLM):
    """GPT-2 for one sequence (batch with ``jax.vmap``); the LM head is the
    token embedding (tied).

    **Example:**

    ```python
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4), key=jax.random.key(0))
    logits = jax.vmap(model)(tokens)
    ```
    """

    transformer: GPT2Model
    config: GPT2Config = eqx.field(static=True)

    hf_ignore = (*GPTCausalLM.hf_ignore, r"lm_head\.weight")  # newer checkpoints may save the tied head

    def __init__(self, config: GPT2Config, *, key: PRNGKeyArray):
        check_config(config, GPT2Config)
        self.transformer = GPT2Model(config, key=key)
        self.config = config

    def _max_positions(self):
        return self.config.n_positions, "n_positions"

    def _run(self, ids, positions, mask, cache: Cache | None):
        t = self.transformer
        x = constrain(t.wte(ids) + t.wpe(positions), P(CONTEXT))
        x, new_layers = self._through_layers(t.h, x, cache, mask)
        return constrain(t.wte.attend(t.ln_f(x)), P(CONTEXT, P.UNCONSTRAINED)), new_layers  # vocab: the table's layout

    def hf_tensors(self) -> list[HFTensor]:
        """Checkpoint tensors: ``c_attn`` (input-major, Q|K|V side by side) is
        split into ``q_proj``/``k_proj``/``v_proj`` and transposed; other
        ``Conv1D`` weights are transposed."""
        h = self.config.n_embd
        out = [HFTensor("transformer.wte.weight", ("transformer.wte.weight",)),
               HFTensor("transformer.wpe.weight", ("transformer.wpe.weight",))]
        out += [HFTensor(f"transformer.ln_f.{n}", (f"transformer.ln_f.{n}",)) for n in ("weight", "bias")]
        transpose = dict(split=lambda a: (a.T,), join=lambda w: w.T)
        for i in range(self.config.n_layer):
            p = f"transformer.h.{i}"
            qkv = tuple(f"{p}.attn.{n}_proj" for n in "qkv")
            out += [
                HFTensor(f"{p}.attn.c_attn.weight", tuple(f"{q}.weight" for q in qkv),
                         split=lambda a: (a[:, :h].T, a[:, h:2 * h].T, a[:, 2 * h:].T),
                         join=lambda q, k, v: jnp.concatenate([q, k, v], axis=0).T),
                HFTensor(f"{p}.attn.c_attn.bias", tuple(f"{q}.bias" for q in qkv),
                         split=lambda a: (a[:h], a[h:2 * h], a[2 * h:]),
                         join=lambda q, k, v: jnp.concatenate([q, k, v])),
            ]
            for layer in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
                out += [HFTensor(f"{p}.{layer}.weight", (f"{p}.{layer}.weight",), **transpose),
                        HFTensor(f"{p}.{layer}.bias", (f"{p}.{layer}.bias",))]
            for ln in ("ln_1", "ln_2"):
                out += [HFTensor(f"{p}.{ln}.{w}", (f"{p}.{ln}.{w}",)) for w in ("weight", "bias")]
        return out
