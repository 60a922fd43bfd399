"""Models built straight into their shards, and abstract states to plan with."""

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import redeqx
from redeqx.state._build import constructor


def make(key):
    return eqx.nn.MLP(256, 256, 512, depth=8, key=key)


def total_bytes(model):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)))


def test_init_model_equals_one_device_build_and_is_sharded(monkeypatch):
    monkeypatch.setattr(redeqx.sharding._specs, "FSDP_MIN_SIZE", 1)
    mesh = redeqx.make_mesh(2)
    model = redeqx.init_model(make, mesh, key=jax.random.key(0), fsdp=True)
    reference = make(jax.random.key(0))
    for a, b in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)), jax.tree.leaves(eqx.filter(reference, eqx.is_array))):
        np.testing.assert_array_equal(a, b)
    assert model.layers[0].weight.sharding.spec == P("model", "data")
    assert model.layers[1].weight.sharding.spec == P("data", "model")


def test_construction_holds_about_total_over_n_devices(monkeypatch):
    """From the compiled constructor's own figures: each device's output is
    total / 8 with fsdp (total / 2 without), and even with the random numbers
    in flight the peak stays a fraction of the whole model."""
    monkeypatch.setattr(redeqx.sharding._specs, "FSDP_MIN_SIZE", 1)
    mesh = redeqx.make_mesh(2)
    key = jax.random.key(0)
    total = total_bytes(eqx.filter_eval_shape(make, key))
    for fsdp, share in ((True, 1 / 8), (False, 1 / 2)):
        specs = redeqx.sharding_rules(eqx.filter_eval_shape(make, key), mesh, fsdp=fsdp)
        jitted, _ = constructor(make, mesh, specs, key)
        stats = jitted.lower(key).compile().memory_analysis()
        assert abs(stats.output_size_in_bytes / total - share) < 0.1 * share, (fsdp, stats.output_size_in_bytes / total)
        assert stats.output_size_in_bytes + stats.temp_size_in_bytes < 2.5 * share * total


def test_init_state_from_an_abstract_model_is_abstract_and_complete():
    mesh = redeqx.make_mesh(2)
    abstract = eqx.filter_eval_shape(make, jax.random.key(0))
    specs = redeqx.sharding_rules(abstract, mesh)
    state = redeqx.init_state(abstract, optax.adamw(1e-3), mesh, specs, key=jax.random.key(1))
    leaves = jax.tree.leaves(eqx.filter(state, lambda x: isinstance(x, jax.ShapeDtypeStruct)))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    mu = state.opt_state[0].mu.layers[0].weight  # not an empty optimizer state
    assert isinstance(mu, jax.ShapeDtypeStruct) and mu.sharding.spec == specs.layers[0].weight


def test_init_state_from_a_constructor():
    mesh = redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(eqx.filter_eval_shape(make, jax.random.key(0)), mesh)
    state = redeqx.init_state(make, optax.adam(1e-3), mesh, specs, key=jax.random.key(0))
    np.testing.assert_array_equal(state.model.layers[0].weight, make(jax.random.key(0)).layers[0].weight)
    assert state.model.layers[0].weight.sharding.spec == specs.layers[0].weight
