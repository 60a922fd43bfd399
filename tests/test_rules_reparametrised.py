"""Weights a model reparametrises before using them: weight normalisation (`eqx.nn.WeightNorm`,
the audio codecs' and vocoders' convolutions), weight standardisation (BiT's kernels, written by
hand) and spectral normalisation (`eqx.nn.SpectralNorm`, a GAN's discriminator, with its power
iteration in the model state). The program reader follows the weight through its own statistics
(`g * v / |v|`, `(w - mean w) / std w`, `w / (u @ w @ v)`, the reshape to `(out, -1)` and back) to
the product that uses it, so each block is split as Megatron's plan splits it, and the power
iteration's products are no use of the weight. DoRA's adapted weight, normalised per row, splits
as LoRA's does; a cosine-softmax head's normalised class vectors are split on the classes, as a
vocabulary-parallel head. A Bayesian layer's sampled weight, ``mu + softplus(rho) * eps``, splits
``mu`` and ``rho`` alike. Before, the statistics read as an activation: the layers fell back to
their names (each WeightNorm's layer column parallel: 4.2x / 5.1x a hand plan's bytes for the
vocoder at 2 / 4 shards), or the power iteration read as a second use of each weight (the
discriminator: 2.2x / 3.8x), or nothing was split (nGPT, the cosine head, the Bayesian layers). Figures:
benchmarks/plans_vs_hand.py."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from accelerator_count import compiled_train_step, trained_against_one_device

C = 16


class WeightNormMLP(eqx.Module):
    fc1: eqx.nn.WeightNorm
    fc2: eqx.nn.WeightNorm

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.WeightNorm(eqx.nn.Linear(8, 64, key=k1))
        self.fc2 = eqx.nn.WeightNorm(eqx.nn.Linear(64, 4, key=k2))

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class VocoderUnit(eqx.Module):
    """A residual unit of weight-normalised 1-D convolutions (HiFi-GAN, EnCodec, DAC)."""

    wide: eqx.nn.WeightNorm
    back: eqx.nn.WeightNorm

    def __init__(self, c, key):
        k1, k2 = jax.random.split(key)
        self.wide = eqx.nn.WeightNorm(eqx.nn.Conv1d(c, 4 * c, 7, padding=3, key=k1))
        self.back = eqx.nn.WeightNorm(eqx.nn.Conv1d(4 * c, c, 1, key=k2))

    def __call__(self, x):
        return x + self.back(jax.nn.gelu(self.wide(x)))


class Vocoder(eqx.Module):
    inp: eqx.nn.WeightNorm
    units: list
    out: eqx.nn.WeightNorm

    def __init__(self, key, c=C):
        k = jax.random.split(key, 4)
        self.inp = eqx.nn.WeightNorm(eqx.nn.Conv1d(1, c, 7, padding=3, key=k[0]))
        self.units = [VocoderUnit(c, kk) for kk in k[1:3]]
        self.out = eqx.nn.WeightNorm(eqx.nn.Conv1d(c, 1, 7, padding=3, key=k[3]))

    def __call__(self, x):
        h = self.inp(x)
        for unit in self.units:
            h = unit(h)
        return self.out(h)


def _standardised(w):
    mean, var = w.mean(axis=(1, 2, 3), keepdims=True), w.var(axis=(1, 2, 3), keepdims=True)
    return (w - mean) / jnp.sqrt(var + 1e-5)


class StandardisedBlock(eqx.Module):
    """BiT's pre-activation block with weight-standardised kernels, stored as raw arrays."""

    w1: jax.Array
    w2: jax.Array
    norm: eqx.nn.GroupNorm

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w1 = 0.1 * jax.random.normal(k1, (4 * C, C, 3, 3))
        self.w2 = 0.1 * jax.random.normal(k2, (C, 4 * C, 3, 3))
        self.norm = eqx.nn.GroupNorm(8, 4 * C)

    def __call__(self, x):
        conv = lambda x, w: jax.lax.conv_general_dilated(x[None], _standardised(w), (1, 1), "SAME")[0]  # noqa: E731
        return x + conv(jax.nn.relu(self.norm(conv(jax.nn.relu(x), self.w1))), self.w2)


class Discriminator(eqx.Module):
    """A GAN discriminator with spectral normalisation on every conv (its power iteration's u, v
    live in the model state)."""

    stem: eqx.nn.SpectralNorm
    wide: eqx.nn.SpectralNorm
    back: eqx.nn.SpectralNorm
    head: eqx.nn.Linear

    def __init__(self, key, c=C):
        k = jax.random.split(key, 7)
        conv = lambda i, o, kk: eqx.nn.Conv2d(i, o, 3, padding=1, key=kk)  # noqa: E731
        self.stem = eqx.nn.SpectralNorm(conv(3, c, k[0]), "weight", key=k[1])
        self.wide = eqx.nn.SpectralNorm(conv(c, 4 * c, k[2]), "weight", key=k[3])
        self.back = eqx.nn.SpectralNorm(conv(4 * c, c, k[4]), "weight", key=k[5])
        self.head = eqx.nn.Linear(c, 1, key=k[6])

    def __call__(self, x, state):
        for layer in (self.stem, self.wide, self.back):
            x, state = layer(x, state)
            x = jax.nn.leaky_relu(x, 0.2)
        return self.head(x.mean((1, 2)))[0], state


class DoRALinear(eqx.Module):
    """DoRA (weight-decomposed low-rank adaptation), by hand: ``m * (W + B A) / |W + B A|``, the
    norm per output row."""

    w: jax.Array
    m: jax.Array
    a: jax.Array
    b: jax.Array

    def __init__(self, n_in, n_out, key, rank=4):
        k1, k2 = jax.random.split(key)
        self.w = jax.random.normal(k1, (n_out, n_in)) / np.sqrt(n_in)
        self.m = jnp.linalg.norm(self.w, axis=1)
        self.a, self.b = 0.01 * jax.random.normal(k2, (rank, n_in)), jnp.zeros((n_out, rank))

    def __call__(self, x):
        v = self.w + self.b @ self.a
        return (self.m[:, None] * v / jnp.linalg.norm(v, axis=1, keepdims=True)) @ x


class DoRAMLP(eqx.Module):
    fc1: DoRALinear
    fc2: DoRALinear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.fc1, self.fc2 = DoRALinear(8, 64, k1), DoRALinear(64, 4, k2)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class CosineClassifier(eqx.Module):
    """A cosine-softmax head over many classes (NormFace, ArcFace): features and class vectors
    normalised, their products scaled."""

    body: eqx.nn.MLP
    classes: jax.Array

    def __init__(self, key, classes=512, width=32):
        k1, k2 = jax.random.split(key)
        self.body = eqx.nn.MLP(8, width, 2 * width, 1, key=k1)
        self.classes = jax.random.normal(k2, (classes, width))

    def __call__(self, x):
        h = self.body(x)
        w = self.classes / jnp.linalg.norm(self.classes, axis=1, keepdims=True)
        return 16.0 * (w @ (h / jnp.linalg.norm(h)))


def _unit(x, axis=-1):
    return x / jnp.linalg.norm(x, axis=axis, keepdims=True)


class NormalizedBlock(eqx.Module):
    """nGPT's block (Loshchilov et al., 2024): each matrix normalised along the embedding dim where it
    is used, hidden states kept on the unit sphere, learned scales on q/k and the gated MLP."""

    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    wu: jax.Array
    wg: jax.Array
    wd: jax.Array
    s_qk: jax.Array
    s_u: jax.Array
    s_v: jax.Array
    alpha: jax.Array
    heads: int = eqx.field(static=True)

    def __init__(self, d, heads, hidden, key):
        k = jax.random.split(key, 7)
        self.wq, self.wk, self.wv, self.wu, self.wg = (
            jax.random.normal(kk, (n, d)) for kk, n in zip(k, (d, d, d, hidden, hidden)))
        self.wo, self.wd = jax.random.normal(k[5], (d, d)), jax.random.normal(k[6], (d, hidden))
        self.s_qk, self.s_u, self.s_v = jnp.ones((heads, d // heads)), jnp.ones(hidden), jnp.ones(hidden)
        self.alpha, self.heads = jnp.full((2, d), 0.05), heads

    def __call__(self, h):  # (T, d)
        t, d = h.shape
        q, k, v = ((h @ _unit(w, 1).T).reshape(t, self.heads, -1) for w in (self.wq, self.wk, self.wv))
        a = jax.nn.dot_product_attention(_unit(q) * self.s_qk[None], _unit(k) * self.s_qk[None], v, is_causal=True)
        h = _unit(h + self.alpha[None, 0] * (_unit(a.reshape(t, d) @ _unit(self.wo, 0).T) - h))
        u, g = (h @ _unit(self.wu, 1).T) * self.s_u[None], (h @ _unit(self.wg, 1).T) * self.s_v[None]
        return _unit(h + self.alpha[None, 1] * (_unit((u * jax.nn.silu(g)) @ _unit(self.wd, 0).T) - h))


class NormalizedGPT(eqx.Module):
    embed: jax.Array
    unembed: jax.Array
    blocks: list
    s_z: jax.Array

    def __init__(self, key, vocab=64, d=32, heads=4, hidden=64, layers=2):
        k = jax.random.split(key, 3)
        self.embed, self.unembed = jax.random.normal(k[0], (vocab, d)), jax.random.normal(k[1], (vocab, d))
        self.blocks = [NormalizedBlock(d, heads, hidden, kk) for kk in jax.random.split(k[2], layers)]
        self.s_z = jnp.ones(vocab)

    def __call__(self, ids):
        h = _unit(self.embed, 1)[ids]
        for block in self.blocks:
            h = block(h)
        return (h @ _unit(self.unembed, 1).T) * self.s_z[None]


def next_token(model, batch, key):
    logits = jax.vmap(model)(batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


def mse(model, batch, key):
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)


def xent(model, batch, key):
    return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(batch["x"]), batch["y"]).mean()


def gan_loss(model, batch, key, model_state):
    logits, model_state = jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(
        batch["x"], model_state)
    return optax.sigmoid_binary_cross_entropy(logits, batch["real"]).mean(), model_state


def _rows(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


COL, ROW = "column", "row"
CASES = {
    # name: (model, batch, {path: role}); every other leaf whole
    "weight norm mlp": (lambda: WeightNormMLP(jax.random.key(0)), {"x": _rows(8, 8), "y": _rows(8, 4)},
                        {"fc1.layer.weight": COL, "fc1.layer.bias": COL, "fc1.g": COL, "fc2.layer.weight": ROW}),
    "weight norm convs": (lambda: Vocoder(jax.random.key(0)), {"x": _rows(8, 1, 32), "y": _rows(8, 1, 32)},
                          {f"units.{i}.{p}": r for i in (0, 1) for p, r in
                           (("wide.layer.weight", COL), ("wide.layer.bias", COL), ("wide.g", COL),
                            ("back.layer.weight", ROW))}),
    "weight standardisation": (lambda: StandardisedBlock(jax.random.key(0)),
                               {"x": _rows(8, C, 8, 8), "y": _rows(8, C, 8, 8)},
                               {"w1": COL, "norm.weight": COL, "norm.bias": COL, "w2": ROW}),
    # LoRA's plan (B follows a column layer's output, A a row layer's input) with the magnitudes
    # following the column layer's output (was 2.1x its bytes at 2 shards)
    "DoRA": (lambda: DoRAMLP(jax.random.key(0)), {"x": _rows(8, 8), "y": _rows(8, 4)},
             {"fc1.w": COL, "fc1.m": COL, "fc1.b": COL, "fc2.w": ROW, "fc2.a": ROW}),
    # Megatron's blocks, each scale following its projection, the embedding and head on the vocabulary
    # (nothing was split: 1.3x a hand plan's bytes and 1.6x / 2.9x its FLOPs at 2 / 4 shards, 128 wide)
    "nGPT": (lambda: NormalizedGPT(jax.random.key(0)), {"ids": np.random.default_rng(0).integers(0, 64, (8, 9))},
             {"embed": COL, "unembed": COL, "s_z": COL, **{f"blocks.{i}.{p}": r for i in (0, 1) for p, r in (
                 ("wq", COL), ("wk", COL), ("wv", COL), ("wu", COL), ("wg", COL), ("s_qk", COL), ("s_u", COL),
                 ("s_v", COL), ("wo", ROW), ("wd", ROW))}}),
    # the class vectors split on the classes, as a vocabulary-parallel head (was whole: 1.9x / 3.7x a
    # hand plan's FLOPs and 2.0x / 3.8x its peak at 2 / 4 shards, at 4,096 classes)
    "cosine classifier": (lambda: CosineClassifier(jax.random.key(0)),
                          {"x": _rows(8, 8), "y": np.arange(8) * 60},
                          {"body.layers.0.weight": COL, "body.layers.0.bias": COL, "body.layers.1.weight": ROW,
                           "classes": COL}),
}


def _spec(role, ndim):
    if role is None:
        return P()
    return P("model", *[None] * (ndim - 1)) if role == COL else P(None, "model", *[None] * (ndim - 2))


def _paths_and_specs(model, specs):
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
    flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return {".".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in path): (leaf.ndim, spec)
            for (path, leaf), spec in zip(leaves, flat)}


def _check_megatron(model, specs, roles):
    for path, (ndim, spec) in _paths_and_specs(model, specs).items():
        want = _spec(roles.get(path), ndim)
        assert tuple(spec) + (None,) * (ndim - len(spec)) == tuple(want) + (None,) * (ndim - len(want)), \
            (path, spec, want)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("n", [2, 4])
def test_a_reparametrised_weight_is_split_as_megatron_splits_it(name, n):
    build, batch, roles = CASES[name]
    model = build()
    loss = next_token if "ids" in batch else xent if batch["y"].dtype.kind == "i" else mse
    specs = redeqx.sharding_rules(model, redeqx.make_mesh(n), loss_fn=loss, batch=batch)
    _check_megatron(model, specs, roles)


def test_explain_says_a_gain_on_a_whole_output_stays_whole():
    """The row layer's `g` read as a "matmul contracting dims () with its input", replicated for a
    "competing block"."""
    model, mesh = WeightNormMLP(jax.random.key(0)), redeqx.make_mesh(2)
    batch = {"x": _rows(8, 8), "y": np.arange(8) % 4}
    specs = redeqx.sharding_rules(model, mesh, loss_fn=xent, batch=batch)
    line = next(x for x in redeqx.explain(model, specs, mesh, loss_fn=xent, batch=batch).splitlines()
                if x.startswith("fc2.g "))
    assert "replicated: a gain on a whole output" in line, line


def test_spectral_norm_splits_its_conv_pair_and_trains_as_one_device():
    model, model_state = eqx.nn.make_with_state(Discriminator)(jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = {"x": _rows(8, 3, 8, 8), "real": rng.integers(0, 2, 8).astype(np.float32)}
    optimizer = optax.sgd(0.1)
    out = []
    for n, devices in ((2, None), (1, jax.devices()[:1])):
        mesh = redeqx.make_mesh(n, devices=devices)
        specs = redeqx.sharding_rules(model, mesh, loss_fn=gan_loss, batch=batch, model_state=model_state)
        if n == 2:  # the power iteration's products are no use: the wide conv column, the next row
            _check_megatron(model, specs, {"wide.layer.weight": COL, "wide.layer.bias": COL,
                                           "back.layer.weight": ROW})
        state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1), model_state=model_state)
        step = redeqx.make_train_step(gan_loss, optimizer, mesh, specs)
        for _ in range(2):
            state, _ = step(state, batch)
        out.append(state)
    split, one = out
    for a, b in zip(jax.tree.leaves(eqx.filter(split.model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(one.model, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(split.model_state), jax.tree.leaves(one.model_state)):  # the power iteration
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


class LearnedQueries(eqx.Module):
    """DETR's decoder: its first self-attention reads learned queries added to zeros, no data."""

    queries: jax.Array
    attn: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.queries = jax.random.normal(k1, (4, 32))
        self.attn = eqx.nn.MultiheadAttention(4, 32, key=k2)
        self.head = eqx.nn.Linear(32, 4, key=k3)

    def __call__(self, x):
        q = jnp.zeros((4, 32)) + self.queries
        return jax.vmap(self.head)(q + self.attn(q, q, q)).sum(0) * x[:4]


def test_values_made_of_weights_alone_with_rows_of_their_own_are_an_activation():
    """A product of a weight with weights alone is still weights (a merged adapter, spectral
    normalisation's power iteration) only where it contracts every dim they have of their own:
    DETR's queries (4 of them, a row each) are what its projections act on, split per head."""
    model = LearnedQueries(jax.random.key(0))
    specs = redeqx.sharding_rules(model, redeqx.make_mesh(2), loss_fn=mse, batch={"x": _rows(8, 8), "y": _rows(8, 4)})
    projections = (specs.attn.query_proj.weight, specs.attn.key_proj.weight, specs.attn.value_proj.weight)
    assert projections == (P("model", None),) * 3
    assert specs.attn.output_proj.weight == P(None, "model")


class BayesLinear(eqx.Module):
    """Bayes by backprop: a weight sampled from ``N(mu, softplus(rho)^2)`` at every call."""

    mu: jax.Array
    rho: jax.Array
    b: jax.Array

    def __init__(self, n_in, n_out, key):
        self.mu = jax.random.normal(key, (n_out, n_in)) / np.sqrt(n_in)
        self.rho, self.b = jnp.full((n_out, n_in), -5.0), jnp.zeros(n_out)

    def __call__(self, x, key):
        return (self.mu + jax.nn.softplus(self.rho) * jax.random.normal(key, self.mu.shape)) @ x + self.b


class BayesMLP(eqx.Module):
    fc1: BayesLinear
    fc2: BayesLinear

    def __init__(self, key, n_in=16, hidden=128, n_out=4):
        k1, k2 = jax.random.split(key)
        self.fc1, self.fc2 = BayesLinear(n_in, hidden, k1), BayesLinear(hidden, n_out, k2)

    def __call__(self, x, key):
        k1, k2 = jax.random.split(key)
        return self.fc2(jax.nn.relu(self.fc1(x, k1)), k2)


def sampled_xent(model, batch, key):
    """One weight sample (or mask) per step for the whole batch."""
    logits = jax.vmap(lambda x: model(x, key))(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def elbo(model, batch, key):
    """With a Gaussian prior's penalty."""
    prior = sum(jnp.sum(jax.nn.softplus(l.rho) ** 2 + l.mu**2) for l in (model.fc1, model.fc2))
    return sampled_xent(model, batch, key) + 1e-4 * prior


class DropConnect(eqx.Module):
    """Raw matrices masked at every call, one with ``*``, one with ``jnp.where`` (a jitted call)."""

    a: jax.Array
    b: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.a, self.b = jax.random.normal(k1, (128, 16)) / 4, jax.random.normal(k2, (4, 128)) / 11

    def __call__(self, x, key):
        k1, k2 = jax.random.split(key)
        a = self.a * jax.random.bernoulli(k1, 0.9, self.a.shape) / 0.9
        b = jnp.where(jax.random.bernoulli(k2, 0.9, self.b.shape), self.b, 0.0) / 0.9
        return b @ jax.nn.relu(a @ x)


def test_a_masked_weight_is_its_weight():
    model, batch = DropConnect(jax.random.key(0)), {"x": _rows(16, 16), "y": np.arange(16) % 4}
    specs = redeqx.sharding_rules(model, redeqx.make_mesh(2), loss_fn=sampled_xent, batch=batch)
    assert (specs.a, specs.b) == (P("model", None), P(None, "model")), specs


def test_a_sampled_weight_splits_its_mean_and_scale_alike_and_trains_as_one_device(devices):
    """``rho`` went through softplus, read as no view of it: kept whole beside a split ``mu`` (once a
    sampled weight read as ``mu``), 2.9x / 4.7x the hand plan's bytes, more than all whole."""
    model, batch = BayesMLP(jax.random.key(0)), {"x": _rows(16, 16), "y": np.arange(16) % 4}
    megatron = {"fc1.mu": COL, "fc1.rho": COL, "fc1.b": COL, "fc2.mu": ROW, "fc2.rho": ROW}
    moved, specs = trained_against_one_device(model, elbo, batch, devices)
    _check_megatron(model, specs, megatron)
    hand = [(r"fc1\.(mu|rho)", P("model", None)), (r"fc1\.b", P("model")), (r"fc2\.(mu|rho)", P(None, "model")),
            (".", P())]
    by_hand, *_ = compiled_train_step(model, elbo, batch, 2, optax.sgd(0.1), overrides=hand)
    assert moved == by_hand, (moved, by_hand)
