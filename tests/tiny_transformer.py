"""A small GPT-style language model with its own attribute names, for tests
and benchmarks: the sharding rules must find the Megatron plan from names
alone (wq wk wv wo, fc1 fc2, embed, lm_head)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax



def causal_attention(q, k, v):
    """Softmax attention of (T, H, D) queries, keys and values under a causal mask -> (T, H * D)."""
    t, h, d = q.shape
    att = jnp.einsum("thd,shd->hts", q, k) / jnp.sqrt(d).astype(q.dtype)  # (H, T, T)
    att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, jnp.finfo(att.dtype).min), axis=-1)
    return jnp.einsum("hts,shd->thd", att, v).reshape(t, h * d)

class Attention(eqx.Module):
    wq: eqx.nn.Linear
    wk: eqx.nn.Linear
    wv: eqx.nn.Linear
    wo: eqx.nn.Linear
    n_heads: int = eqx.field(static=True)

    def __init__(self, dim, n_heads, *, key):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = eqx.nn.Linear(dim, dim, key=kq)
        # no key bias: softmax ignores it, so its gradient is pure rounding noise that Adam amplifies
        self.wk = eqx.nn.Linear(dim, dim, use_bias=False, key=kk)
        self.wv = eqx.nn.Linear(dim, dim, key=kv)
        self.wo = eqx.nn.Linear(dim, dim, key=ko)
        self.n_heads = n_heads

    def __call__(self, x):  # (T, C)
        t, c = x.shape
        h = self.n_heads
        q = jax.vmap(self.wq)(x).reshape(t, h, c // h)  # (T, H, D)
        k = jax.vmap(self.wk)(x).reshape(t, h, c // h)
        v = jax.vmap(self.wv)(x).reshape(t, h, c // h)
        return jax.vmap(self.wo)(causal_attention(q, k, v))


class MLP(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, dim, hidden, *, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(dim, hidden, key=k1)
        self.fc2 = eqx.nn.Linear(hidden, dim, key=k2)

    def __call__(self, x):
        return jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(x)))


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: Attention
    ln2: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, dim, n_heads, hidden, *, key):
        ka, km = jax.random.split(key)
        self.ln1 = eqx.nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads, key=ka)
        self.ln2 = eqx.nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden, key=km)

    def __call__(self, x):
        x = x + self.attn(jax.vmap(self.ln1)(x))
        return x + self.mlp(jax.vmap(self.ln2)(x))


class TinyLM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    ln_f: eqx.nn.LayerNorm
    lm_head: eqx.nn.Linear

    def __init__(self, vocab=64, dim=32, n_heads=4, hidden=96, n_layers=2, *, key):
        ke, kb, kh = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=ke)
        self.blocks = [Block(dim, n_heads, hidden, key=k) for k in jax.random.split(kb, n_layers)]
        self.ln_f = eqx.nn.LayerNorm(dim)
        self.lm_head = eqx.nn.Linear(dim, vocab, use_bias=False, key=kh)

    def __call__(self, tokens):  # (T,) int -> (T, V)
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.lm_head)(jax.vmap(self.ln_f)(x))


def lm_loss(model, batch, key):
    """Next-token cross-entropy, mean over every position of every row."""
    tokens = batch["tokens"]  # (B, T+1)
    logits = jax.vmap(model)(tokens[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == tokens[:, 1:]).mean()}


def token_examples(n, seq_len=16, vocab=64, seed=0):
    """Sequences with structure a model can learn (counting mod vocab from a random start)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    starts = rng.integers(0, vocab, n)
    return [{"tokens": (s + np.arange(seq_len + 1)) % vocab} for s in starts]


def collate_tokens(examples):
    import numpy as np

    return {"tokens": np.stack([e["tokens"] for e in examples]).astype(np.int32)}
