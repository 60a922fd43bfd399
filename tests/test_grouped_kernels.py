"""The TPU path of the MoE's grouped matmul (megablox's Pallas kernels gmm and
tgmm, redeqx.models._grouped) run here in Pallas's interpreter, against
jax.lax.ragged_dot_general and its JAX gradient: uneven groups, empty ones,
rows past the groups, row counts and widths that are not multiples of the
tiles; then mix_experts through the kernels, vmapped and split over a mesh's
model axis (where rows past a device's own groups must come out zero)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import grouped_operands, ragged, values_and_grads

import redeqx
from redeqx.models import _grouped, mix_experts


@pytest.fixture
def kernels(monkeypatch):
    """The kernel path forced, interpreted, with small row tiles (several per group)."""
    monkeypatch.setattr(_grouped, "_interpret", True)
    monkeypatch.setattr(_grouped, "_TILES", (16, 128, 128))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("tiles", [(16, 128, 128), (16, 16, 16)])  # widths clipped / partial last tiles
@pytest.mark.parametrize("sizes", [(9, 0, 14, 0, 7), (0, 21, 3, 13, 0)])  # 30 of 40 rows; all 37
def test_kernels_match_ragged_dot(kernels, monkeypatch, dtype, tol, tiles, sizes):
    monkeypatch.setattr(_grouped, "_TILES", tiles)
    rows, w, ct, sizes = grouped_operands(sizes, dtype)
    got = values_and_grads(jax.jit(_grouped.grouped), rows, w, sizes, ct)
    want = values_and_grads(ragged, rows, w, sizes, ct)
    for name, a, b in zip(("out", "d rows", "d w"), got, want):
        assert a.dtype == b.dtype == dtype, name
        scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol * scale, rtol=0,
                                   err_msg=name)
    np.testing.assert_array_equal(got[0][sum(sizes):], 0)  # rows past the groups: zero, as ragged_dot's


def _block(key, n_experts=4, hidden=8, inter=12, seq=5, batch=4):
    ks = jax.random.split(key, 5)
    x = jax.random.normal(ks[0], (batch, seq, hidden))
    logits = jax.random.normal(ks[1], (batch, seq, n_experts))
    logits = logits.at[..., -1].add(-9.0)  # the last expert gets no token: an empty group
    weights, index = jax.lax.top_k(jax.nn.softmax(logits), 2)
    stacks = [0.3 * jax.random.normal(k, s) for k, s in zip(ks[2:], [(n_experts, inter, hidden)] * 2
                                                               + [(n_experts, hidden, inter)])]
    return x, index, weights, stacks


def _grads(x, index, weights, stacks):
    def loss(x, w, *stacks):
        return jnp.sum(jax.vmap(lambda x, i, w: mix_experts(x, i, w, *stacks))(x, index, w) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(x, weights, *stacks)


@pytest.mark.parametrize("n_model", [pytest.param(1, marks=pytest.mark.slow), 2])  # 1: 32 s; 2 keeps it fast
def test_mix_experts_through_the_kernels(monkeypatch, n_model):
    """The block's loss and gradients with the kernels equal those with ragged_dot: vmapped (the
    batch one run of rows), and under a mesh whose model axis splits the experts (each device's
    rows past its own groups zero)."""
    block = _block(jax.random.key(1))
    want = _grads(*block)
    monkeypatch.setattr(_grouped, "_interpret", True)
    monkeypatch.setattr(_grouped, "_TILES", (16, 128, 128))
    mesh = redeqx.make_mesh(n_model, devices=jax.devices()[:2 * n_model])
    with jax.set_mesh(mesh):
        got = _grads(*block)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_kernels_only_where_no_mesh_axis_splits_the_operands():
    """A Mosaic kernel cannot be split by XLA: the TPU path is taken only where every mesh axis of
    size > 1 is manual (ragged_dot elsewhere), and then in a shard_map over the rest (`_manual`)."""
    mesh = redeqx.make_mesh(4)  # data 2 x model 4
    seen = []

    def probe(x):
        seen.append(_grouped._whole())
        return x

    def run(axes):
        spec = jax.sharding.PartitionSpec(tuple(axes)) if axes else jax.sharding.PartitionSpec()
        f = jax.shard_map(probe, in_specs=spec, out_specs=spec, axis_names=set(axes)) if axes else probe
        jax.jit(f).trace(jnp.zeros(8))

    with jax.set_mesh(mesh):
        for axes in ((), ("data",), ("model",), ("data", "model")):
            run(axes)
    with jax.set_mesh(redeqx.make_mesh(8)):  # data 1 x model 8: the expert-parallel step's shard_map
        run(("model",))
    with jax.set_mesh(redeqx.make_mesh(1, devices=jax.devices()[:1])):
        run(())
    assert seen == [False, False, False, True, True, True]
