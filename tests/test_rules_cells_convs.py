"""Recurrent cells, depthwise and grouped convolutions (issue 23): a GRU's or an
LSTM's gates stacked on dim 0 stay whole, said in `explain` (one split of dim
0 would hand a device whole gates, not a slice of each); a depthwise conv is
split on its channels with its bias; a grouped conv on whole groups only. A GroupNorm over a conv
block's hidden channels keeps the block Megatron (its statistics are local to whole groups); one over
the residual stream keeps what feeds the stream whole."""

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


def train(model, batch, n_model_shards, devices, rules=None, loss=loss_fn):
    mesh = redeqx.make_mesh(n_model_shards, devices=devices)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        specs = redeqx.sharding_rules(model, mesh, **(rules or {}))
    optimizer = optax.sgd(0.1)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss, optimizer, mesh, specs)
    losses = []
    for _ in range(2):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.asarray(losses), state.model


def assert_trains_as_one_device(model, batch, devices, shards=(2, 4), rules=None, loss=loss_fn):
    ref_losses, ref_model = train(model, batch, 1, devices[:1], rules, loss)
    for n in shards:
        losses, trained = train(model, batch, n, devices, rules, loss)
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


class GroupNormBlock(eqx.Module):
    conv1: eqx.nn.Conv2d
    norm: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d
    norm_out: eqx.nn.GroupNorm

    def __init__(self, width, hidden, groups, key):
        k1, k2 = jax.random.split(key)
        self.conv1, self.norm = eqx.nn.Conv2d(width, hidden, 3, padding=1, key=k1), eqx.nn.GroupNorm(groups, hidden)
        self.conv2, self.norm_out = eqx.nn.Conv2d(hidden, width, 3, padding=1, key=k2), eqx.nn.GroupNorm(2, width)

    def __call__(self, x):
        return jax.nn.relu(self.norm_out(x + self.conv2(jax.nn.relu(self.norm(self.conv1(x))))))


class GroupNormNet(eqx.Module):
    """A residual conv net as written for images: GroupNorm in each block and on the stream."""

    stem: eqx.nn.Conv2d
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, hidden=16, groups=4, width=8, *, key):
        ks = jax.random.split(key, 4)
        self.stem, self.head = eqx.nn.Conv2d(4, width, 3, padding=1, key=ks[0]), eqx.nn.Linear(width, 4, key=ks[1])
        self.blocks = [GroupNormBlock(width, hidden, groups, k) for k in ks[2:]]

    def __call__(self, x):  # (4, H, W) -> (4,)
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


def test_groupnorm_inside_a_conv_block_keeps_it_megatron(devices):
    """Split into whole groups, a GroupNorm's statistics are each device's own: conv1 column, the
    norm beside it, conv2 row. The rules once left such blocks whole, as they do what feeds a
    normed stream: 1.62x / 2.10x a hand Megatron plan's collective bytes at 2 / 4 shards (a
    128-channel net, 8 x 8 pixels), the same as its bytes now. So does a split into equal parts of
    each group (2 groups over 4 shards: each group's statistics summed over its 2 devices). A split
    whose parts would straddle groups (6 groups of 16 channels over 4 shards) keeps the block whole."""
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 4, 4, 4)).astype(np.float32), "y": rng.integers(0, 4, 8).astype(np.int32)}
    model = GroupNormNet(key=jax.random.key(0))
    for n in (2, 4):
        specs = redeqx.sharding_rules(model, redeqx.make_mesh(n), loss_fn=loss_fn, batch=batch)
        for block in specs.blocks:
            assert block.conv1.weight == P("model", None, None, None) and block.conv2.weight == P(None, "model",
                                                                                                   None, None), n
            assert block.norm.weight == block.norm.bias == P("model"), n
            assert block.norm_out.weight == P(), n
        assert specs.stem.weight == P(), n
    assert_trains_as_one_device(model, batch, devices, shards=(4,), rules={"loss_fn": loss_fn, "batch": batch})
    shared = GroupNormNet(groups=2, key=jax.random.key(0))
    specs = redeqx.sharding_rules(shared, redeqx.make_mesh(4), loss_fn=loss_fn, batch=batch)
    assert specs.blocks[0].conv1.weight == P("model", None, None, None) and specs.blocks[0].norm.weight == P("model")
    assert_trains_as_one_device(shared, batch, devices, shards=(4,), rules={"loss_fn": loss_fn, "batch": batch})
    cut = GroupNormNet(hidden=96, groups=6, key=jax.random.key(0))
    with pytest.warns(UserWarning, match=r"a GroupNorm's statistics \(reduce_sum\) over the groups of blocks.0.conv1."
                                         r"weight: 6 groups not divisible by n_model_shards=4 nor dividing it"):
        specs = redeqx.sharding_rules(cut, redeqx.make_mesh(4), loss_fn=loss_fn, batch=batch)
    assert specs.blocks[0].conv1.weight == specs.blocks[0].norm.weight == P()


def test_a_wide_conv_block_is_split_for_its_flops():
    """A conv block is weighed split against whole in bytes and FLOPs (`_pricing.block_costs`): a
    3 x 3 conv's FLOPs per byte it would sum grow with its channels. The rules once weighed bytes
    alone, and over 32 x 32 pixels kept this 128-channel net's blocks whole at every shard count,
    each device doing all their work (compiled: 2x / 8x the FLOPs and 1.45x / 2.1x the peak memory
    of the Megatron plan at 2 / 8 shards; `benchmarks/plans_vs_hand.py`). An 8-channel net over the
    same pixels, its activations outweighing its FLOPs, stays whole, unless its hidden activations,
    which every device would hold whole, would not fit the memory budget beside its weights
    (`_pricing.held_whole`: 112 KiB an image at 8 shards, so 16,384 images hold 1.75 GiB)."""
    photos = {"x": jax.ShapeDtypeStruct((32, 4, 32, 32), jnp.float32), "y": jax.ShapeDtypeStruct((32,), jnp.int32)}
    wide = eqx.filter_eval_shape(lambda: GroupNormNet(hidden=256, groups=32, width=128, key=jax.random.key(0)))
    narrow = eqx.filter_eval_shape(lambda: GroupNormNet(key=jax.random.key(0)))
    for n in (2, 8):
        specs = redeqx.sharding_rules(wide, redeqx.make_mesh(n), loss_fn=loss_fn, batch=photos)
        for block in specs.blocks:
            assert block.conv1.weight == P("model", None, None, None) and block.norm.weight == P("model"), n
            assert block.conv2.weight == P(None, "model", None, None), n
        specs = redeqx.sharding_rules(narrow, redeqx.make_mesh(n), loss_fn=loss_fn, batch=photos)
        assert all(b.conv1.weight == b.conv2.weight == P() for b in specs.blocks), n
        rows = redeqx.explain(narrow, specs, redeqx.make_mesh(n), loss_fn=loss_fn, batch=photos, reasons="short")
        assert "bytes and FLOPs" in rows, rows
    many = {k: jax.ShapeDtypeStruct((1 << 14, *v.shape[1:]), v.dtype) for k, v in photos.items()}
    specs = redeqx.sharding_rules(narrow, redeqx.make_mesh(8), loss_fn=loss_fn, batch=many)
    assert all(b.conv1.weight == P("model", None, None, None) for b in specs.blocks)


class PooledConvs(eqx.Module):
    """A VGG-style stack: a pool (``eqx.nn.MaxPool2d``, ``AvgPool2d``: ``lax.reduce_window``) between
    the wide conv and the next."""

    c1: eqx.nn.Conv2d
    c2: eqx.nn.Conv2d
    c3: eqx.nn.Conv2d
    pool: eqx.Module
    head: eqx.nn.Linear

    def __init__(self, pool, *, key):
        k = jax.random.split(key, 4)
        self.c1, self.c2 = eqx.nn.Conv2d(3, 64, 3, padding=1, key=k[0]), eqx.nn.Conv2d(64, 256, 3, padding=1, key=k[1])
        self.c3, self.head = eqx.nn.Conv2d(256, 64, 3, padding=1, key=k[2]), eqx.nn.Linear(64, 10, key=k[3])
        self.pool = pool

    def __call__(self, x):  # (3, H, W) -> (10,)
        x = self.pool(jax.nn.relu(self.c2(jax.nn.relu(self.c1(x)))))
        return self.head(jax.nn.relu(self.c3(x)).mean(axis=(1, 2)))


def test_convs_either_side_of_a_pool_pair(devices):
    """A pool over pixels keeps the channels' split: the wide conv column, the conv after the pool
    row. The pool once read as an unknown op, which kept the wide conv whole (the one before it and
    it priced whole, the one after column): 1.25x / 1.32x the hand plan's bytes at 2 / 4 shards
    (16 images of 16 x 16), the wide conv's FLOPs on every device. A pool across channels (maxout)
    gives the conv after it no row partner."""
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 3, 16, 16)).astype(np.float32), "y": rng.integers(0, 10, 16).astype(np.int32)}
    rules = {"loss_fn": loss_fn, "batch": batch}
    for pool in (eqx.nn.MaxPool2d(2, 2), eqx.nn.AvgPool2d(2, 2)):
        specs = redeqx.sharding_rules(PooledConvs(pool, key=jax.random.key(0)), redeqx.make_mesh(2), **rules)
        assert specs.c2.weight == P("model", None, None, None) and specs.c3.weight == P(None, "model", None, None)
    maxout = eqx.nn.Lambda(lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (4, 1, 1), (4, 1, 1), "VALID"))
    model = eqx.tree_at(lambda m: (m.c1, m.c2, m.c3), PooledConvs(maxout, key=jax.random.key(0)),
                        (eqx.nn.Identity(), eqx.nn.Conv2d(3, 256, 3, padding=1, key=jax.random.key(2)),
                         eqx.nn.Conv2d(64, 64, 3, padding=1, key=jax.random.key(3))))
    mesh = redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(model, mesh, **rules)
    assert specs.c2.weight == P() and "reduce_window_max pools across its output features" in redeqx.explain(
        model, specs, mesh, **rules, reasons="full"), specs
    assert_trains_as_one_device(PooledConvs(eqx.nn.MaxPool2d(2, 2), key=jax.random.key(0)), batch, devices,
                                shards=(2,), rules=rules)
