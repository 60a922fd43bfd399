"""Which of several splits that compete for one weight the program's rules take: the one that splits
the most weight, unless another costs clearly less a step (`_pricing.Cost`: the activations summed
over 'model', the gradients summed over 'data', the FLOPs each device does)."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from redeqx.sharding import _roles
from redeqx.sharding._program import read_program


class Block(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.fc1, self.fc2 = eqx.nn.Linear(64, 256, key=k1), eqx.nn.Linear(256, 64, key=k2)

    def __call__(self, x):
        return x + self.fc2(jax.nn.relu(self.fc1(x)))


class ResidualMLP(eqx.Module):
    """A residual MLP as people write one for tabular data: no norms anywhere."""

    stem: eqx.nn.Linear
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
        ks = jax.random.split(key, 4)
        self.stem, self.head = eqx.nn.Linear(32, 64, key=ks[0]), eqx.nn.Linear(64, 10, key=ks[1])
        self.blocks = [Block(k) for k in ks[2:]]

    def __call__(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(model, batch, key):
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


BATCH = {"x": jax.ShapeDtypeStruct((512, 32), jnp.float32), "y": jax.ShapeDtypeStruct((512,), jnp.int32)}


def rules(model, n, batch=BATCH):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return redeqx.sharding_rules(model, redeqx.make_mesh(n), loss_fn=loss_fn, batch=batch)


@pytest.mark.parametrize("rows", [64, 512])
def test_a_residual_mlp_without_norms_is_split_megatron_not_on_its_stream(rows):
    """Nothing keeps the stream whole here, so two splits compete: the stream's (stem column, each
    block's ``fc1`` row and ``fc2`` column, the head row), which splits the most weight, and
    Megatron's (``fc1`` column, ``fc2`` row). The stream's sums the 256-wide hidden activations
    over 'model', Megatron's the 64-wide stream: compiled, 668,368 B a step against 274,756 at 2
    shards, 1,129,360 against 339,780 at 4 (`benchmarks`' accelerator count; the hand-written
    Megatron plan's bytes to the byte, and its peak memory). At 64 rows the gradients' sums, the same
    in both, weigh more: the whole estimates were too close to tell, and the stream won at 2 shards
    (1.30x the bytes) until the two were compared on what they do not share."""
    model = eqx.filter_eval_shape(ResidualMLP, jax.random.key(0))
    batch = {"x": jax.ShapeDtypeStruct((rows, 32), jnp.float32), "y": jax.ShapeDtypeStruct((rows,), jnp.int32)}
    for n in (2, 4):
        specs = rules(model, n, batch)
        for block in specs.blocks:
            assert (block.fc1.weight, block.fc1.bias, block.fc2.weight, block.fc2.bias) == (
                P("model", None), P("model"), P(None, "model"), P()), n
        assert specs.stem.weight == specs.head.weight == P(), n
    mesh = redeqx.make_mesh(4)
    assert "replicated: a competing block's split was chosen" in redeqx.explain(model, specs, mesh, loss_fn=loss_fn,
                                                                                batch=batch)
    assert "than a block chosen over it (more weight split, or fewer bytes and FLOPs a step)" in redeqx.explain(
        model, specs, mesh, loss_fn=loss_fn, batch=batch, reasons="full")


def test_an_mlp_chain_still_pairs_from_its_first_layer():
    """Where the pairings differ by little (the first layer whole, or the head), the one that splits
    the most weight is kept, whatever the batch: Megatron's pairs from the first layer."""
    for width, rows in ((64, 64), (256, 512), (1024, 4096)):
        model = eqx.filter_eval_shape(eqx.nn.MLP, 32, 16, width, 4, key=jax.random.key(0))
        batch = {"x": jax.ShapeDtypeStruct((rows, 32), jnp.float32), "y": jax.ShapeDtypeStruct((rows,), jnp.int32)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            specs = redeqx.sharding_rules(model, redeqx.make_mesh(2), loss_fn=loss_fn, batch=batch)
        assert [layer.weight for layer in specs.layers] == [P("model", None), P(None, "model")] * 2 + [P()], width


def test_a_first_layer_has_no_input_gradient_to_sum():
    """The batch's values are no weight's function: their gradient is never computed, so splitting
    the layer that reads them sums nothing backward. A layer's input made from weights (through a
    ``jax.checkpoint``, whose body reads its arguments) is counted."""
    model = ResidualMLP(jax.random.key(0))
    paths = [jax.tree_util.keystr(p, simple=True, separator=".")
             for p, _ in jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))]

    def checkpointed(m, b, key):
        def forward(x):
            x = m.stem(x)
            for block in m.blocks:
                x = jax.checkpoint(lambda block, x: block(x))(block, x)
            return m.head(x)

        return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(forward)(b["x"]), b["y"]).mean()

    for loss in (loss_fn, checkpointed):
        facts = read_program(model, loss, BATCH, paths)
        read = {path: facts.activation_bytes(k)[0] for k, path in enumerate(paths)}
        assert read["stem.weight"] == 0, loss
        assert read["blocks.0.fc1.weight"] == read["head.weight"] == 512 * 64 * 4, loss
        assert read["blocks.0.fc2.weight"] == 512 * 256 * 4, loss


class Inverted(eqx.Module):
    """MobileNetV2's inverted residual: a 1x1 expansion, a 3x3 depthwise conv, a 1x1 projection."""

    expand: eqx.nn.Conv2d
    dw: eqx.nn.Conv2d
    project: eqx.nn.Conv2d

    def __init__(self, c, key):
        k = jax.random.split(key, 3)
        self.expand = eqx.nn.Conv2d(c, 6 * c, 1, use_bias=False, key=k[0])
        self.dw = eqx.nn.Conv2d(6 * c, 6 * c, 3, padding=1, groups=6 * c, use_bias=False, key=k[1])
        self.project = eqx.nn.Conv2d(6 * c, c, 1, use_bias=False, key=k[2])

    def __call__(self, x):
        return x + self.project(jax.nn.relu6(self.dw(jax.nn.relu6(self.expand(x)))))


class MobileNet(eqx.Module):
    """A MobileNetV2 as written without BatchNorm: a stem, inverted residual blocks, a 1x1 conv and
    a classifier; a chain of 1x1 convs with no norm to break it (a stem-expansion pairing, then each
    projection with the next block's expansion, competes with Megatron's pairs)."""

    stem: eqx.nn.Conv2d
    blocks: list
    last: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, depth, key):
        ks = jax.random.split(key, depth + 3)
        self.stem, self.last = eqx.nn.Conv2d(3, 16, 3, padding=1, key=ks[0]), eqx.nn.Conv2d(16, 64, 1, key=ks[1])
        self.head = eqx.nn.Linear(64, 10, key=ks[2])
        self.blocks = [Inverted(16, k) for k in ks[3:]]

    def __call__(self, x):
        x = jax.nn.relu6(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(jax.nn.relu6(self.last(x)).mean(axis=(1, 2)))


@pytest.mark.parametrize("depth,many", [(10, 4096), (17, 4096), (17, 1)])
def test_a_deep_chain_of_convs_is_split_megatron_not_on_its_stream(depth, many, monkeypatch):
    """Past 12 competing groups the choice once took them in program order from the first, pairing a
    MobileNetV2's stem with its first expansion and each projection with the next expansion: the
    narrow stream split, its wide hidden activations summed (helper's review, 7 blocks: 4.2-4.5x the
    bytes and 1.8-4.6x the peak memory of Megatron's pairs at 2-8 shards). Now the cheapest of its
    maximal conflict-free sets (all of them up to 4,096; else those in program order from each
    group, as here with ``many=1``): each block's expansion column, its depthwise conv beside it, its
    projection row."""
    monkeypatch.setattr(_roles, "MAXIMAL_SETS", many)
    photos = {"x": jax.ShapeDtypeStruct((16, 3, 16, 16), jnp.float32), "y": jax.ShapeDtypeStruct((16,), jnp.int32)}
    model = eqx.filter_eval_shape(lambda: MobileNet(depth, jax.random.key(0)))
    for n in (2, 8):
        specs = redeqx.sharding_rules(model, redeqx.make_mesh(n), loss_fn=loss_fn, batch=photos)
        for block in specs.blocks:
            assert block.expand.weight == block.dw.weight == P("model", None, None, None), (depth, n)
            assert block.project.weight == P(None, "model", None, None), (depth, n)
        assert specs.stem.weight == P(), (depth, n)


class MBConv(eqx.Module):
    """EfficientNet's block: a 1x1 expansion, a depthwise conv, squeeze-excite (two 1x1 convs on the
    pooled channels, gating them), a 1x1 projection, residual."""

    expand: eqx.nn.Conv2d
    dw: eqx.nn.Conv2d
    se1: eqx.nn.Conv2d
    se2: eqx.nn.Conv2d
    proj: eqx.nn.Conv2d

    def __init__(self, key, c=64, e=256, r=16):
        k = jax.random.split(key, 5)
        self.expand, self.dw = eqx.nn.Conv2d(c, e, 1, key=k[0]), eqx.nn.Conv2d(e, e, 3, padding=1, groups=e, key=k[1])
        self.se1, self.se2 = eqx.nn.Conv2d(e, r, 1, key=k[2]), eqx.nn.Conv2d(r, e, 1, key=k[3])
        self.proj = eqx.nn.Conv2d(e, c, 1, key=k[4])

    def __call__(self, x):
        h = jax.nn.silu(self.dw(jax.nn.silu(self.expand(x))))
        h = h * jax.nn.sigmoid(self.se2(jax.nn.silu(self.se1(jnp.mean(h, (1, 2), keepdims=True)))))
        return x + self.proj(h)


class EfficientNetStack(eqx.Module):
    stem: eqx.nn.Conv2d
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 6)
        self.stem, self.head = eqx.nn.Conv2d(3, 64, 3, padding=1, key=k[0]), eqx.nn.Linear(64, 10, key=k[5])
        self.blocks = [MBConv(kk) for kk in k[1:5]]

    def __call__(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, (1, 2)))


def test_blocks_of_one_kind_take_one_of_their_competing_splits():
    """Each MBConv's expansion/projection pair competes with its squeeze-excite pair. Weighed set by
    set, the plan at 4 shards split the squeeze-excite pairs of the first three blocks and the
    expansion/projection pair of the last alone (splitting all four squeeze-excite pairs would take
    the stream split besides): now every block takes the same one."""
    model = eqx.filter_eval_shape(EfficientNetStack, jax.random.key(0))
    batch = {"x": jax.ShapeDtypeStruct((16, 3, 16, 16), jnp.float32), "y": jax.ShapeDtypeStruct((16,), jnp.int32)}
    for n in (2, 4):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            specs = redeqx.sharding_rules(model, redeqx.make_mesh(n), loss_fn=loss_fn, batch=batch)
        layouts = {tuple(jax.tree.leaves(b, is_leaf=lambda x: isinstance(x, P))) for b in specs.blocks}
        assert len(layouts) == 1, (n, layouts)
    assert specs.blocks[0].expand.weight == P("model", None, None, None)  # at 4: Megatron's pairs
    assert specs.blocks[0].proj.weight == P(None, "model", None, None)
