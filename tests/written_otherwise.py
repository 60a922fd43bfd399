"""One GPT written the ways people write models (issue 29), plus a ViT with a
conv patch embedding, Meta-style grouped-query attention and nested
``eqx.nn.Sequential``: models whose names and storage tell the name rules
nothing (or the wrong thing), so only the program says each weight's role.

Every GPT variant computes the same function as `user_gpt.GPT` (pre-LN,
tied head, learned positions) with its weights named and stored otherwise:

- ``RawGPT``: raw ``(out, in)`` arrays named ``Wq``, ``W1``..., used as ``x @ W.T``;
- ``FlaxGPT``: ``Dense`` modules holding ``(in, out)`` ``kernel``s used as
  ``x @ kernel``, named as Flax names them (``Dense_0``, ``Dense_1``);
- ``ScanGPT``: every block's arrays stacked on a leading layer axis, no
  annotations, run by ``lax.scan``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from user_gpt import GPT


def row(v, x):  # a (C,) vector broadcast over x's leading dims (the tests raise on rank promotion)
    return v.reshape((1,) * (x.ndim - 1) + v.shape)


def layer_norm(x, g, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * row(g, x) + row(b, x)


def attend(q, k, v, heads):  # (T, C) each -> (T, C), causal
    t, c = q.shape
    q, k, v = (a.reshape(t, heads, c // heads) for a in (q, k, v))
    att = jnp.einsum("thd,shd->hts", q, k) / np.sqrt(c // heads).astype(q.dtype)
    att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9), axis=-1)
    return jnp.einsum("hts,shd->thd", att, v).reshape(t, c)


def block(lin, p, x, heads):
    """A pre-LN block over ``p``'s arrays, ``lin(name, x)`` applying the projection named ``name``."""
    h = layer_norm(x, p["g1"], p["s1"])
    x = x + lin("o", attend(lin("q", h), lin("k", h), lin("v", h), heads))
    h = layer_norm(x, p["g2"], p["s2"])
    return x + lin("2", jax.nn.gelu(lin("1", h)))


def init(key, width, shapes):
    keys = jax.random.split(key, len(shapes))
    return {n: 0.02 * jax.random.normal(k, s) for k, (n, s) in zip(keys, shapes.items())}


def gpt_loss(model, batch, key):
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


class RawBlock(eqx.Module):
    Wq: jax.Array
    Wk: jax.Array
    Wv: jax.Array
    Wo: jax.Array
    W1: jax.Array
    W2: jax.Array
    norms: dict

    def __init__(self, width, *, key):
        p = init(key, width, {"Wq": (width, width), "Wk": (width, width), "Wv": (width, width),
                              "Wo": (width, width), "W1": (4 * width, width), "W2": (width, 4 * width)})
        for n, v in p.items():
            setattr(self, n, v)
        self.norms = {"g1": jnp.ones(width), "s1": jnp.zeros(width), "g2": jnp.ones(width), "s2": jnp.zeros(width)}

    def __call__(self, x, heads):
        return block(lambda n, h: h @ getattr(self, "W" + n).T, self.norms, x, heads)


class Dense(eqx.Module):
    kernel: jax.Array  # (in, out), as Flax stores it
    bias: jax.Array

    def __init__(self, n_in, n_out, *, key):
        self.kernel = 0.02 * jax.random.normal(key, (n_in, n_out))
        self.bias = jnp.zeros(n_out)

    def __call__(self, x):
        y = x @ self.kernel
        return y + row(self.bias, y)


class FlaxBlock(eqx.Module):
    query: Dense
    key: Dense
    value: Dense
    out: Dense
    Dense_0: Dense
    Dense_1: Dense
    norms: dict

    def __init__(self, width, *, key):
        k = jax.random.split(key, 6)
        self.query, self.key, self.value, self.out = (Dense(width, width, key=k[i]) for i in range(4))
        self.Dense_0, self.Dense_1 = Dense(width, 4 * width, key=k[4]), Dense(4 * width, width, key=k[5])
        self.norms = {"g1": jnp.ones(width), "s1": jnp.zeros(width), "g2": jnp.ones(width), "s2": jnp.zeros(width)}

    def __call__(self, x, heads):
        layers = {"q": self.query, "k": self.key, "v": self.value, "o": self.out, "1": self.Dense_0, "2": self.Dense_1}
        return block(lambda n, h: layers[n](h), self.norms, x, heads)


class Stack(eqx.Module):
    """Every array carries a leading layer axis; nothing is annotated."""

    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    fc_in: jax.Array
    fc_out: jax.Array
    norms: dict

    def __init__(self, width, layers, *, key):
        shapes = {"wq": (width, width), "wk": (width, width), "wv": (width, width), "wo": (width, width),
                  "fc_in": (4 * width, width), "fc_out": (width, 4 * width)}
        p = init(key, width, {n: (layers, *s) for n, s in shapes.items()})
        for n, v in p.items():
            setattr(self, n, v)
        self.norms = {n: jnp.full((layers, width), 1.0 if n[0] == "g" else 0.0) for n in ("g1", "s1", "g2", "s2")}


STACK_NAMES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "1": "fc_in", "2": "fc_out"}


class OtherGPT(eqx.Module):
    emb: jax.Array  # (vocab, width), tied head
    pos: jax.Array
    blocks: list | Stack
    g: jax.Array
    s: jax.Array
    heads: int = eqx.field(static=True)

    def __init__(self, kind, vocab=64, seq=16, width=32, layers=2, heads=4, *, key):
        ke, kp, kb = jax.random.split(key, 3)
        self.emb = 0.02 * jax.random.normal(ke, (vocab, width))
        self.pos = 0.02 * jax.random.normal(kp, (seq, width))
        keys = jax.random.split(kb, layers)
        if kind == "scan":
            self.blocks = Stack(width, layers, key=kb)
        else:
            cls = {"raw": RawBlock, "flax": FlaxBlock}[kind]
            self.blocks = [cls(width, key=k) for k in keys]
        self.g, self.s, self.heads = jnp.ones(width), jnp.zeros(width), heads

    def __call__(self, tokens):
        x = self.emb[tokens] + self.pos[jnp.arange(tokens.shape[0])]
        if isinstance(self.blocks, Stack):
            def one(x, layer):
                return block(lambda n, h: h @ layer[STACK_NAMES[n]].T, layer["norms"], x, self.heads), None
            stacked = {n: getattr(self.blocks, n) for n in STACK_NAMES.values()} | {"norms": self.blocks.norms}
            x, _ = jax.lax.scan(one, x, stacked)
        else:
            for b in self.blocks:
                x = b(x, self.heads)
        return layer_norm(x, self.g, self.s) @ self.emb.T


def reference_gpt(key):
    """The same architecture with eqx.nn.Linear and conventional names."""
    return GPT(vocab=64, seq=16, width=32, layers=2, heads=4, key=key)


class MetaAttention(eqx.Module):
    """Grouped-query attention as Meta's llama writes it: K/V with fewer heads, repeated."""

    wq: eqx.nn.Linear
    wk: eqx.nn.Linear
    wv: eqx.nn.Linear
    wo: eqx.nn.Linear
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)

    def __init__(self, width, n_heads, n_kv_heads, *, key):
        k = jax.random.split(key, 4)
        self.head_dim, self.n_kv_heads = width // n_heads, n_kv_heads
        self.wq = eqx.nn.Linear(width, n_heads * self.head_dim, use_bias=False, key=k[0])
        self.wk = eqx.nn.Linear(width, n_kv_heads * self.head_dim, use_bias=False, key=k[1])
        self.wv = eqx.nn.Linear(width, n_kv_heads * self.head_dim, use_bias=False, key=k[2])
        self.wo = eqx.nn.Linear(n_heads * self.head_dim, width, use_bias=False, key=k[3])

    def __call__(self, x, n_heads):
        t = x.shape[0]
        q = jax.vmap(self.wq)(x).reshape(t, n_heads, self.head_dim)
        k = jax.vmap(self.wk)(x).reshape(t, self.n_kv_heads, self.head_dim)
        v = jax.vmap(self.wv)(x).reshape(t, self.n_kv_heads, self.head_dim)
        rep = n_heads // self.n_kv_heads
        k = jnp.repeat(k, rep, axis=1)  # repeat_kv
        v = jnp.repeat(v, rep, axis=1)
        att = jax.nn.softmax(jnp.einsum("thd,shd->hts", q, k) / np.sqrt(self.head_dim), axis=-1)
        return jax.vmap(self.wo)(jnp.einsum("hts,shd->thd", att, v).reshape(t, -1))


class MetaBlock(eqx.Module):
    attention: MetaAttention
    w1: eqx.nn.Linear
    w2: eqx.nn.Linear
    w3: eqx.nn.Linear
    attention_norm: eqx.nn.RMSNorm
    ffn_norm: eqx.nn.RMSNorm
    n_heads: int = eqx.field(static=True)

    def __init__(self, width, n_heads, n_kv_heads, *, key):
        k = jax.random.split(key, 4)
        self.attention = MetaAttention(width, n_heads, n_kv_heads, key=k[0])
        self.w1 = eqx.nn.Linear(width, 2 * width, use_bias=False, key=k[1])
        self.w2 = eqx.nn.Linear(2 * width, width, use_bias=False, key=k[2])
        self.w3 = eqx.nn.Linear(width, 2 * width, use_bias=False, key=k[3])
        self.attention_norm, self.ffn_norm = eqx.nn.RMSNorm(width), eqx.nn.RMSNorm(width)
        self.n_heads = n_heads

    def __call__(self, x):
        x = x + self.attention(jax.vmap(self.attention_norm)(x), self.n_heads)
        h = jax.vmap(self.ffn_norm)(x)
        return x + jax.vmap(self.w2)(jax.nn.silu(jax.vmap(self.w1)(h)) * jax.vmap(self.w3)(h))


class MetaLM(eqx.Module):
    tok_embeddings: eqx.nn.Embedding
    layers: list
    norm: eqx.nn.RMSNorm
    output: eqx.nn.Linear

    def __init__(self, vocab=64, width=32, n_layers=2, n_heads=8, n_kv_heads=2, *, key):
        k = jax.random.split(key, n_layers + 2)
        self.tok_embeddings = eqx.nn.Embedding(vocab, width, key=k[0])
        self.layers = [MetaBlock(width, n_heads, n_kv_heads, key=kk) for kk in k[2:]]
        self.norm = eqx.nn.RMSNorm(width)
        self.output = eqx.nn.Linear(width, vocab, use_bias=False, key=k[1])

    def __call__(self, tokens):
        x = jax.vmap(self.tok_embeddings)(tokens)
        for layer in self.layers:
            x = layer(x)
        return jax.vmap(self.output)(jax.vmap(self.norm)(x))


class ViT(eqx.Module):
    """Patches by a strided conv, learned positions, the user GPT's blocks (unmasked is not needed here)."""

    patch: eqx.nn.Conv2d
    pos: jax.Array
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, width=32, layers=2, heads=4, *, key):
        from user_gpt import Block

        k = jax.random.split(key, layers + 3)
        self.patch = eqx.nn.Conv2d(3, width, kernel_size=4, stride=4, key=k[0])
        self.pos = 0.02 * jax.random.normal(k[1], (16, width))
        self.blocks = [Block(width, heads, key=kk) for kk in k[3:]]
        self.norm = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, 10, key=k[2])

    def __call__(self, image):  # (3, 16, 16)
        x = self.patch(image).reshape(self.pos.shape[1], -1).T + self.pos  # (16 patches, width)
        for b in self.blocks:
            x = b(x)
        return self.head(jax.vmap(self.norm)(x).mean(0))


def image_loss(model, batch, key):
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def nested_mlp(key):
    k = jax.random.split(key, 4)
    act = eqx.nn.Lambda(jax.nn.gelu)
    return eqx.nn.Sequential([
        eqx.nn.Linear(16, 64, key=k[0]), act,
        eqx.nn.Sequential([eqx.nn.Linear(64, 16, key=k[1]), eqx.nn.Linear(16, 64, key=k[2]), act]),
        eqx.nn.Linear(64, 10, key=k[3]),
    ])


def vector_loss(model, batch, key):
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


class VitAttention(eqx.Module):
    """vit-pytorch's attention: a pre-norm, one fused ``to_qkv`` (no bias), its output projection in a
    ``Sequential`` of its own (``to_out``, with a dropout). ``layout="chunk"`` cuts q, k and v as
    vit-pytorch does (``to_qkv(x).chunk(3)``, then ``'b n (h d) -> b h n d'``), ``"interleaved"``
    reads them from ``(..., heads, 3, head_dim)``, the layout the rules split per head."""

    norm: eqx.nn.LayerNorm
    to_qkv: eqx.nn.Linear
    to_out: eqx.nn.Sequential
    heads: int = eqx.field(static=True)
    layout: str = eqx.field(static=True)

    def __init__(self, dim, heads, layout, *, key):
        k1, k2 = jax.random.split(key)
        self.norm, self.heads, self.layout = eqx.nn.LayerNorm(dim), heads, layout
        self.to_qkv = eqx.nn.Linear(dim, 3 * dim, use_bias=False, key=k1)
        self.to_out = eqx.nn.Sequential([eqx.nn.Linear(dim, dim, key=k2), eqx.nn.Dropout(0.0)])

    def __call__(self, x):  # (N, dim)
        n, dim = x.shape
        qkv = jax.vmap(self.to_qkv)(jax.vmap(self.norm)(x))
        if self.layout == "chunk":
            q, k, v = (t.reshape(n, self.heads, -1).transpose(1, 0, 2) for t in jnp.split(qkv, 3, axis=-1))
        else:
            q, k, v = jnp.moveaxis(qkv.reshape(n, self.heads, 3, -1), 2, 0).transpose(0, 2, 1, 3)
        att = jax.nn.softmax(q @ k.transpose(0, 2, 1) / np.sqrt(dim // self.heads), axis=-1)
        return jax.vmap(self.to_out)((att @ v).transpose(1, 0, 2).reshape(n, dim))


class VitPytorch(eqx.Module):
    """vit-pytorch's ``ViT``: patches by a reshape, then LayerNorm, Linear, LayerNorm; a class token and
    learned positions; ``[attention, feed-forward]`` pairs in lists, the feed-forward a ``Sequential``."""

    to_patch: list
    cls: jax.Array
    pos: jax.Array
    layers: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    patch: int = eqx.field(static=True)

    def __init__(self, image=16, patch=4, dim=32, depth=2, heads=4, layout="chunk", classes=10, *, key):
        k = jax.random.split(key, 3 * depth + 4)
        self.patch, flat = patch, 3 * patch * patch
        self.to_patch = [eqx.nn.LayerNorm(flat), eqx.nn.Linear(flat, dim, key=k[0]), eqx.nn.LayerNorm(dim)]
        self.cls, self.pos = 0.02 * jax.random.normal(k[1], (dim,)), 0.02 * jax.random.normal(
            k[2], ((image // patch) ** 2 + 1, dim))
        self.layers = [[VitAttention(dim, heads, layout, key=k[4 + 3 * i]),
                        eqx.nn.Sequential([eqx.nn.LayerNorm(dim), eqx.nn.Linear(dim, 4 * dim, key=k[5 + 3 * i]),
                                           eqx.nn.Lambda(jax.nn.gelu), eqx.nn.Linear(4 * dim, dim, key=k[6 + 3 * i])])]
                       for i in range(depth)]
        self.norm, self.head = eqx.nn.LayerNorm(dim), eqx.nn.Linear(dim, classes, key=k[3])

    def __call__(self, image):  # (3, H, W)
        c, h, w = image.shape
        p = self.patch
        x = image.reshape(c, h // p, p, w // p, p).transpose(1, 3, 2, 4, 0).reshape((h // p) * (w // p), -1)
        for f in self.to_patch:
            x = jax.vmap(f)(x)
        x = jnp.concatenate([self.cls[None], x]) + self.pos
        for attention, feed_forward in self.layers:
            x = x + attention(x)
            x = x + jax.vmap(feed_forward)(x)
        return self.head(self.norm(x[0]))


class GCNLayer(eqx.Module):
    """Kipf & Welling's graph convolution as message passing writes it: each node's features
    projected, gathered along the edges (``h[senders]``) and summed into the receivers
    (``jax.ops.segment_sum``), over the in-degree."""

    lin: eqx.nn.Linear

    def __call__(self, x, senders, receivers):  # (N, F), (E,), (E,) -> (N, H)
        nodes = x.shape[0]
        incoming = jax.ops.segment_sum(jax.vmap(self.lin)(x)[senders], receivers, num_segments=nodes)
        degree = jax.ops.segment_sum(jnp.ones(receivers.shape), receivers, num_segments=nodes)
        return jax.nn.relu(incoming / jnp.maximum(degree, 1.0)[:, None])


class GCN(eqx.Module):
    layers: list
    readout: eqx.nn.Linear

    def __init__(self, features, width, depth, *, key):
        ks = jax.random.split(key, depth + 1)
        sizes = [features] + [width] * depth
        self.layers = [GCNLayer(eqx.nn.Linear(i, o, key=k)) for i, o, k in zip(sizes, sizes[1:], ks)]
        self.readout = eqx.nn.Linear(width, 1, key=ks[-1])

    def __call__(self, nodes, senders, receivers):  # one graph -> a scalar
        for layer in self.layers:
            nodes = layer(nodes, senders, receivers)
        return self.readout(nodes.mean(0))[0]


def graph_regression_loss(model, batch, key):
    pred = jax.vmap(model)(batch["nodes"], batch["senders"], batch["receivers"])
    return jnp.mean((pred - batch["y"]) ** 2)


def graphs(rows=16, nodes=12, edges=36, features=8, seed=0):
    rng = np.random.default_rng(seed)
    return {"nodes": rng.normal(size=(rows, nodes, features)).astype(np.float32),
            "senders": rng.integers(0, nodes, (rows, edges)).astype(np.int32),
            "receivers": rng.integers(0, nodes, (rows, edges)).astype(np.int32),
            "y": rng.normal(size=(rows,)).astype(np.float32)}
