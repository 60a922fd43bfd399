"""Grouped and depthwise convolutions train like one device (issue 40): XLA's
partitioner makes their weight gradient ``n_model_shards`` times too large
when the batch is split over ``data`` and replicated over ``model``, so the
train step takes it from matrix products (`redeqx.exact_conv_grads`). One
SGD step's update of every weight is compared with one device's gradient, at
2 and 4 model shards, for 1-D and 2-D convolutions, depthwise and
``groups=2``, with fsdp, stacked, under remat and with accumulation."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import redeqx


class Block(eqx.Module):
    """A depthwise convolution, then one of 2 groups, with a residual. The block's input is pinned
    whole over ``model``; its rows stay split over ``data``, as redeqx lays out every batch."""

    depthwise: eqx.nn.Conv
    grouped: eqx.nn.Conv
    dilated: eqx.nn.Conv | None

    def __init__(self, dims, width, dilated=False, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.depthwise = eqx.nn.Conv(dims, width, width, 3, padding=1, groups=width, key=k1)
        self.grouped = eqx.nn.Conv(dims, width, width, 3, padding=1, groups=2, key=k2)
        # a dilated, strided depthwise convolution: other windows for the weight gradient's products
        self.dilated = (eqx.nn.Conv(dims, width, width, 3, stride=2, padding=2, dilation=2, groups=width, key=k3)
                        if dilated else None)

    def __call__(self, x):  # (width, *space) -> (width, *space)
        x = redeqx.constrain(x, P())  # the residual stream whole on every model shard, as redeqx.models pin it
        x = x + self.grouped(jax.nn.relu(self.depthwise(x)))
        if self.dilated is not None:
            x = jnp.repeat(self.dilated(x), 2, axis=-1)[..., :x.shape[-1]] + x
        return x


class ConvNet(eqx.Module):
    """``Block``s, as a list or stacked (``eqx.filter_vmap``, run by ``lax.scan``), then a Linear head."""

    blocks: Block | list
    head: eqx.nn.Linear
    stacked: bool = eqx.field(static=True)

    def __init__(self, dims, width=8, depth=2, stacked=False, dilated=False, *, key):
        keys = jax.random.split(key, depth + 1)
        if stacked:
            self.blocks = eqx.filter_vmap(lambda k: Block(dims, width, dilated, key=k))(keys[:depth])
        else:
            self.blocks = [Block(dims, width, dilated, key=k) for k in keys[:depth]]
        self.head = eqx.nn.Linear(width, 4, key=keys[-1])
        self.stacked = stacked

    def __call__(self, x):  # (width, *space) -> (4,)
        if self.stacked:
            params, static = eqx.partition(self.blocks, eqx.is_array)
            x, _ = jax.lax.scan(lambda h, p: (eqx.combine(p, static)(h), None), x, params)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(x.mean(axis=tuple(range(1, x.ndim))))


def loss_fn(model, batch, key):
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)


def data(dims, width, rows=8):
    rng = np.random.default_rng(0)
    space = (12,) if dims == 1 else (5, 6)
    return {"x": rng.normal(size=(rows, width, *space)).astype(np.float32),
            "y": rng.normal(size=(rows, 4)).astype(np.float32)}


def one_sgd_step_update(model, batch, n, *, replicated=False, fsdp=False, remat=False, accumulate=1):
    """The change one SGD step (learning rate 1) makes to every weight, at ``n_model_shards=n``, the
    convolutions' weights split by the rules or ``replicated``."""
    mesh = redeqx.make_mesh(n)
    overrides = [(r"depthwise|grouped", P())] if replicated else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a group count the shards do not divide stays whole, warned
        specs = redeqx.sharding_rules(model, mesh, fsdp=fsdp, overrides=overrides)
    optimizer = optax.sgd(1.0)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(redeqx.remat(loss_fn) if remat else loss_fn, optimizer, mesh, specs,
                                  accumulate=accumulate)
    new, _ = step(state, batch)
    return specs, jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), eqx.filter(new.model, eqx.is_array),
                               eqx.filter(model, eqx.is_array))


CASES = {  # name: (width, stacked, options); the partitioner's layouts differ, each case failed before the rewrite
    "split": (8, False, {}),
    "replicated": (8, False, {"replicated": True}),
    "fsdp": (128, False, {"fsdp": True}),
    "stacked": (8, True, {"replicated": True}),
    "stacked_remat": (8, True, {"remat": True}),
    "accumulate": (8, False, {"accumulate": 2}),
}
FAST = {("stacked", 2)}  # the rest: 3-30 s each on two busy cores


@pytest.mark.parametrize("case, dims", [
    pytest.param(case, dims, marks=() if (case, dims) in FAST else pytest.mark.slow) for case in CASES for dims in (1, 2)])
def test_grouped_conv_weights_train_like_one_device(case, dims, devices):
    width, stacked, options = CASES[case]
    model = ConvNet(dims, width, stacked=stacked, key=jax.random.key(0))
    batch = data(dims, width)
    grads = eqx.filter_jit(eqx.filter_grad(loss_fn))(model, batch, None)  # one device, no redeqx
    for n in (2, 4):
        specs, update = one_sgd_step_update(model, batch, n, **options)
        if case == "fsdp":
            assert "data" in specs.blocks[0].grouped.weight, specs.blocks[0].grouped.weight
        flat_update = jax.tree_util.tree_leaves_with_path(update)
        for (path, u), g in zip(flat_update, jax.tree.leaves(grads)):
            np.testing.assert_allclose(u, -g, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{jax.tree_util.keystr(path)} at n_model_shards={n}")


def test_xla_grouped_conv_gradient_is_still_wrong_without_it(devices):
    """The fault the rewrite works around, on plain ``jax.jit`` (docs/guides/troubleshooting.md's repro):
    when XLA fixes it, this fails, and `redeqx.exact_conv_grads` can go."""
    conv = eqx.nn.Conv1d(8, 8, 3, groups=8, key=jax.random.key(0))
    x = np.random.default_rng(0).normal(size=(8, 8, 16)).astype(np.float32)
    mesh = redeqx.make_mesh(2)
    weight = lambda w, fn: fn(eqx.tree_at(lambda c: c.weight, conv, w))  # noqa: E731

    def loss(w, xb):
        return jnp.mean(weight(w, lambda m: jax.vmap(m)(xb)) ** 2)

    one = jax.grad(loss)(conv.weight, x)
    args = (jax.device_put(conv.weight, NamedSharding(mesh, P())), jax.device_put(x, NamedSharding(mesh, P("data"))))
    wrong = jax.jit(jax.grad(loss), out_shardings=NamedSharding(mesh, P()))(*args)
    np.testing.assert_allclose(wrong, 2 * one, rtol=1e-5)
    exact = jax.jit(jax.grad(redeqx.exact_conv_grads(loss)), out_shardings=NamedSharding(mesh, P()))(*args)
    np.testing.assert_allclose(exact, one, rtol=1e-5, atol=1e-7)


def test_a_gradient_taken_inside_the_loss_is_one_devices(devices):
    """A loss that differentiates inside itself (MAML's inner step): the program it traces to holds
    the grouped convolutions' weight gradients already, which the step now computes by products too.
    Before, one inner step's adapted weights came from gradients n_model_shards times too large (the
    outer update of the depthwise weight was 86 % off at 2 shards), silently."""
    model = ConvNet(1, 8, key=jax.random.key(0))
    batch = data(1, 8)

    def maml(model, batch, key):
        inner = eqx.filter_grad(loss_fn)(model, batch, key)
        return loss_fn(eqx.apply_updates(model, jax.tree.map(lambda g: -0.5 * g, inner)), batch, key)

    expected = eqx.filter_jit(eqx.filter_grad(maml))(model, batch, None)  # one device, no redeqx
    mesh = redeqx.make_mesh(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        specs = redeqx.sharding_rules(model, mesh, overrides=[(r"depthwise|grouped", P())])
    state = redeqx.init_state(model, optax.sgd(1.0), mesh, specs, key=jax.random.key(1))
    new, _ = redeqx.make_train_step(maml, optax.sgd(1.0), mesh, specs)(state, batch)
    update = jax.tree.map(jnp.subtract, eqx.filter(new.model, eqx.is_array), eqx.filter(model, eqx.is_array))
    for (path, u), g in zip(jax.tree_util.tree_leaves_with_path(update), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(u, -g, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


MAKE_STEP_CASES = {  # name: (width, stacked, rules' options, the convolutions replicated)
    "split": (8, False, {}, False),
    "replicated": (8, False, {}, True),
    "stacked": (8, True, {}, False),
    "fsdp": (128, False, {"fsdp": True}, False),
}


@pytest.mark.parametrize("case", MAKE_STEP_CASES)
def test_make_step_gives_one_devices_conv_gradients(case, devices):
    """A step written by hand (`make_step`, as for DP-SGD or PPO) differentiates the loss itself, with
    no `exact_conv_grads`: its grouped, depthwise and dilated convolutions' weight gradients are still
    one device's (before, n_model_shards times too large: 2.0000x at 2 shards, 4.0000x at 4)."""
    width, stacked, rules, replicated = MAKE_STEP_CASES[case]
    model = ConvNet(1, width, stacked=stacked, dilated=True, key=jax.random.key(0))
    batch = data(1, width)
    expected = eqx.filter_jit(eqx.filter_grad(loss_fn))(model, batch, None)  # one device, no redeqx

    def grads_step(model, batch):  # the gradients come out as the step's outputs, laid out like the model
        grads = eqx.filter_grad(loss_fn)(model, batch, None)
        return model, grads

    for n in (2, 4):
        mesh = redeqx.make_mesh(n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            specs = redeqx.sharding_rules(model, mesh, overrides=[(r"depthwise|grouped|dilated", P())] if replicated
                                          else [], **rules)
        if case == "fsdp":
            assert "data" in specs.blocks[0].grouped.weight, specs.blocks[0].grouped.weight
        step = redeqx.make_step(grads_step, mesh, donate=False)
        placed = redeqx.shard(model, specs, mesh)
        _, grads = step(placed, redeqx.shard(batch, {"x": P("data"), "y": P("data")}, mesh))
        for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(eqx.filter(grads, eqx.is_array)),
                                jax.tree.leaves(eqx.filter(expected, eqx.is_array))):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{jax.tree_util.keystr(path)} at n_model_shards={n}")
