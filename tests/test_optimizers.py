"""optax transformations that need more than (updates, state, params): one
whose update takes the loss (``value=``, as reduce_on_plateau does) and
``optax.MultiSteps`` (issue 23, items 1 and 2), each against a hand-written
loop on one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redeqx
from _helpers import mlp, sharded_state, xent_loss as loss_fn


def make_model():
    return mlp(4, 3)


def batches(n=4):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.integers(0, 3, 8).astype(np.int32)}
            for _ in range(n)]


def by_hand(optimizer, data, value: bool):
    """A plain loop on one device: what make_train_step must compute."""
    model = make_model()
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = optimizer.init(params)

    @jax.jit  # as a user's hand-written step is (op by op, each op compiled on its own)
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), batch, None))(params)
        kwargs = {"value": loss} if value else {}
        updates, opt_state = optimizer.update(grads, opt_state, params, **kwargs)
        return optax.apply_updates(params, updates), opt_state

    for batch in data:
        params, opt_state = step(params, opt_state, batch)
    return params


def with_redeqx(optimizer, data, n_model_shards):
    mesh = redeqx.make_mesh(n_model_shards)
    specs, state = sharded_state(make_model(), optimizer, mesh)
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    for batch in data:
        state, _ = step(state, batch)
    return eqx.filter(state.model, eqx.is_array)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_model_shards", [1, 2])
def test_an_optimizer_that_takes_the_loss_gets_it(n_model_shards):
    # a plateau of one step halves the rate: the learning rate depends on the losses it was given
    optimizer = optax.chain(optax.adam(0.1), optax.contrib.reduce_on_plateau(patience=0, factor=0.5,
                                                                            accumulation_size=1))
    data = batches()
    assert_same(with_redeqx(optimizer, data, n_model_shards), by_hand(optimizer, data, value=True))


@pytest.mark.parametrize("n_model_shards", [1, 2])
def test_multi_steps_is_accepted_and_updates_every_k_steps(n_model_shards):
    optimizer = optax.MultiSteps(optax.adam(0.1), every_k_schedule=2)
    data = batches()
    assert_same(with_redeqx(optimizer, data, n_model_shards),
                by_hand(optimizer.gradient_transformation(), data, value=False))
    mesh = redeqx.make_mesh(n_model_shards)
    specs, state = sharded_state(make_model(), optimizer, mesh)
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    first, _ = step(state, data[0])
    # the first of two micro-steps only accumulates: the parameters have not moved yet
    assert_same(eqx.filter(first.model, eqx.is_array), eqx.filter(make_model(), eqx.is_array))
    assert int(first.step) == 1


def test_an_optimizer_state_of_another_optimizer_is_named():
    mesh = redeqx.make_mesh(2)
    specs, state = sharded_state(make_model(), optax.adam(0.1), mesh)
    step = redeqx.make_train_step(loss_fn, optax.MultiSteps(optax.adam(0.1), 2), mesh, specs)
    with pytest.raises(ValueError, match="state.opt_state does not match"):
        step(state, batches(1)[0])


def test_with_multisteps_state_step_counts_batches_and_the_parameters_move_every_kth(devices):
    """What the README says `state.step` counts: after 4 batches with
    optax.MultiSteps(k=2), state.step is 4 and the parameters moved twice."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import redeqx

    mesh = redeqx.make_mesh(2)
    optimizer = optax.MultiSteps(optax.sgd(0.1), 2)
    specs, state = sharded_state(mlp(depth=1), optimizer, mesh)
    step = redeqx.make_train_step(lambda m, b, k: jnp.mean(jax.vmap(m)(b["x"]) ** 2), optimizer, mesh, specs)
    weights, moves = np.asarray(state.model.layers[0].weight), 0
    for _ in range(4):
        state, _ = step(state, {"x": jnp.ones((8, 8))})
        now = np.asarray(state.model.layers[0].weight)
        moves += not np.array_equal(now, weights)
        weights = now
    assert int(state.step) == 4 and moves == 2 and int(state.opt_state.gradient_step) == 2


def linear_loss(model, batch, key):
    """A loss whose value and gradients are exact in float32 whatever the
    order of the sums (dyadic weights times powers of two), so two programs
    give the same bits: what the optimizer update makes of them is compared."""
    return jnp.sum(model.weight * batch["gw"].mean(0)) + jnp.sum(model.bias * batch["gb"].mean(0))


@pytest.mark.parametrize("optimizer, trainable", [
    (optax.chain(optax.sgd(0.5), optax.contrib.reduce_on_plateau(patience=0, factor=0.5, accumulation_size=1)), None),
    (optax.adam(0.25), None),
    (optax.sgd(0.5, momentum=0.5), "weight only"),
])
def test_the_train_step_and_apply_gradients_update_alike(optimizer, trainable):
    """One optimizer update serves both: the same gradients (and the loss as
    ``value=`` for reduce_on_plateau) give bit-identical states."""
    rng = np.random.default_rng(0)
    model = eqx.nn.Linear(4, 3, key=jax.random.key(0))
    model = eqx.tree_at(lambda m: (m.weight, m.bias), model,
                        (jnp.asarray(rng.integers(-8, 8, (3, 4)) / 8, jnp.float32), jnp.asarray(rng.integers(-8, 8, 3) / 8, jnp.float32)))
    if trainable is not None:
        trainable = eqx.tree_at(lambda m: (m.weight, m.bias), jax.tree.map(lambda _: False, model), (True, False))
    mesh = redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(model, mesh)
    batch = {"gw": np.full((8, 3, 4), 2.0 ** -rng.integers(0, 4, (3, 4)), np.float32),
             "gb": np.full((8, 3), 2.0 ** -rng.integers(0, 4, 3), np.float32)}
    train_step = redeqx.make_train_step(linear_loss, optimizer, mesh, specs, trainable=trainable)

    def by_hand(state, batch):
        loss, grads = eqx.filter_value_and_grad(linear_loss)(state.model, batch, None)
        return redeqx.apply_gradients(state, grads, optimizer, trainable=trainable, value=loss), loss

    by_hand = redeqx.make_step(by_hand, mesh)
    a, b = (redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1), trainable=trainable) for _ in "ab")
    for _ in range(3):
        a, metrics = train_step(a, batch)
        b, loss = by_hand(b, batch)
        assert float(metrics["loss"]) == float(loss)
    for x, y in zip(jax.tree.leaves((a.model, a.opt_state, a.step)), jax.tree.leaves((b.model, b.opt_state, b.step))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_state_stored_in_bfloat16_keeps_its_scalars_and_takes_the_loss():
    """Before, every floating leaf was stored in bfloat16: ``inject_hyperparams``' b2 = 0.999 became
    1.0, Adam's second moment never grew, and the second step was NaN. An optimizer taking the loss
    (``reduce_on_plateau``) did not get it through the wrapper; float16 (whose range underflows the
    second moment: updates 13x too large) was accepted."""
    inner = optax.chain(optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
                        optax.contrib.reduce_on_plateau(patience=0, factor=0.5, accumulation_size=1))
    optimizer = redeqx.with_opt_state_dtype(inner, jnp.bfloat16)
    params = {"w": jnp.ones((3, 2)), "scale": jnp.ones(())}
    state = optimizer.init(params)
    for loss in (1.0, 2.0):  # the loss rose: the plateau halves the rate
        _, state = jax.jit(optimizer.update)(params, state, params, value=jnp.float32(loss))
    adam, plateau = state
    assert adam.hyperparams["b2"].dtype == jnp.float32 and float(adam.hyperparams["b2"]) == np.float32(0.999)
    assert adam.inner_state[0].nu["w"].dtype == jnp.bfloat16 and float(adam.inner_state[0].nu["w"][0, 0]) > 0
    assert float(plateau.scale) == 0.5
    with pytest.raises(ValueError, match="dtype=float16 has a narrower range than float32.*jnp.bfloat16"):
        redeqx.with_opt_state_dtype(optax.adam(1e-3), jnp.float16)


def test_gradients_of_part_of_the_model_without_trainable_are_named():
    """Gradients of one part of the model (``eqx.partition``: None on the frozen part), the state made
    without ``trainable=``: optax's pytree-structure error named neither the leaves nor the fix."""
    model = make_model()
    state = redeqx.init_state(model, optax.adam(0.1), redeqx.make_mesh(1, devices=jax.devices()[:1]),
                              redeqx.sharding_rules(model, redeqx.make_mesh(1, devices=jax.devices()[:1])),
                              key=jax.random.key(0))
    head_only = jax.tree.map(lambda _: False, model)
    head_only = eqx.tree_at(lambda m: (m.layers[-1].weight, m.layers[-1].bias), head_only, (True, True))
    grads = eqx.filter(jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_array)), head_only)
    with pytest.raises(ValueError,
                       match=r"no gradient for \d+ trainable parameters \(\.layers\[0\]\.weight.*trainable="):
        redeqx.apply_gradients(state, grads, optax.adam(0.1))
