"""Users' own models, written as users write them (a GPT, a CNN, a ViT): every
n_model_shards trains like one device, and every step calls the model's
modules as written (no class is swapped behind the user's back)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redeqx
from user_gpt import GPT, collate_fn, loss_fn, make_examples


def train(make, loss, batches, n_model_shards, devices, n_steps=3):
    mesh = redeqx.make_mesh(n_model_shards, devices=devices)
    model = make(jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    # SGD: Adam would turn the rounding noise of the key bias's gradient (exactly zero in
    # exact arithmetic: softmax ignores it) into full-size steps whose signs differ by layout
    optimizer = optax.sgd(0.1, momentum=0.9)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss, optimizer, mesh, specs)
    losses = []
    for batch in batches[:n_steps]:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.asarray(losses), state


def assert_same(run, ref):
    np.testing.assert_allclose(run[0], ref[0], rtol=2e-5, atol=2e-6)
    for a, b in zip(jax.tree.leaves(eqx.filter(run[1].model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(ref[1].model, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def make_gpt(key):
    return GPT(vocab=64, seq=16, width=32, layers=2, heads=4, key=key)


GPT_BATCHES = [collate_fn(make_examples(8, seq=16, vocab=64, seed=i)) for i in range(3)]


@pytest.fixture(scope="module")
def gpt_reference(devices):
    return train(make_gpt, loss_fn, GPT_BATCHES, 1, devices[:1])


@pytest.mark.parametrize("n_model_shards", [2, 4])
def test_user_gpt_matches_one_device(gpt_reference, n_model_shards, devices):
    assert_same(train(make_gpt, loss_fn, GPT_BATCHES, n_model_shards, devices), gpt_reference)


def test_every_step_calls_the_users_modules_as_written(devices):
    """The model a loss_fn / pred_fn / step_fn receives holds the user's own
    classes, under every entry point (issue 21: steps used to swap exact
    eqx.nn.Linear layers and norms for look-alike subclasses)."""
    seen = []

    def record(model):
        block = model.blocks[0]
        seen.append((type(block.attn.query), type(block.ln1), type(block)))

    def loss(model, batch, key):
        record(model)
        return loss_fn(model, batch, key)

    def pred(model, batch, key):
        record(model)
        return jax.vmap(model)(batch["tokens"][:, :-1]).argmax(-1)

    mesh = redeqx.make_mesh(2)
    model = make_gpt(jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.sgd(0.1)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    batch = GPT_BATCHES[0]
    redeqx.make_train_step(loss, optimizer, mesh, specs).lower(state, batch)
    redeqx.make_eval_step(loss, mesh, specs).lower(state.model, batch, jax.random.key(0))
    redeqx.make_predict_step(pred, mesh, specs).lower(state.model, batch, jax.random.key(0))
    redeqx.make_step(lambda s, b: (s, loss(s.model, b, s.key)), mesh).lower(state, batch)
    block = type(model.blocks[0])
    assert seen == [(eqx.nn.Linear, eqx.nn.LayerNorm, block)] * 4


def test_rematerialised_user_gpt_matches_one_device(gpt_reference, devices):
    assert_same(train(make_gpt, redeqx.remat(loss_fn), GPT_BATCHES, 4, devices), gpt_reference)


class ConvBlock(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d

    def __init__(self, c, key):
        k1, k2 = jax.random.split(key)
        self.conv1 = eqx.nn.Conv2d(c, c, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(c, c, 3, padding=1, key=k2)

    def __call__(self, x):  # (C, H, W)
        return x + self.conv2(jax.nn.relu(self.conv1(x)))


class CNN(eqx.Module):
    stem: eqx.nn.Conv2d
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
        ks = jax.random.split(key, 4)
        self.stem = eqx.nn.Conv2d(1, 8, 3, padding=1, key=ks[0])
        self.blocks = [ConvBlock(8, k) for k in ks[1:3]]
        self.head = eqx.nn.Linear(8, 10, key=ks[3])

    def __call__(self, x):  # (1, 8, 8)
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


class ViTBlock(eqx.Module):
    norm: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(16)
        self.attn = eqx.nn.MultiheadAttention(2, 16, key=k1)
        self.mlp = eqx.nn.MLP(16, 16, 32, depth=1, key=k2)

    def __call__(self, x):  # (tokens, 16)
        h = jax.vmap(self.norm)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(x)


class ViT(eqx.Module):
    patch: eqx.nn.Linear
    cls_token: jax.Array
    pos: jax.Array
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
        ks = jax.random.split(key, 5)
        self.patch = eqx.nn.Linear(16, 16, key=ks[0])
        self.cls_token = jax.random.normal(ks[1], (1, 16))
        self.pos = 0.1 * jax.random.normal(ks[2], (4, 16))
        self.blocks = [ViTBlock(k) for k in jax.random.split(ks[3], 2)]
        self.head = eqx.nn.Linear(16, 10, key=ks[4])

    def __call__(self, x):  # (1, 8, 8) -> 4 patches of 4x4, plus a class token: 5 tokens... use 3 patches + cls
        patches = x.reshape(2, 4, 2, 4).transpose(0, 2, 1, 3).reshape(4, 16)
        tokens = jnp.concatenate([self.cls_token, jax.vmap(self.patch)(patches)[:3] + self.pos[:3]])  # (4, 16)
        for block in self.blocks:
            tokens = block(tokens)
        return self.head(tokens[0])


def image_loss(model, batch, key):
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def image_batches():
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(8, 1, 8, 8)).astype(np.float32), "y": rng.integers(0, 10, 8).astype(np.int32)}
            for _ in range(3)]


@pytest.mark.slow
@pytest.mark.parametrize("make", [CNN, ViT], ids=["cnn", "vit"])
def test_users_image_models_match_one_device(make, devices):
    batches = image_batches()
    reference = train(make, image_loss, batches, 1, devices[:1])
    for n_model_shards in (2, 4):
        assert_same(train(make, image_loss, batches, n_model_shards, devices), reference)


class TiedLM(eqx.Module):
    """An LM whose head is its embedding, tied as Equinox ties weights (`eqx.nn.Shared`: one array
    in the pytree, used by a lookup and by a product)."""

    shared: eqx.nn.Shared
    blocks: list
    norm: eqx.nn.LayerNorm

    def __init__(self, key, vocab=64, width=32):
        ks = jax.random.split(key, 4)
        embed = eqx.nn.Embedding(vocab, width, key=ks[0])
        head = eqx.nn.Linear(width, vocab, use_bias=False, key=ks[1])
        self.shared = eqx.nn.Shared((embed, head), lambda p: p[1].weight, lambda p: p[0].weight)
        self.blocks = [eqx.nn.MLP(width, width, 4 * width, depth=1, key=k) for k in ks[2:]]
        self.norm = eqx.nn.LayerNorm(width)

    def __call__(self, ids):
        embed, head = self.shared()
        h = jax.vmap(embed)(ids)
        for block in self.blocks:
            h = h + jax.vmap(block)(h)
        return jax.vmap(head)(jax.vmap(self.norm)(h))


def tied_loss(model, batch, key):
    logits = jax.vmap(model)(batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


@pytest.mark.slow
def test_weights_tied_with_eqx_nn_shared_train_like_one_device(devices):
    """`eqx.nn.Shared` keeps one copy of a tied weight; its gradient sums both uses (lookup and
    head). Under every split the rules read from the program, the tie holds and training matches
    one device's."""
    batches = [{"ids": np.random.default_rng(i).integers(0, 64, (16, 9)).astype(np.int32)} for i in range(3)]
    runs = {}
    for n, devs in ((1, devices[:1]), (2, devices), (4, devices)):
        mesh = redeqx.make_mesh(n, devices=devs)
        model = TiedLM(jax.random.key(0))
        specs = redeqx.sharding_rules(model, mesh, loss_fn=tied_loss, batch=batches[0])
        optimizer = optax.sgd(0.1, momentum=0.9)  # updates linear in the gradients (Adam would hide a scaled one)
        state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
        step = redeqx.make_train_step(tied_loss, optimizer, mesh, specs)
        losses, norms = [], []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
        arrays = lambda m: len(jax.tree.leaves(eqx.filter(m, eqx.is_array)))  # noqa: E731
        assert arrays(state.model) == arrays(model) == 11  # the tied weight once (untied: 12)
        runs[n] = (np.asarray(losses), state, np.asarray(norms))
    assert runs[1][0][-1] < runs[1][0][0]
    for n in (2, 4):
        assert_same(runs[n][:2], runs[1][:2])
        np.testing.assert_allclose(runs[n][2], runs[1][2], rtol=1e-5)  # the gradients' norms, step by step
