"""A model differentiated inside its own loss: a critic's gradient penalty (WGAN-GP), a
discriminator's R1 penalty, a physics-informed net's derivatives, forces as an energy's gradient.

Such a loss runs each weight's transposed product, ``W.T @ g``, beside its ``W @ x``. The transposed
product of a column layer contracts the split its row partner's transposed product makes, as the
outer backward pass does: it is row parallel there, and its output is split where its forward
product's input was. Read as products of their own, each seeded a split on its weight's other dim,
unified with its forward product's (one weight, one split), and every block of the model asked for
its weights split on two dims: all of them stayed whole, 2x / 4x the FLOPs and 1.6x-3.6x a hand
Megatron plan's collective bytes at 2 / 4 shards (critic, physics-informed net, energy under a scan),
1.7x / 2.4x the peak memory of the conv discriminator's. Now each takes its hand plan, to the byte.

MAML's loss adapts the weights first (``W - lr * dW``, inside ``jax.vmap`` over tasks) and then
multiplies by them: read as an activation, an adapted weight summed the split hidden units against
another activation, and every weight stayed whole (1.8x / 2.8x the hand plan's bytes, 2x / 4x its
FLOPs). An adapted weight is now its weight where a product meets it with an activation, and an
adapted stack of layers is where a scan over layers slices it.

Fast weights carried through a scan over tokens from a learned start (a test-time-training layer,
linear attention with a learned initial state) are that start, updated each token, and are split by
heads with the projections that update them."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from accelerator_count import compiled_train_step, trained_against_one_device

RNG = np.random.default_rng(0)
VECTORS = {"x": RNG.normal(size=(16, 32)).astype(np.float32)}
IMAGES = {"x": RNG.normal(size=(16, 3, 16, 16)).astype(np.float32)}
POINTS = {"x": RNG.uniform(-1, 1, 16).astype(np.float32), "t": RNG.uniform(0, 1, 16).astype(np.float32)}
MOLECULES = {"pos": RNG.normal(size=(8, 6, 3)).astype(np.float32), "e": RNG.normal(size=8).astype(np.float32),
             "f": RNG.normal(size=(8, 6, 3)).astype(np.float32) * 0.1}


class Critic(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key, d=32, hidden=256):
        k1, k2, k3 = jax.random.split(key, 3)
        self.fc1, self.fc2 = eqx.nn.Linear(d, hidden, key=k1), eqx.nn.Linear(hidden, d, key=k2)
        self.out = eqx.nn.Linear(d, "scalar", key=k3)

    def __call__(self, x):
        return self.out(jnp.tanh(self.fc2(jax.nn.gelu(self.fc1(x)))))


def gradient_penalty(critic, batch, key):
    """WGAN-GP: the critic's gradient at points between real and fake samples, pushed to norm 1."""
    real = batch["x"]
    fake = real[::-1] * 0.5
    eps = jax.random.uniform(jax.random.key(3), (real.shape[0], 1))
    grads = jax.vmap(jax.grad(critic))(eps * real + (1 - eps) * fake)
    penalty = jnp.mean((jnp.sqrt(jnp.sum(grads**2, -1) + 1e-12) - 1) ** 2)
    return jnp.mean(jax.vmap(critic)(fake)) - jnp.mean(jax.vmap(critic)(real)) + 10 * penalty


class PINN(eqx.Module):
    layers: list

    def __init__(self, key, sizes=(2, 128, 128, 128, 1)):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)]

    def __call__(self, x, t):
        h = jnp.stack([x, t])
        for layer in self.layers[:-1]:
            h = jnp.tanh(layer(h))
        return self.layers[-1](h)[0]


def burgers(model, batch, key):
    """Burgers' equation's residual, with a second derivative in space."""
    def residual(x, t):
        u_x, u_t = jax.grad(model, (0, 1))(x, t)
        return u_t + model(x, t) * u_x - 0.01 * jax.grad(jax.grad(model, 0), 0)(x, t)

    return jnp.mean(jax.vmap(residual)(batch["x"], batch["t"]) ** 2)


class ConvCritic(eqx.Module):
    c1: eqx.nn.Conv2d
    c2: eqx.nn.Conv2d
    c3: eqx.nn.Conv2d
    out: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.c1 = eqx.nn.Conv2d(3, 64, 3, padding=1, key=k[0])
        self.c2 = eqx.nn.Conv2d(64, 256, 3, padding=1, key=k[1])
        self.c3 = eqx.nn.Conv2d(256, 64, 3, padding=1, key=k[2])
        self.out = eqx.nn.Linear(64, "scalar", key=k[3])

    def __call__(self, x):
        h = jax.nn.leaky_relu(self.c1(x), 0.2)
        h = h + self.c3(jax.nn.leaky_relu(self.c2(h), 0.2))
        return self.out(h.mean((1, 2)))


def r1(critic, batch, key):
    """A non-saturating GAN loss with the R1 penalty: the squared gradient at real images."""
    real, grads = jax.vmap(jax.value_and_grad(critic))(batch["x"])
    fake = jax.vmap(critic)(batch["x"][::-1] * 0.5)
    penalty = jnp.mean(jnp.sum(grads**2, (1, 2, 3)))
    return jnp.mean(jax.nn.softplus(-real)) + jnp.mean(jax.nn.softplus(fake)) + 5 * penalty


class Interaction(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key, d=32, hidden=128):
        k1, k2 = jax.random.split(key)
        self.fc1, self.fc2 = eqx.nn.Linear(d, hidden, key=k1), eqx.nn.Linear(hidden, d, key=k2)

    def __call__(self, h):
        return h + 0.1 * self.fc2(jax.nn.silu(self.fc1(h)))


class Energy(eqx.Module):
    """Atoms' pairwise distances in radial features, a scan over stacked layers, an energy summed."""

    embed: eqx.nn.Linear
    layers: Interaction
    out: eqx.nn.Linear

    def __init__(self, key, d=32, hidden=128, n_layers=2):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed, self.out = eqx.nn.Linear(8, d, key=k1), eqx.nn.Linear(d, "scalar", key=k3)
        self.layers = eqx.filter_vmap(lambda k: Interaction(k, d, hidden))(jax.random.split(k2, n_layers))

    def __call__(self, pos):
        dist = jnp.sqrt(jnp.sum((pos[:, None] - pos[None]) ** 2, -1) + 1e-6)
        radial = jnp.exp(-((dist[..., None] - jnp.linspace(0, 4, 8)[None, None]) ** 2))
        h = 0.1 * jax.vmap(jax.vmap(self.embed))(radial).sum(1)
        params, static = eqx.partition(self.layers, eqx.is_array)
        h, _ = jax.lax.scan(lambda h, p: (jax.vmap(eqx.combine(p, static))(h), None), h, params)
        return jax.vmap(self.out)(h).sum()


def forces(model, batch, key):
    energy, grads = jax.vmap(jax.value_and_grad(model))(batch["pos"])
    return jnp.mean((energy - batch["e"]) ** 2) + jnp.mean((grads + batch["f"]) ** 2)


def mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def maml(model, batch, key, inner_steps=1):
    """examples/meta_learning's meta-loss: a few plain gradient steps on each task's support points,
    then the error on its query points."""
    def one_task(xs, ys, xq, yq):
        adapted = model
        for _ in range(inner_steps):
            grads = eqx.filter_grad(mse)(adapted, xs, ys)
            adapted = eqx.apply_updates(adapted, jax.tree.map(lambda g: -0.01 * g, grads))
        return mse(adapted, xq, yq)

    return jnp.mean(jax.vmap(one_task)(batch["xs"], batch["ys"], batch["xq"], batch["yq"]))


TASKS = {k: RNG.normal(size=(8, 5, 1)).astype(np.float32) for k in ("xs", "ys", "xq", "yq")}


def sine_mlp(key, width=64):
    return eqx.nn.MLP(1, 1, width, depth=2, activation=jax.nn.relu, key=key)


class Residual(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key, d=16, hidden=64):
        k = jax.random.split(key)
        self.fc1, self.fc2 = eqx.nn.Linear(d, hidden, key=k[0]), eqx.nn.Linear(hidden, d, key=k[1])

    def __call__(self, x):
        return x + self.fc2(jax.nn.relu(self.fc1(x)))


class StackedMLP(eqx.Module):
    """Residual blocks stacked on a layer axis, run by a scan: MAML adapts the whole stack."""

    inp: eqx.nn.Linear
    blocks: Residual
    out: eqx.nn.Linear

    def __init__(self, key, layers=3, d=16, hidden=64):
        k = jax.random.split(key, 3)
        self.inp, self.out = eqx.nn.Linear(1, d, key=k[0]), eqx.nn.Linear(d, 1, key=k[1])
        self.blocks = eqx.filter_vmap(lambda k: Residual(k, d, hidden))(jax.random.split(k[2], layers))

    def __call__(self, x):
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        h, _ = jax.lax.scan(lambda h, b: (eqx.combine(b, static)(h), None), self.inp(x), arrays)
        return self.out(h)


class FastWeights(eqx.Module):
    """Per-head fast weights carried through a scan over tokens, starting from learned ``W0``:
    test-time training's (TTT-Linear: a gradient step on ``|W k - v|^2`` each token) or linear
    attention's with a learned initial state (``0.9 W + k v^T``); each token's output is ``W q``."""

    qkv: tuple[eqx.nn.Linear, eqx.nn.Linear, eqx.nn.Linear]
    out: eqx.nn.Linear
    head: eqx.nn.Linear
    W0: jax.Array
    rule: str = eqx.field(static=True)

    def __init__(self, key, rule="ttt", d=32, heads=4, head_dim=8):
        k = jax.random.split(key, 5)
        self.qkv = tuple(eqx.nn.Linear(d, heads * head_dim, use_bias=False, key=k[i]) for i in range(3))
        self.out, self.head = eqx.nn.Linear(heads * head_dim, d, use_bias=False, key=k[3]), eqx.nn.Linear(d, 8, key=k[4])
        self.W0, self.rule = 0.5 * jnp.broadcast_to(jnp.eye(head_dim), (heads, head_dim, head_dim)), rule

    def __call__(self, x):
        q, k, v = (jax.vmap(lin)(x).reshape(x.shape[0], *self.W0.shape[:2]) for lin in self.qkv)

        def token(W, qkv):
            q, k, v = qkv
            if self.rule == "ttt":
                W = W - 0.1 * jax.grad(lambda W: jnp.sum((jnp.einsum("hij,hj->hi", W, k) - v) ** 2))(W)
            else:
                W = 0.9 * W + jnp.einsum("hi,hj->hij", v, k)
            return W, jnp.einsum("hij,hj->hi", W, q)

        _, z = jax.lax.scan(token, self.W0, (q, k, v))
        return jax.vmap(self.head)(x + jax.vmap(self.out)(z.reshape(x.shape[0], -1)))


def token_classes(model, batch, key):
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


SEQUENCES = {"x": RNG.normal(size=(8, 6, 32)).astype(np.float32), "y": RNG.integers(0, 8, (8, 6)).astype(np.int32)}


MEGATRON = {  # each model's hand plan: its wide layers column parallel, the layers that contract them row
    "critic": [(r"fc1\.weight", P("model", None)), (r"fc1\.bias", P("model")), (r"fc2\.weight", P(None, "model"))],
    "energy": [(r"fc1\.weight", P(None, "model", None)), (r"fc1\.bias", P(None, "model")),
               (r"fc2\.weight", P(None, None, "model"))],
    "maml": [(r"layers\.0\.weight", P("model", None)), (r"layers\.0\.bias", P("model")),
             (r"layers\.1\.weight", P(None, "model"))],
    "stacked maml": [(r"blocks\.fc1\.weight", P(None, "model", None)), (r"blocks\.fc1\.bias", P(None, "model")),
                     (r"blocks\.fc2\.weight", P(None, None, "model"))],
    "ttt": [(r"qkv\.\d\.weight", P("model", None)), (r"out\.weight", P(None, "model")), (r"W0", P("model"))],
}
REST_WHOLE = [(".", P())]
CASES = {"critic": (Critic, gradient_penalty, VECTORS), "energy": (Energy, forces, MOLECULES),
         "maml": (sine_mlp, maml, TASKS), "stacked maml": (StackedMLP, maml, TASKS), "ttt": (FastWeights, token_classes, SEQUENCES)}


def _specs(model, loss, batch):
    mesh = redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss, batch=batch)
    return specs, redeqx.explain(model, specs, mesh, loss_fn=loss, batch=batch)


def test_each_model_differentiated_in_its_loss_takes_megatrons_plan():
    specs, table = _specs(Critic(jax.random.key(0)), gradient_penalty, VECTORS)
    assert (specs.fc1.weight, specs.fc2.weight, specs.out.weight) == (P("model", None), P(None, "model"), P()), table
    assert "column and row parallel, dim 0" in table, table  # fc1's transposed product contracts its split
    specs, table = _specs(PINN(jax.random.key(0)), burgers, POINTS)
    assert [layer.weight for layer in specs.layers] == [P("model", None), P(None, "model"), P("model", None),
                                                        P(None, "model")], table
    specs, table = _specs(ConvCritic(jax.random.key(0)), r1, IMAGES)
    assert (specs.c1.weight, specs.c2.weight, specs.c3.weight) == (P(), P("model", None, None, None),
                                                                   P(None, "model", None, None)), table
    specs, table = _specs(Energy(jax.random.key(0)), forces, MOLECULES)
    assert (specs.embed.weight, specs.layers.fc1.weight, specs.layers.fc2.weight) == (
        P(), P(None, "model", None), P(None, None, "model")), table


class Classifier(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key, d=64, hidden=1024, classes=10):
        k = jax.random.split(key, 3)
        self.fc1, self.fc2 = eqx.nn.Linear(d, hidden, key=k[0]), eqx.nn.Linear(hidden, d, key=k[1])
        self.head = eqx.nn.Linear(d, classes, key=k[2])

    def __call__(self, x):
        return self.head(x + self.fc2(jax.nn.gelu(self.fc1(x))))


def energy_and_classes(model, batch, key):
    """JEM: the classifier's logits define an energy, ``-logsumexp``; samples come from a few
    Langevin steps on it (the energy's gradient in the loss), and the labels' cross-entropy is kept."""
    energy = jax.vmap(lambda x: -jax.nn.logsumexp(model(x)))

    def langevin(i, x):
        return x - 0.1 * jax.grad(lambda x: energy(x).sum())(x)

    samples = jax.lax.stop_gradient(jax.lax.fori_loop(0, 3, langevin, jnp.zeros_like(batch["x"])))
    logits = jax.vmap(model)(batch["x"])
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return energy(batch["x"]).mean() - energy(samples).mean() + xent


def test_a_head_whose_gradient_is_taken_is_still_priced_as_a_head():
    """The head's transposed product (the energy's gradient through its logits) contracts the split
    logits: read as a row partner, it made the head a block, always split: 10 classes split 2 ways,
    1.11x the hand plan's bytes (64 -> 1024, 64 vectors). It is weighed against whole, as a head."""
    batch = {"x": RNG.normal(size=(16, 64)).astype(np.float32), "y": np.arange(16) % 10}
    specs, table = _specs(Classifier(jax.random.key(0)), energy_and_classes, batch)
    assert (specs.fc1.weight, specs.fc2.weight, specs.head.weight) == (P("model", None), P(None, "model"), P()), table


@pytest.mark.parametrize("inner_steps", [1, 3])
def test_maml_reads_each_adapted_weight_as_its_weight(inner_steps):
    specs, table = _specs(sine_mlp(jax.random.key(0)), functools.partial(maml, inner_steps=inner_steps), TASKS)
    assert [layer.weight for layer in specs.layers] == [P("model", None), P(None, "model"), P()], table
    assert "column parallel, dim 0" in table and "row parallel, dim 1" in table, table


def test_maml_reads_an_adapted_stack_scanned_over_as_its_weights():
    """The adapted stack enters the scan over layers as its ``xs`` (transposed there under ``vmap``
    over tasks): read as activations, every weight stayed whole (1.66x / 2.18x the hand plan's bytes
    at 2 / 4 shards, 2x / 4x its FLOPs, at 64 -> 512 blocks)."""
    specs, table = _specs(StackedMLP(jax.random.key(0)), maml, TASKS)
    assert (specs.blocks.fc1.weight, specs.blocks.fc2.weight) == (P(None, "model", None), P(None, None, "model")), table


@pytest.mark.parametrize("name", ["critic", "energy", "maml", "stacked maml", "ttt"])
def test_it_trains_as_one_device_at_the_hand_plans_bytes(devices, name):
    make, loss, batch = CASES[name]
    model = make(jax.random.key(0))
    moved, _ = trained_against_one_device(model, loss, batch, devices)
    by_hand, *_ = compiled_train_step(model, loss, batch, 2, optax.sgd(0.1), overrides=MEGATRON[name] + REST_WHOLE)
    assert moved == by_hand, (moved, by_hand)


@pytest.mark.parametrize("rule", ["ttt", "linear"])
def test_fast_weights_that_start_as_a_weight_are_split_by_heads_with_their_projections(rule):
    """A scan's carry that starts as the learned ``W0`` is that weight, updated each token: read as
    an activation, its first trip added the split update to it whole and kept the key and value
    projections whole (1.82x / 2.03x the hand plan's bytes at 2 / 4 shards, 256 wide, 8 heads:
    benchmarks/plans_vs_hand.py); and the value TTT's inner ``jax.grad`` leaves unused, its loss's
    sum, read as a reduction of the keys' features, kept them whole too."""
    specs, table = _specs(FastWeights(jax.random.key(0), rule), token_classes, SEQUENCES)
    assert [lin.weight for lin in specs.qkv] == [P("model", None)] * 3, table
    assert (specs.out.weight, specs.W0) == (P(None, "model"), P("model", None, None)), table
    rows = [line for line in table.splitlines() if line.startswith("qkv.")]  # (not rescued as an expert's feed)
    assert len(rows) == 3 and all(row.endswith("column parallel, dim 0") for row in rows), table
