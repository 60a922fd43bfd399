"""A weight the program keeps whole for want of a partner, split alone on its input features where
that costs clearly less (`redeqx.sharding._decide._Decider._split_alone`): DiT's adaLN modulation,
a large matrix applied to one conditioning vector an example whose output `jnp.split` cuts into
shifts, scales and gates for a stream that is not split. It is a third of a DiT's weights; whole,
every device held and updated all of it."""

import math
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from redeqx.sharding import _decide
from test_rules_cells_convs import assert_trains_as_one_device


def _modulated(x, shift, scale):  # a LayerNorm without its own scale, then the condition's
    mean = x.mean(-1, keepdims=True)
    normed = (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
    return normed * (1 + scale[None]) + shift[None]


class DiTBlock(eqx.Module):
    """adaLN-Zero as DiT's authors write it: a fused QKV cut by index, an MLP, and one modulation
    Linear whose output is six vectors."""

    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    modulation: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    interleaved: bool = eqx.field(static=True)  # q, k, v an inner dim, (heads, 3, head_dim): the layout that splits

    def __init__(self, d, key, heads=4, interleaved=False):
        k = jax.random.split(key, 5)
        self.qkv, self.proj = eqx.nn.Linear(d, 3 * d, key=k[0]), eqx.nn.Linear(d, d, key=k[1])
        self.fc1, self.fc2 = eqx.nn.Linear(d, 4 * d, key=k[2]), eqx.nn.Linear(4 * d, d, key=k[3])
        self.modulation, self.heads, self.interleaved = eqx.nn.Linear(d, 6 * d, key=k[4]), heads, interleaved

    def __call__(self, x, c):  # (T, D), (D,)
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(self.modulation(jax.nn.silu(c)), 6)
        t, d = x.shape
        qkv = jax.vmap(self.qkv)(_modulated(x, shift1, scale1))
        if self.interleaved:
            qkv = qkv.reshape(t, self.heads, 3, d // self.heads)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            qkv = qkv.reshape(t, 3, self.heads, d // self.heads)
            q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        scores = jnp.einsum("thd,shd->hts", q, k) / math.sqrt(d // self.heads)
        attended = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores), v).reshape(t, d)
        x = x + gate1[None] * jax.vmap(self.proj)(attended)
        h = jax.vmap(self.fc1)(_modulated(x, shift2, scale2))
        return x + gate2[None] * jax.vmap(self.fc2)(jax.nn.gelu(h))


class DiT(eqx.Module):
    """Patch features in, noise out: a stem, a timestep MLP plus a class's embedding, ``depth`` blocks (listed, or built once
    with `eqx.filter_vmap` and run by `lax.scan`), a final modulation and head."""

    stem: eqx.nn.Linear
    time1: eqx.nn.Linear
    time2: eqx.nn.Linear
    classes: eqx.nn.Embedding
    blocks: object
    final_modulation: eqx.nn.Linear
    head: eqx.nn.Linear
    stacked: bool = eqx.field(static=True)

    def __init__(self, d, *, key, depth=2, features=16, stacked=False, interleaved=False):
        k = jax.random.split(key, 7)
        self.classes = eqx.nn.Embedding(10, d, key=k[6])
        self.stem, self.head = eqx.nn.Linear(features, d, key=k[0]), eqx.nn.Linear(d, features, key=k[1])
        self.time1, self.time2 = eqx.nn.Linear(32, d, key=k[2]), eqx.nn.Linear(d, d, key=k[3])
        keys = jax.random.split(k[4], depth)
        block = lambda kk: DiTBlock(d, kk, interleaved=interleaved)  # noqa: E731
        self.blocks = eqx.filter_vmap(block)(keys) if stacked else [block(kk) for kk in keys]
        self.final_modulation, self.stacked = eqx.nn.Linear(d, 2 * d, key=k[5]), stacked

    def __call__(self, x, t, label):  # (T, F), (), () -> (T, F)
        freqs = jnp.exp(-math.log(1e4) * jnp.arange(16) / 16) * t
        c = self.time2(jax.nn.silu(self.time1(jnp.concatenate([jnp.cos(freqs), jnp.sin(freqs)])))) + self.classes(label)
        h = jax.vmap(self.stem)(x)
        if self.stacked:
            params, static = eqx.partition(self.blocks, eqx.is_array)
            h, _ = jax.lax.scan(lambda h, p: (eqx.combine(p, static)(h, c), None), h, params)
        else:
            for block in self.blocks:
                h = block(h, c)
        shift, scale = jnp.split(self.final_modulation(jax.nn.silu(c)), 2)
        return jax.vmap(self.head)(_modulated(h, shift, scale))


def noise_loss(model, batch, key):
    return jnp.mean((jax.vmap(model)(batch["x"], batch["t"], batch["label"]) - batch["noise"]) ** 2)


def noisy_patches(rows=8, tokens=16, features=16, abstract=True):
    shapes = {"x": (rows, tokens, features), "t": (rows,), "noise": (rows, tokens, features)}
    if abstract:
        batch = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
        return {**batch, "label": jax.ShapeDtypeStruct((rows,), jnp.int32)}
    rng = np.random.default_rng(0)
    batch = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    return {**batch, "label": rng.integers(0, 10, rows).astype(np.int32)}


def _modulations(specs, stacked):
    """Each modulation's (weight, bias), a stack's without its layer axis."""
    blocks, layer = ([specs.blocks], 1) if stacked else (specs.blocks, 0)
    lone = [(tuple(b.modulation.weight)[layer:], tuple(b.modulation.bias)[layer:]) for b in blocks]
    return lone + [(tuple(specs.final_modulation.weight), tuple(specs.final_modulation.bias))]


@pytest.mark.parametrize("stacked", [False, True], ids=["listed", "stacked"])
def test_a_dit_splits_its_modulation_alone_on_its_input(stacked):
    """At a DiT-XL's width, each adaLN modulation (6 x 1152 x 1152) is split on its input features:
    its output is summed over 'model' (whole again for the stream), the weight, its update and its
    products divided. Before: whole, `jnp.split` cutting its output features (`benchmarks/
    plans_vs_hand.py`, an SGD step: 1.29x / 1.65x the collective bytes and 1.38x / 1.80x the peak
    memory of this plan at 2 / 4 shards). The fused QKV, cut by index over every token, stays
    whole, and the MLP is Megatron's pair. The warning says the QKV's layout that splits: laid out
    (heads, 3, head_dim), the rules split the attention per head, 0.84x / 0.64x the bytes, 0.76x /
    0.51x the FLOPs and 0.74x / 0.53x the peak memory at 2 / 4 shards (`benchmarks/fused_layouts.py`;
    before, a block partly split was never said)."""
    model = eqx.filter_eval_shape(lambda: DiT(1152, key=jax.random.key(0), stacked=stacked))
    layer = (None,) if stacked else ()
    for n in (2, 4):
        mesh = redeqx.make_mesh(n)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            specs = redeqx.sharding_rules(model, mesh, loss_fn=noise_loss, batch=noisy_patches())
        assert len(caught) == 1 and "(..., heads, 3, head_dim) for attention" in str(caught[0].message), caught
        assert _modulations(specs, stacked) == [((None, "model"), ())] * (2 if stacked else 3), (n, stacked)
        blocks = specs.blocks if stacked else specs.blocks[0]
        assert blocks.qkv.weight == P() and blocks.proj.weight == P(), (n, stacked)
        assert (blocks.fc1.weight, blocks.fc2.weight) == (P(*layer, "model", None), P(*layer, None, "model"))
        row = next(r for r in redeqx.explain(model, specs, mesh, loss_fn=noise_loss, batch=noisy_patches(),
                                             reasons="full").splitlines() if r.startswith("final_modulation.weight"))
        assert "jnp.split cuts its output features" in row and "but split alone on dim 1" in row, row
        assert "collective(s) more" in row, row


def test_a_small_modulation_or_a_loop_s_weight_stays_whole():
    """Where the split would save a small model a few hundred KiB a step, a collective's start
    (`COLLECTIVE_BYTES`) outweighs it: whole, as before. A recurrent cell's weights, read every
    trip of a scan over tokens, stay whole at any width (a collective a trip), and no warning says
    a split would cost less: it would sum the state every token."""
    model = eqx.filter_eval_shape(lambda: DiT(128, key=jax.random.key(0)))
    specs = redeqx.sharding_rules(model, redeqx.make_mesh(2), loss_fn=noise_loss, batch=noisy_patches())
    assert all(weight == () for weight, _ in _modulations(specs, False))

    class Recurrent(eqx.Module):
        cell: eqx.nn.GRUCell

        def __call__(self, xs):
            return jax.lax.scan(lambda h, x: (self.cell(x, h), None), jnp.zeros(2048), xs)[0]

    rnn = eqx.filter_eval_shape(lambda: Recurrent(eqx.nn.GRUCell(2048, 2048, key=jax.random.key(0))))
    tokens = {"x": jax.ShapeDtypeStruct((2, 64, 2048), jnp.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        specs = redeqx.sharding_rules(rnn, redeqx.make_mesh(2), batch=tokens,
                                      loss_fn=lambda m, b, k: jax.vmap(m)(b["x"]).sum())
    assert specs.cell.weight_ih == specs.cell.weight_hh == P()


@pytest.mark.slow
def test_a_modulation_split_alone_trains_as_on_one_device(devices, monkeypatch):
    """Two SGD steps with each modulation split alone (at 128 wide, where only a collective's start
    keeps it whole: counted as free here) give one device's losses and weights."""
    monkeypatch.setattr(_decide, "COLLECTIVE_BYTES", 0)
    model, batch = DiT(128, key=jax.random.key(0)), noisy_patches(abstract=False)
    for n in (2, 4):
        specs = redeqx.sharding_rules(model, redeqx.make_mesh(n), loss_fn=noise_loss, batch=batch)
        assert all(weight == (None, "model") for weight, _ in _modulations(specs, False)), n
    assert_trains_as_one_device(model, batch, devices, rules={"loss_fn": noise_loss, "batch": batch}, loss=noise_loss)


def test_a_lone_layer_split_alone_is_not_warned_as_unsplit():
    """One wide Linear fitted to targets: whole, the rules warned that they split none of the weights
    the program contracts; now it is split alone on its input features, and nothing is warned."""
    model = eqx.filter_eval_shape(lambda: eqx.nn.Linear(2048, 2048, key=jax.random.key(0)))
    pairs = {"x": jax.ShapeDtypeStruct((8, 2048), jnp.float32), "y": jax.ShapeDtypeStruct((8, 2048), jnp.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        specs = redeqx.sharding_rules(model, redeqx.make_mesh(2), batch=pairs,
                                      loss_fn=lambda m, b, k: jnp.mean((jax.vmap(m)(b["x"]) - b["y"]) ** 2))
    assert (specs.weight, specs.bias) == (P(None, "model"), P())
