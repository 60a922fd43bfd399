"""A GPT-2-style language model as an Equinox user would write it: plain
``eqx.nn`` layers under ``jax.vmap``, no redeqx inside, attribute names of
the user's choosing (``attn.query/key/value/proj``, ``mlp.fc1/fc2``,
``wte``/``wpe``). Pre-LN blocks, tanh GELU, a learned position table, and the
token table's transpose as the LM head (tied), initialised as GPT-2 is
(normal 0.02, zero biases), so the first loss is about ln(vocab).

The shapes match Hugging Face's GPT-2 of the same config (benchmarks/vs_redco.py
at 3db93f0 compared the two); tests use it as "a user's own model" the rules never saw.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from tiny_transformer import causal_attention


def linear(n_in, n_out, *, key):
    """GPT-2's initialisation: weight N(0, 0.02), bias 0."""
    layer = eqx.nn.Linear(n_in, n_out, key=key)
    return eqx.tree_at(lambda m: (m.weight, m.bias), layer,
                       (0.02 * jax.random.normal(key, (n_out, n_in)), jnp.zeros(n_out)))


class Attention(eqx.Module):
    query: eqx.nn.Linear
    key: eqx.nn.Linear
    value: eqx.nn.Linear
    proj: eqx.nn.Linear
    n_heads: int = eqx.field(static=True)

    def __init__(self, width, n_heads, *, key):
        kq, kk, kv, kp = jax.random.split(key, 4)
        self.query = linear(width, width, key=kq)
        self.key = linear(width, width, key=kk)
        self.value = linear(width, width, key=kv)
        self.proj = linear(width, width, key=kp)
        self.n_heads = n_heads

    def __call__(self, x):  # (T, C) -> (T, C)
        t, c = x.shape
        h = self.n_heads
        q = jax.vmap(self.query)(x).reshape(t, h, c // h)  # (T, H, D)
        k = jax.vmap(self.key)(x).reshape(t, h, c // h)
        v = jax.vmap(self.value)(x).reshape(t, h, c // h)
        return jax.vmap(self.proj)(causal_attention(q, k, v))


class MLP(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, width, *, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = linear(width, 4 * width, key=k1)
        self.fc2 = linear(4 * width, width, key=k2)

    def __call__(self, x):  # (T, C)
        return jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(x)))  # GPT-2's tanh GELU


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: Attention
    ln2: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, width, n_heads, *, key):
        ka, km = jax.random.split(key)
        self.ln1 = eqx.nn.LayerNorm(width)
        self.attn = Attention(width, n_heads, key=ka)
        self.ln2 = eqx.nn.LayerNorm(width)
        self.mlp = MLP(width, key=km)

    def __call__(self, x):  # pre-LN
        x = x + self.attn(jax.vmap(self.ln1)(x))
        return x + self.mlp(jax.vmap(self.ln2)(x))


class GPT(eqx.Module):
    wte: eqx.nn.Embedding  # tokens; its transpose is also the LM head
    wpe: eqx.nn.Embedding  # learned positions
    blocks: list[Block]
    ln_f: eqx.nn.LayerNorm

    def __init__(self, vocab=8192, seq=256, width=256, layers=4, heads=8, *, key):
        ke, kp, kb = jax.random.split(key, 3)
        self.wte = eqx.nn.Embedding(weight=0.02 * jax.random.normal(ke, (vocab, width)))
        self.wpe = eqx.nn.Embedding(weight=0.02 * jax.random.normal(kp, (seq, width)))
        self.blocks = [Block(width, heads, key=k) for k in jax.random.split(kb, layers)]
        self.ln_f = eqx.nn.LayerNorm(width)

    def __call__(self, tokens):  # (T,) int -> (T, vocab) logits
        x = jax.vmap(self.wte)(tokens) + jax.vmap(self.wpe)(jnp.arange(tokens.shape[0]))  # (T, C)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.ln_f)(x) @ self.wte.weight.T  # tied head: (T, C) @ (C, V)


def loss_fn(model, batch, key):
    """Next-token cross-entropy, mean over every position of every row."""
    tokens = batch["tokens"]  # (B, T+1)
    logits = jax.vmap(model)(tokens[:, :-1])  # (B, T, V)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_examples(n, seq=256, vocab=8192, seed=0):
    """``n`` sequences of ``seq + 1`` tokens with structure to learn: counting
    mod vocab from a random start with a random stride in 1..7."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, vocab, n)
    strides = rng.integers(1, 8, n)
    steps = np.arange(seq + 1)
    return [{"tokens": ((s + d * steps) % vocab).astype(np.int32)} for s, d in zip(starts, strides)]


def collate_fn(examples):
    return {"tokens": np.stack([e["tokens"] for e in examples]).astype(np.int32)}
