"""Three models in styles a first-day review wrote (issue 40), each with its loss,
a batch and its hand-written Megatron-style plan (``HAND[name]``: overrides on
an all-replicated tree):

- ``RWKV``: a linear-attention recurrence, receptance/key/value/output
  projections, a per-head ``(H, D, D)`` state carried by ``lax.scan`` over the
  tokens (token shift, a per-head decay and bonus), a GroupNorm over the heads
  (``ln_x``) and a channel mix;
- ``UNet``: a small diffusion UNet: ``eqx.nn.GroupNorm``, a sinusoidal time
  embedding through an MLP, residual conv blocks, a down and an up level with a
  skip concatenation, multi-head attention by 1x1 convs at the low resolution,
  trained with an MSE on the noise;
- ``Mamba``: a selective state-space block: ``in_proj`` into x and a gate, a
  causal depthwise conv (written as shifts), ``x_proj`` to dt/B/C, ``dt_proj``,
  a diagonal ``(E, N)`` state scanned over the tokens, ``out_proj``.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

COL, ROW = P("model", None), P(None, "model")
COL4, ROW4 = P("model", None, None, None), P(None, "model", None, None)


def _lin(i, o, key, bias=False):
    return eqx.nn.Linear(i, o, use_bias=bias, key=key)


def _norm(x, g):  # a LayerNorm over the last dim with a (C,) scale
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * g[None, :]


# -- RWKV -------------------------------------------------------------------------------------


class TimeMix(eqx.Module):
    mix: jax.Array  # (3, C): token-shift mixes for r, k, v
    receptance: eqx.nn.Linear
    key: eqx.nn.Linear
    value: eqx.nn.Linear
    output: eqx.nn.Linear
    decay: jax.Array  # (H, D)
    bonus: jax.Array  # (H, D)
    ln_x: eqx.nn.GroupNorm
    heads: int = eqx.field(static=True)

    def __init__(self, c, heads, key):
        k = jax.random.split(key, 6)
        self.mix = jax.random.uniform(k[0], (3, c))
        self.receptance, self.key, self.value, self.output = (_lin(c, c, kk) for kk in k[1:5])
        self.decay = jax.random.normal(k[5], (heads, c // heads))
        self.bonus = 0.1 * jnp.ones((heads, c // heads))
        self.ln_x = eqx.nn.GroupNorm(heads, c)
        self.heads = heads

    def __call__(self, x):  # (T, C)
        t, c = x.shape
        h, d = self.heads, c // self.heads
        prev = jnp.concatenate([jnp.zeros_like(x[:1]), x[:-1]])  # token shift
        xr, xk, xv = (x * m[None] + prev * (1 - m[None]) for m in self.mix)
        r = jax.vmap(self.receptance)(xr).reshape(t, h, d)
        k = jax.vmap(self.key)(xk).reshape(t, h, d)
        v = jax.vmap(self.value)(xv).reshape(t, h, d)
        w = jnp.exp(-jnp.exp(self.decay))  # (H, D)

        def step(state, rkv):  # state (H, D, D): one per head
            rt, kt, vt = rkv  # (H, D) each
            kv = kt[:, :, None] * vt[:, None, :]
            out = jnp.einsum("hi,hij->hj", rt, state + self.bonus[:, :, None] * kv)
            return w[:, :, None] * state + kv, out

        _, out = jax.lax.scan(step, jnp.zeros((h, d, d), x.dtype), (r, k, v))  # (T, H, D)
        out = jax.vmap(self.ln_x)(out.reshape(t, c))
        return jax.vmap(self.output)(out)


class ChannelMix(eqx.Module):
    mix: jax.Array  # (2, C)
    key: eqx.nn.Linear
    value: eqx.nn.Linear
    receptance: eqx.nn.Linear

    def __init__(self, c, key):
        k = jax.random.split(key, 4)
        self.mix = jax.random.uniform(k[0], (2, c))
        self.key, self.value, self.receptance = _lin(c, 4 * c, k[1]), _lin(4 * c, c, k[2]), _lin(c, c, k[3])

    def __call__(self, x):
        prev = jnp.concatenate([jnp.zeros_like(x[:1]), x[:-1]])
        xk, xr = (x * m[None] + prev * (1 - m[None]) for m in self.mix)
        kk = jnp.square(jax.nn.relu(jax.vmap(self.key)(xk)))
        return jax.nn.sigmoid(jax.vmap(self.receptance)(xr)) * jax.vmap(self.value)(kk)


class RWKVBlock(eqx.Module):
    ln1: jax.Array
    ln2: jax.Array
    att: TimeMix
    ffn: ChannelMix

    def __init__(self, c, heads, key):
        k1, k2 = jax.random.split(key)
        self.ln1, self.ln2 = jnp.ones(c), jnp.ones(c)
        self.att, self.ffn = TimeMix(c, heads, k1), ChannelMix(c, k2)

    def __call__(self, x):
        x = x + self.att(_norm(x, self.ln1))
        return x + self.ffn(_norm(x, self.ln2))


class RWKV(eqx.Module):
    emb: eqx.nn.Embedding
    blocks: list
    ln_out: jax.Array
    head: eqx.nn.Linear

    def __init__(self, vocab=64, c=32, heads=4, layers=2, *, key):
        k = jax.random.split(key, layers + 2)
        self.emb = eqx.nn.Embedding(vocab, c, key=k[0])
        self.blocks = [RWKVBlock(c, heads, kk) for kk in k[1:-1]]
        self.ln_out = jnp.ones(c)
        self.head = _lin(c, vocab, k[-1])

    def __call__(self, tokens):
        x = jax.vmap(self.emb)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(_norm(x, self.ln_out))


def token_loss(model, batch, key):
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


# -- UNet -------------------------------------------------------------------------------------


def _silu(x):
    return jax.nn.silu(x)


class ResBlock(eqx.Module):
    norm1: eqx.nn.GroupNorm
    conv1: eqx.nn.Conv2d
    time: eqx.nn.Linear
    norm2: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d
    skip: eqx.nn.Conv2d | None

    def __init__(self, cin, cout, tdim, key):
        k = jax.random.split(key, 4)
        self.norm1, self.norm2 = eqx.nn.GroupNorm(4, cin), eqx.nn.GroupNorm(4, cout)
        self.conv1 = eqx.nn.Conv2d(cin, cout, 3, padding=1, key=k[0])
        self.time = eqx.nn.Linear(tdim, cout, key=k[1])
        self.conv2 = eqx.nn.Conv2d(cout, cout, 3, padding=1, key=k[2])
        self.skip = eqx.nn.Conv2d(cin, cout, 1, key=k[3]) if cin != cout else None

    def __call__(self, x, temb):  # (C, H, W), (tdim,)
        h = self.conv1(_silu(self.norm1(x)))
        h = h + self.time(_silu(temb))[:, None, None]
        h = self.conv2(_silu(self.norm2(h)))
        return (x if self.skip is None else self.skip(x)) + h


class AttnBlock(eqx.Module):
    norm: eqx.nn.GroupNorm
    q: eqx.nn.Conv2d
    k: eqx.nn.Conv2d
    v: eqx.nn.Conv2d
    proj_out: eqx.nn.Conv2d
    heads: int = eqx.field(static=True)

    def __init__(self, c, heads, key):
        k = jax.random.split(key, 4)
        self.norm = eqx.nn.GroupNorm(4, c)
        self.q, self.k, self.v, self.proj_out = (eqx.nn.Conv2d(c, c, 1, key=kk) for kk in k)
        self.heads = heads

    def __call__(self, x):  # (C, H, W)
        c, hh, ww = x.shape
        h = self.norm(x)
        q, k, v = (f(h).reshape(self.heads, c // self.heads, hh * ww) for f in (self.q, self.k, self.v))
        att = jax.nn.softmax(jnp.einsum("hdi,hdj->hij", q, k) / math.sqrt(c // self.heads), axis=-1)
        out = jnp.einsum("hij,hdj->hdi", att, v).reshape(c, hh, ww)
        return x + self.proj_out(out)


class UNet(eqx.Module):
    time1: eqx.nn.Linear
    time2: eqx.nn.Linear
    conv_in: eqx.nn.Conv2d
    down: ResBlock
    downsample: eqx.nn.Conv2d
    mid1: ResBlock
    attn: AttnBlock
    mid2: ResBlock
    upsample: eqx.nn.ConvTranspose2d
    up: ResBlock
    norm_out: eqx.nn.GroupNorm
    conv_out: eqx.nn.Conv2d

    def __init__(self, c=16, *, key):
        k = jax.random.split(key, 11)
        tdim = 4 * c
        self.time1, self.time2 = eqx.nn.Linear(c, tdim, key=k[0]), eqx.nn.Linear(tdim, tdim, key=k[1])
        self.conv_in = eqx.nn.Conv2d(3, c, 3, padding=1, key=k[2])
        self.down = ResBlock(c, c, tdim, k[3])
        self.downsample = eqx.nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, key=k[4])
        self.mid1 = ResBlock(2 * c, 2 * c, tdim, k[5])
        self.attn = AttnBlock(2 * c, 4, k[6])
        self.mid2 = ResBlock(2 * c, 2 * c, tdim, k[7])
        self.upsample = eqx.nn.ConvTranspose2d(2 * c, c, 2, stride=2, key=k[8])
        self.up = ResBlock(2 * c, c, tdim, k[9])
        self.norm_out = eqx.nn.GroupNorm(4, c)
        self.conv_out = eqx.nn.Conv2d(c, 3, 3, padding=1, key=k[10])

    def __call__(self, x, t):  # (3, H, W), ()
        half = self.time1.in_features // 2
        freqs = jnp.exp(-math.log(1000.0) * jnp.arange(half) / half)
        temb = jnp.concatenate([jnp.sin(t * freqs), jnp.cos(t * freqs)])
        temb = self.time2(_silu(self.time1(temb)))
        h0 = self.down(self.conv_in(x), temb)
        h = self.mid1(self.downsample(h0), temb)
        h = self.mid2(self.attn(h), temb)
        h = self.up(jnp.concatenate([self.upsample(h), h0]), temb)
        return self.conv_out(_silu(self.norm_out(h)))


def noise_loss(model, batch, key):
    pred = jax.vmap(model)(batch["noisy"], batch["t"])
    return jnp.mean((pred - batch["noise"]) ** 2)


# -- Mamba ------------------------------------------------------------------------------------


class Mixer(eqx.Module):
    in_proj: eqx.nn.Linear
    conv: jax.Array  # (E, K): causal depthwise taps
    x_proj: eqx.nn.Linear
    dt_proj: eqx.nn.Linear
    A_log: jax.Array  # (E, N)
    D: jax.Array  # (E,)
    out_proj: eqx.nn.Linear
    rank: int = eqx.field(static=True)

    def __init__(self, c, expand=2, state=8, rank=4, taps=4, *, key):
        e = expand * c
        k = jax.random.split(key, 5)
        self.in_proj = _lin(c, 2 * e, k[0])
        self.conv = 0.3 * jax.random.normal(k[1], (e, taps))
        self.x_proj = _lin(e, rank + 2 * state, k[2])
        self.dt_proj = eqx.nn.Linear(rank, e, key=k[3])
        self.A_log = jnp.log(jnp.tile(jnp.arange(1, state + 1, dtype=jnp.float32), (e, 1)))
        self.D = jnp.ones(e)
        self.out_proj = _lin(e, c, k[4])
        self.rank = rank

    def __call__(self, x):  # (T, C)
        t = x.shape[0]
        xs, z = jnp.split(jax.vmap(self.in_proj)(x), 2, axis=-1)  # (T, E) each
        taps = self.conv.shape[1]
        padded = jnp.concatenate([jnp.zeros((taps - 1, xs.shape[1]), xs.dtype), xs])
        xs = jax.nn.silu(sum(padded[i:i + t] * self.conv[:, i][None] for i in range(taps)))
        n = self.A_log.shape[1]
        dbc = jax.vmap(self.x_proj)(xs)
        dt, b, c = dbc[:, :self.rank], dbc[:, self.rank:self.rank + n], dbc[:, self.rank + n:]
        dt = jax.nn.softplus(jax.vmap(self.dt_proj)(dt))  # (T, E)
        a = -jnp.exp(self.A_log)

        def step(h, inp):  # h (E, N)
            dt_t, b_t, c_t, x_t = inp
            h = jnp.exp(dt_t[:, None] * a) * h + (dt_t * x_t)[:, None] * b_t[None, :]
            return h, h @ c_t + self.D * x_t

        _, y = jax.lax.scan(step, jnp.zeros_like(a), (dt, b, c, xs))
        return jax.vmap(self.out_proj)(y * jax.nn.silu(z))


class MambaBlock(eqx.Module):
    norm: jax.Array
    mixer: Mixer

    def __init__(self, c, key):
        self.norm, self.mixer = jnp.ones(c), Mixer(c, key=key)

    def __call__(self, x):
        return x + self.mixer(_norm(x, self.norm))


class Mamba(eqx.Module):
    emb: eqx.nn.Embedding
    blocks: list
    norm: jax.Array
    head: eqx.nn.Linear

    def __init__(self, vocab=64, c=32, layers=2, *, key):
        k = jax.random.split(key, layers + 2)
        self.emb = eqx.nn.Embedding(vocab, c, key=k[0])
        self.blocks = [MambaBlock(c, kk) for kk in k[1:-1]]
        self.norm = jnp.ones(c)
        self.head = _lin(c, vocab, k[-1])

    def __call__(self, tokens):
        x = jax.vmap(self.emb)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(_norm(x, self.norm))


# -- batches and hand plans ---------------------------------------------------------------------

_RNG = np.random.default_rng(0)
TOKENS = {"tokens": _RNG.integers(0, 64, (16, 17)).astype(np.int32)}
IMAGES = {"noisy": _RNG.normal(size=(16, 3, 8, 8)).astype(np.float32),
          "noise": _RNG.normal(size=(16, 3, 8, 8)).astype(np.float32),
          "t": _RNG.uniform(0, 100, 16).astype(np.float32)}

# What a person would write by hand, Megatron-style: column then row in each block, attention's
# Q/K/V on whole heads and its output row parallel, vocabulary-split embedding and head; norms
# (GroupNorm included: its statistics span each group's channels and every position) whole.
HAND = {
    "rwkv": [(r"att\.(receptance|key|value)\.", COL), (r"att\.output\.", ROW), (r"att\.(decay|bonus)", COL),
             (r"att\.ln_x\.", P("model")), (r"ffn\.key\.", COL), (r"ffn\.value\.", ROW),
             (r"^(emb|head)\.", COL)],
    "unet": [(r"time1\.weight", COL), (r"time1\.bias", P("model")), (r"time2\.weight", ROW),
             (r"attn\.(q|k|v)\.weight", COL4), (r"attn\.(q|k|v)\.bias", P("model", None, None)),
             (r"attn\.proj_out\.weight", ROW4)],
    "mamba": [(r"in_proj\.", COL), (r"out_proj\.", ROW), (r"^(emb|head)\.", COL)],
}
MODELS = {
    "rwkv": (lambda key: RWKV(key=key), token_loss, TOKENS),
    "unet": (lambda key: UNet(key=key), noise_loss, IMAGES),
    "mamba": (lambda key: Mamba(key=key), token_loss, TOKENS),
}
