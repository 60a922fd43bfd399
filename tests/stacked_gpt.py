"""A GPT written the way Equinox recommends for deep models: the blocks built
once with ``eqx.filter_vmap`` (every array with a leading layer axis) and run
with ``jax.lax.scan``, from ``eqx.nn`` layers (``MultiheadAttention``,
``LayerNorm``, ``fc1``/``fc2`` Linears). `unstacked` gives the same weights as
a list of blocks, run by a Python loop: what the stacked model must match."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, width: int, heads: int, *, key):
        ka, k1, k2 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(heads, width, key=ka)
        self.ln2 = eqx.nn.LayerNorm(width)
        self.fc1 = eqx.nn.Linear(width, 4 * width, key=k1)
        self.fc2 = eqx.nn.Linear(4 * width, width, key=k2)

    def __call__(self, x):  # (T, C)
        h = jax.vmap(self.ln1)(x)
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.attn(h, h, h, mask=causal)
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(h)))


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: Block | list  # stacked (one Block, arrays (L, ...)) or a list of Blocks
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab=128, seq=32, width=64, layers=4, heads=4, *, key):
        ke, kp, kb, kh = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(vocab, width, key=ke)
        self.pos = 0.02 * jax.random.normal(kp, (seq, width))
        self.blocks = eqx.filter_vmap(lambda k: Block(width, heads, key=k))(jax.random.split(kb, layers))
        self.ln_f = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, vocab, use_bias=False, key=kh)

    def __call__(self, tokens):  # (T,) -> (T, vocab)
        x = jax.vmap(self.embed)(tokens) + self.pos[: tokens.shape[0]]
        if isinstance(self.blocks, list):
            for block in self.blocks:
                x = block(x)
        else:
            arrays, static = eqx.partition(self.blocks, eqx.is_array)

            def body(x, layer):
                return eqx.combine(layer, static)(x), None

            x, _ = jax.lax.scan(body, x, arrays)
        return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))


def unstacked(model: GPT) -> GPT:
    """The same weights with the blocks as a list."""
    n = jax.tree.leaves(eqx.filter(model.blocks, eqx.is_array))[0].shape[0]
    blocks = [jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, model.blocks) for i in range(n)]
    return eqx.tree_at(lambda m: m.blocks, model, blocks)


def loss_fn(model, batch, key):
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def batch(n: int, seq: int = 32, vocab: int = 128, seed: int = 0) -> dict:
    return {"tokens": np.random.default_rng(seed).integers(0, vocab, (n, seq + 1)).astype(np.int32)}
