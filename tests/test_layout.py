"""The activation layout for users' models changes where activations live,
never what is computed: every layout at every n_model_shards trains like one
device, on a GPT, a CNN and a ViT written as users write them."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redeqx
from user_gpt import GPT, collate_fn, loss_fn, make_examples


def train(make, loss, batches, n_model_shards, devices, layout="sequence", n_steps=3):
    mesh = redeqx.make_mesh(n_model_shards, devices=devices)
    model = make(jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    # SGD: Adam would turn the rounding noise of the key bias's gradient (exactly zero in
    # exact arithmetic: softmax ignores it) into full-size steps whose signs differ by layout
    optimizer = optax.sgd(0.1, momentum=0.9)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss, optimizer, mesh, specs, activation_layout=layout)
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


@pytest.mark.parametrize("n_model_shards,layout", [(2, "sequence"), (4, "sequence"), (2, "replicated"), (4, "auto")])
def test_user_gpt_matches_one_device(gpt_reference, n_model_shards, layout, devices):
    assert_same(train(make_gpt, loss_fn, GPT_BATCHES, n_model_shards, devices, layout), gpt_reference)


def test_sequence_layout_pins_the_blocks(devices):
    """The pins are really there: the compiled step differs from the unpinned one."""
    mesh = redeqx.make_mesh(2)
    model = make_gpt(jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.sgd(0.1), mesh, specs, key=jax.random.key(1))
    texts = {layout: redeqx.make_train_step(loss_fn, optax.sgd(0.1), mesh, specs, activation_layout=layout)
             .lower(state, GPT_BATCHES[0]).as_text() for layout in ("sequence", None)}
    assert texts["sequence"].count("sharding_constraint") > texts[None].count("sharding_constraint")
    with pytest.raises(ValueError, match="activation_layout must be one of"):
        redeqx.make_train_step(loss_fn, optax.sgd(0.1), mesh, specs, activation_layout="megatron")


def test_linears_are_computed_x_times_w_transposed(devices):
    """Every exact eqx.nn.Linear is computed as x @ W.T inside the steps: the
    same function (scalar ends, no bias, inside MLP and MultiheadAttention),
    without the transposes of activations that vmap of W @ x lowers to; a
    subclass (a user's or LoRA's own layer) is called as it is."""
    from redeqx._layout import _RowsLinear, apply_layout

    class MyLinear(eqx.nn.Linear):
        pass

    keys = jax.random.split(jax.random.key(0), 4)
    model = (eqx.nn.MLP("scalar", "scalar", 8, 2, key=keys[0]), eqx.nn.Linear(5, 7, use_bias=False, key=keys[1]),
             eqx.nn.MultiheadAttention(2, 8, key=keys[2]), MyLinear(5, 7, key=keys[3]))
    swapped = apply_layout(model, None, redeqx.make_mesh(1, devices=jax.devices()[:1]))
    assert type(swapped[0].layers[0]) is _RowsLinear and type(swapped[1]) is _RowsLinear
    assert type(swapped[2].query_proj) is _RowsLinear and type(swapped[3]) is MyLinear
    assert jax.tree.leaves(eqx.filter(swapped, eqx.is_array)) == jax.tree.leaves(eqx.filter(model, eqx.is_array))
    x = jax.random.normal(jax.random.key(1), (3, 5))
    s = jax.random.normal(jax.random.key(2), (4, 8))
    for m in (model, swapped):  # the same numbers, computed both ways
        out = (jax.vmap(m[0])(x[:, 0]), jax.vmap(m[1])(x), m[2](s, s, s), jax.vmap(m[3])(x))
        if m is model:
            ref = out
    for a, b in zip(out, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for k in (5, 3):  # a feature-major (in, k) matrix, which W @ x accepts: k == in must not be read as rows
        m = jax.random.normal(jax.random.key(3), (5, k))
        np.testing.assert_allclose(swapped[1](m), model[1](m), rtol=1e-6)
    with pytest.raises(TypeError):
        swapped[1](jnp.ones(4))  # a wrong feature count fails as in Equinox
    with pytest.raises(TypeError):
        model[1](jnp.ones(4))

    def transposes(linear):
        f = jax.vmap(jax.vmap(linear))  # (batch, tokens, in) -> (batch, tokens, out)
        return [e for e in jax.make_jaxpr(f)(jnp.ones((2, 3, 5))).eqns if e.primitive.name == "transpose"]

    assert [e.outvars[0].aval.shape for e in transposes(swapped[1])] == [(5, 7)]  # the weight's only
    assert transposes(model[1]) and transposes(model[1])[0].outvars[0].aval.shape == (2, 3, 7)


def test_train_step_computes_linears_without_activation_transposes(devices):
    """The train step itself takes the x @ W.T order: its lowered program
    transposes weights only, never an activation (what vmap of W @ x would do)."""
    mesh = redeqx.make_mesh(1, devices=devices[:1])
    model = eqx.nn.MLP(6, 3, 10, depth=2, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.sgd(0.1), mesh, specs, key=jax.random.key(1))

    def loss(model, batch, key):
        return jnp.mean(jax.vmap(jax.vmap(model))(batch["x"]) ** 2)  # (batch, tokens, features)

    text = redeqx.make_train_step(loss, optax.sgd(0.1), mesh, specs).lower(
        state, {"x": jnp.ones((4, 5, 6))}).as_text()
    transposed = [line for line in text.splitlines() if "stablehlo.transpose" in line]
    assert transposed and all("tensor<4x5x" not in line.split("->")[-1] for line in transposed), transposed


def test_norms_are_recomputed_in_the_backward(devices):
    """Every exact eqx.nn.LayerNorm / RMSNorm is recomputed in the backward pass
    inside the steps: the same outputs and gradients (with and without weight
    and bias, a state passed through, a key ignored), the same leaves; a
    subclass (the user's own norm) is called as it is. On CPU only."""
    from redeqx._layout import _RowsLinear, apply_layout, as_computed

    class MyNorm(eqx.nn.LayerNorm):
        pass

    keys = jax.random.split(jax.random.key(0), 3)
    ln = eqx.tree_at(lambda m: (m.weight, m.bias), eqx.nn.LayerNorm(8),
                     (jax.random.normal(keys[0], (8,)), jax.random.normal(keys[1], (8,))))
    model = (ln, eqx.nn.RMSNorm(8), eqx.nn.LayerNorm(8, use_weight=False, use_bias=False), MyNorm(8))
    swapped = apply_layout(model, None, redeqx.make_mesh(1, devices=jax.devices()[:1]))
    assert [type(m) is type(o) for m, o in zip(swapped, model)] == [False, False, False, True]
    assert all(isinstance(m, type(o)) for m, o in zip(swapped, model))
    assert jax.tree.leaves(eqx.filter(swapped, eqx.is_array)) == jax.tree.leaves(eqx.filter(model, eqx.is_array))
    x = 3 * jax.random.normal(keys[2], (4, 5, 8)) + 1
    ct = jax.random.normal(jax.random.key(9), x.shape)

    def loss(norm, x):
        return jnp.sum(jax.vmap(jax.vmap(norm))(x) * ct)

    for new, old in zip(swapped, model):
        np.testing.assert_allclose(jax.vmap(jax.vmap(new))(x), jax.vmap(jax.vmap(old))(x), rtol=1e-6, atol=1e-6)
        grads = [jax.grad(loss, argnums=(0, 1))(m, x) for m in (new, old)]
        for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    state = eqx.nn.State(eqx.nn.BatchNorm(8, "batch", mode="batch"))
    out, same = swapped[0](x[0, 0], state)
    assert same is state and np.allclose(out, model[0](x[0, 0]), rtol=1e-6)
    np.testing.assert_allclose(swapped[1](x[0, 0], key=jax.random.key(3)), model[1](x[0, 0]), rtol=1e-6)
    with pytest.raises(ValueError, match="shape == x.shape"):
        swapped[0](x[0])  # a missing vmap fails as in Equinox
    grad_text = jax.make_jaxpr(jax.grad(loss))(swapped[0], x).pretty_print()
    assert "remat" in grad_text and "prevent_cse=True" in grad_text  # recomputed; XLA may not merge it back
    # only where it was measured to pay: libtpu's programs grew with it (benchmarks/tpu_programs.py)
    assert [type(m) for m in as_computed(model, "tpu")] == [type(m) for m in model]
    assert type(as_computed(eqx.nn.Linear(2, 3, key=keys[0]), "tpu")) is _RowsLinear


def test_recomputed_norms_shrink_the_step_and_train_alike(devices, monkeypatch):
    """What the recomputation buys, in the compiled step's own memory analysis:
    fewer temporaries per device on the user GPT at 8192 tokens per device (at
    fewer, XLA:CPU fuses the norms' broadcasts away and there is little to
    save); and training is the same as with the norms as written, to float
    rounding, at n_model_shards=2."""
    from redeqx import _layout

    def make(key, seq=32, width=64):
        return GPT(vocab=64, seq=seq, width=width, layers=2, heads=4, key=key)

    def temp_bytes():
        mesh = redeqx.make_mesh(1, devices=devices[:1])
        model = make(jax.random.key(0), seq=128, width=128)
        specs = redeqx.sharding_rules(model, mesh)
        state = redeqx.init_state(model, optax.sgd(0.1), mesh, specs, key=jax.random.key(1))
        step = redeqx.make_train_step(loss_fn, optax.sgd(0.1), mesh, specs)
        batch = collate_fn(make_examples(64, seq=128, vocab=64))
        return step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes

    batches = [collate_fn(make_examples(16, seq=32, vocab=64, seed=i)) for i in range(3)]
    recomputed = temp_bytes(), train(make, loss_fn, batches, 2, devices, "auto")
    monkeypatch.setattr(_layout, "_recomputed_norms", lambda model: model)
    as_written = temp_bytes(), train(make, loss_fn, batches, 2, devices, "auto")
    assert recomputed[0] < 0.95 * as_written[0], (recomputed[0], as_written[0])
    assert_same(recomputed[1], as_written[1])


def test_rematerialised_user_gpt_matches_one_device(gpt_reference, devices):
    assert_same(train(make_gpt, redeqx.remat(loss_fn), GPT_BATCHES, 4, devices, "auto"), gpt_reference)


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


@pytest.mark.parametrize("make", [CNN, ViT], ids=["cnn", "vit"])
def test_users_image_models_match_one_device(make, devices):
    batches = image_batches()
    reference = train(make, image_loss, batches, 1, devices[:1])
    for n_model_shards in (2, 4):
        assert_same(train(make, image_loss, batches, n_model_shards, devices), reference)
