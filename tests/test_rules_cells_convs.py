"""Recurrent cells, depthwise and grouped convolutions (issue 23): a GRU's or an
LSTM's gates stacked on dim 0 stay whole, said in `explain` (one split of dim
0 would hand a device whole gates, not a slice of each); a depthwise conv is
split on its channels with its bias; a grouped conv on whole groups only."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx


class RNN(eqx.Module):
    """A sequence classifier: a Linear into a recurrent cell over the steps, a Linear out."""

    encode: eqx.nn.Linear
    cell: eqx.Module
    head: eqx.nn.Linear

    def __init__(self, cell, *, key):
        k = jax.random.split(key, 3)
        self.encode = eqx.nn.Linear(4, 16, key=k[0])
        self.cell = cell(16, 8, key=k[1])
        self.head = eqx.nn.Linear(8, 4, key=k[2])

    def __call__(self, xs):  # (T, 4) -> (4,)
        lstm = isinstance(self.cell, eqx.nn.LSTMCell)
        init = (jnp.zeros(8), jnp.zeros(8)) if lstm else jnp.zeros(8)

        def step(carry, x):
            carry = self.cell(x, carry)
            return carry, None

        carry, _ = jax.lax.scan(step, init, jax.vmap(self.encode)(xs))
        return self.head(carry[0] if lstm else carry)


class MobileBlock(eqx.Module):
    """MobileNet's inverted residual (pointwise expand, depthwise, pointwise project), then a grouped conv."""

    expand: eqx.nn.Conv2d
    depthwise: eqx.nn.Conv2d
    project: eqx.nn.Conv2d
    grouped: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k = jax.random.split(key, 5)
        self.expand = eqx.nn.Conv2d(4, 16, 1, key=k[0])
        self.depthwise = eqx.nn.Conv2d(16, 16, 3, padding=1, groups=16, key=k[1])
        self.project = eqx.nn.Conv2d(16, 8, 1, key=k[2])
        self.grouped = eqx.nn.Conv2d(8, 16, 3, padding=1, groups=4, key=k[3])
        self.head = eqx.nn.Linear(16, 4, key=k[4])

    def __call__(self, x):  # (4, H, W) -> (4,)
        x = self.project(jax.nn.relu(self.depthwise(jax.nn.relu(self.expand(x)))))
        return self.head(jax.nn.relu(self.grouped(x)).mean(axis=(1, 2)))


def loss_fn(model, batch, key):
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def train(model, batch, n_model_shards, devices):
    mesh = redeqx.make_mesh(n_model_shards, devices=devices)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.sgd(0.1)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    losses = []
    for _ in range(2):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.asarray(losses), state.model


def assert_trains_as_one_device(model, batch, devices, shards=(2, 4)):
    ref_losses, ref_model = train(model, batch, 1, devices[:1])
    for n in shards:
        losses, trained = train(model, batch, n, devices)
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, err_msg=f"at n_model_shards={n}")
        for a, b in zip(jax.tree.leaves(eqx.filter(trained, eqx.is_array)),
                        jax.tree.leaves(eqx.filter(ref_model, eqx.is_array))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("cell", [eqx.nn.GRUCell, eqx.nn.LSTMCell])
def test_recurrent_cells_keep_their_gates_whole(cell, devices):
    model = RNN(cell, key=jax.random.key(0))
    mesh = redeqx.make_mesh(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rule, not a fallback: said in explain, not warned
        specs = redeqx.sharding_rules(model, mesh)
    assert specs.cell.weight_ih == specs.cell.weight_hh == specs.cell.bias == P()
    assert specs.encode.weight == P("model", None)
    rows = {r.split()[0]: r for r in redeqx.explain(model, specs, mesh, reasons="full").splitlines() if r}
    for name in ("weight_ih", "weight_hh"):
        assert rows[f"cell.{name}"].endswith("recurrent cell: its gates are stacked on dim 0, so a split would give "
                                             "a device whole gates instead of a slice of each: replicated")
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 5, 4)).astype(np.float32), "y": rng.integers(0, 4, 8).astype(np.int32)}
    assert_trains_as_one_device(model, batch, devices)


def test_depthwise_and_grouped_convs_split_on_whole_channels_and_groups(devices):
    model = MobileBlock(key=jax.random.key(0))
    mesh = redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(model, mesh)
    # expand column parallel, depthwise on its (already split) channels, project row parallel
    assert specs.expand.weight == P("model", None, None, None)
    assert specs.depthwise.weight == P("model", None, None, None) and specs.depthwise.bias == P("model", None, None)
    assert specs.project.weight == P(None, "model", None, None) and specs.project.bias == P()
    assert specs.grouped.weight == P("model", None, None, None) and specs.grouped.bias == P("model", None, None)
    rows = {r.split()[0]: r for r in redeqx.explain(model, specs, mesh).splitlines() if r}
    assert rows["depthwise.weight"].endswith("depthwise conv: dim 0 (channels)")
    assert rows["grouped.weight"].endswith("grouped conv: dim 0 (whole groups)")
    with warnings.catch_warnings(record=True) as caught:  # 4 groups over 8 shards: whole, said
        warnings.simplefilter("always")
        specs = redeqx.sharding_rules(model, redeqx.make_mesh(8))
    assert specs.grouped.weight == P() and specs.depthwise.weight == P("model", None, None, None)
    assert len(caught) == 1 and "grouped.weight (16, 2, 3, 3): 4 groups not divisible by n_model_shards=8" in str(
        caught[0].message)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 4, 6, 6)).astype(np.float32), "y": rng.integers(0, 4, 8).astype(np.int32)}
    assert_trains_as_one_device(model, batch, devices)
