"""States beyond one model: several models with their own optimizers (actor +
critic) through make_step, and models with state (BatchNorm) through the
standard train / eval / predict steps; each against one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx

# ----------------------------------------------------------------------------- several models


def actor_critic(key):
    ka, kc = jax.random.split(key)
    return (eqx.nn.MLP(8, 4, 32, depth=2, key=ka),  # actor: logits over 4 actions
            eqx.nn.MLP(8, "scalar", 32, depth=2, key=kc))  # critic: a value


def ac_losses(actor, critic, batch):
    logp = jax.nn.log_softmax(jax.vmap(actor)(batch["obs"]))
    value = jax.vmap(critic)(batch["obs"])
    advantage = batch["ret"] - value
    actor_loss = -jnp.mean(jnp.take_along_axis(logp, batch["act"][:, None], 1)[:, 0]
                           * jax.lax.stop_gradient(advantage))
    return actor_loss, jnp.mean(advantage**2)


OPT_A, OPT_C = optax.adam(3e-3), optax.sgd(1e-2, momentum=0.9)


def ac_step(state, batch):
    actor, critic = state["actor"], state["critic"]
    ga = eqx.filter_grad(lambda a: ac_losses(a, critic.model, batch)[0])(actor.model)
    gc = eqx.filter_grad(lambda c: ac_losses(actor.model, c, batch)[1])(critic.model)
    ua, oa = OPT_A.update(ga, actor.opt_state, actor.model)
    uc, oc = OPT_C.update(gc, critic.opt_state, critic.model)
    new_actor = eqx.tree_at(lambda s: (s.model, s.opt_state, s.step), actor,
                            (eqx.apply_updates(actor.model, ua), oa, actor.step + 1))
    new_critic = eqx.tree_at(lambda s: (s.model, s.opt_state, s.step), critic,
                             (eqx.apply_updates(critic.model, uc), oc, critic.step + 1))
    return {"actor": new_actor, "critic": new_critic}, dict(zip(("actor", "critic"), ac_losses(actor.model, critic.model, batch)))


def ac_batch(i, n=16):
    rng = np.random.default_rng(i)
    return {"obs": rng.normal(size=(n, 8)).astype(np.float32), "act": rng.integers(0, 4, n).astype(np.int32),
            "ret": rng.normal(size=n).astype(np.float32)}


def test_several_models_in_one_state_match_plain_jax(tmp_path):
    actor, critic = actor_critic(jax.random.key(0))
    # plain JAX on one device
    ref = (actor, critic, OPT_A.init(eqx.filter(actor, eqx.is_array)), OPT_C.init(eqx.filter(critic, eqx.is_array)))
    ref_losses = []
    for i in range(3):
        a, c, oa, oc = ref
        b = jax.tree.map(jnp.asarray, ac_batch(i))
        ga = eqx.filter_grad(lambda a: ac_losses(a, c, b)[0])(a)
        gc = eqx.filter_grad(lambda c: ac_losses(a, c, b)[1])(c)
        ua, oa = OPT_A.update(ga, oa, a)
        uc, oc = OPT_C.update(gc, oc, c)
        ref_losses.append(ac_losses(a, c, b))
        ref = (eqx.apply_updates(a, ua), eqx.apply_updates(c, uc), oa, oc)

    mesh = redeqx.make_mesh(2)
    a_specs = redeqx.sharding_rules(actor, mesh, name="actor")
    c_specs = redeqx.sharding_rules(critic, mesh, name="critic")
    state = {"actor": redeqx.init_state(actor, OPT_A, mesh, a_specs, key=jax.random.key(1)),
             "critic": redeqx.init_state(critic, OPT_C, mesh, c_specs, key=jax.random.key(2))}
    step = redeqx.make_step(ac_step, mesh)
    manager = redeqx.CheckpointManager(tmp_path, keep_last=1, async_save=False)
    for i in range(3):
        state, losses = step(state, ac_batch(i))
        np.testing.assert_allclose([losses["actor"], losses["critic"]], ref_losses[i], rtol=1e-5, atol=1e-6)
        assert manager.save(state)  # the step comes from the TrainStates inside
    for got, want in ((state["actor"].model, ref[0]), (state["critic"].model, ref[1])):
        for x, y in zip(jax.tree.leaves(eqx.filter(got, eqx.is_array)), jax.tree.leaves(eqx.filter(want, eqx.is_array))):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    # each model keeps its own layout through the step
    w = state["actor"].model.layers[0].weight
    assert w.sharding.spec == a_specs.layers[0].weight
    assert state["actor"].opt_state[0].mu.layers[0].weight.sharding.spec == w.sharding.spec
    assert state["critic"].opt_state[0].trace.layers[0].weight.sharding.spec == c_specs.layers[0].weight

    # restore into the live layout (no specs needed for a tree of models)
    restored, meta = manager.restore(state, mesh)
    assert meta["step"] == 3
    for x, y in zip(jax.tree.leaves(eqx.filter(restored, eqx.is_array)), jax.tree.leaves(eqx.filter(state, eqx.is_array))):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert x.sharding == y.sharding
    manager.close()


def test_a_target_network_made_of_the_online_arrays_trains_and_stays():
    """A DQN-style target network set to the online model's arrays (``target = online.model``): the
    step donates its state, and one array at two places of it made XLA:CPU donate a buffer twice and
    kill the process (a segfault, no Python error). The second place now gets a copy."""
    actor, critic = actor_critic(jax.random.key(0))
    mesh = redeqx.make_mesh(2)
    a_specs, c_specs = redeqx.sharding_rules(actor, mesh), redeqx.sharding_rules(critic, mesh)
    online = redeqx.init_state(actor, OPT_A, mesh, a_specs, key=jax.random.key(1))
    state = {"actor": online, "critic": redeqx.init_state(critic, OPT_C, mesh, c_specs, key=jax.random.key(2)),
             "target": online.model}
    before = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(actor, eqx.is_array))]

    def step(state, batch):
        new, losses = ac_step({"actor": state["actor"], "critic": state["critic"]}, batch)
        return {**new, "target": state["target"]}, losses

    new, _ = redeqx.make_step(step, mesh)(state, ac_batch(0))
    for x, y in zip(jax.tree.leaves(eqx.filter(new["target"], eqx.is_array)), before):
        np.testing.assert_array_equal(np.asarray(x), y)  # the target did not move
    assert not np.array_equal(np.asarray(new["actor"].model.layers[0].weight), before[0])  # the online model did


def test_init_opt_state_mirrors_parameters():
    mesh = redeqx.make_mesh(2)
    actor, _ = actor_critic(jax.random.key(0))
    specs = redeqx.sharding_rules(actor, mesh)
    opt_state = redeqx.init_opt_state(actor, optax.adamw(1e-3), mesh, specs)
    assert opt_state[0].mu.layers[0].weight.sharding.spec == specs.layers[0].weight
    assert opt_state[0].count.sharding.spec == jax.sharding.PartitionSpec()
    with pytest.warns(DeprecationWarning, match=r"init_opt_state\(model, optimizer, mesh, specs\)"):
        old_order = redeqx.init_opt_state(optax.adamw(1e-3), actor, mesh, specs)  # redeqx 0.1.0's order, one release
    for x, y in zip(jax.tree.leaves(opt_state), jax.tree.leaves(old_order)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert x.sharding == y.sharding


# ----------------------------------------------------------------------------- models with state


class BNNet(eqx.Module):
    fc1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    fc2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(8, 32, key=k1)
        self.bn = eqx.nn.BatchNorm(32, axis_name="batch")
        self.fc2 = eqx.nn.Linear(32, 3, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(self.fc1(x), state)
        return self.fc2(jax.nn.relu(h)), state


def bn_loss(model, batch, key, model_state):
    logits, model_state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        batch["x"], model_state)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": jnp.mean(logits.argmax(-1) == batch["y"])}, model_state


def bn_pred(model, batch, key, model_state):
    logits, _ = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(batch["x"], model_state)
    return logits


def bn_examples(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32) * 3 + 1
    return [{"x": xi, "y": int(xi[:3].argmax())} for xi in x]


def bn_collate(examples):
    return {"x": np.stack([e["x"] for e in examples]), "y": np.array([e["y"] for e in examples], np.int32)}


def run_bn(n_model_shards, devices):
    mesh = redeqx.make_mesh(n_model_shards, devices=devices)
    model, model_state = eqx.nn.make_with_state(BNNet)(jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh, loss_fn=bn_loss, batch=bn_collate(bn_examples(16, 0)),
                                  model_state=model_state)  # the roles read from the stateful program
    optimizer = optax.sgd(0.1)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1), model_state=model_state)
    step = redeqx.make_train_step(bn_loss, optimizer, mesh, specs)
    losses = []
    for batch in redeqx.batches(bn_examples(64, 0), bn_collate, 16 // mesh.shape["data"], mesh):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    test = bn_examples(20, 1)
    eval_step = redeqx.make_eval_step(bn_loss, mesh, specs)
    results = redeqx.evaluate(eval_step, state.model, test, bn_collate, 2, mesh, key=jax.random.key(2),
                              model_state=state.model_state)
    predict_step = redeqx.make_predict_step(bn_pred, mesh, specs)
    preds = redeqx.predict(predict_step, state.model, test, bn_collate, 2, mesh, key=jax.random.key(3),
                           model_state=state.model_state)
    return losses, state, results, np.stack(preds)


def test_batchnorm_model_matches_one_device(devices):
    ref_losses, ref, ref_results, ref_preds = run_bn(1, devices[:1])
    losses, state, results, preds = run_bn(2, devices)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(state.model_state), jax.tree.leaves(ref.model_state)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)  # running statistics were updated the same way
    running = [x for x in jax.tree.leaves(state.model_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert running and not all(np.allclose(x, 0.0) or np.allclose(x, 1.0) for x in running)  # statistics moved
    for k in ref_results:
        np.testing.assert_allclose(results[k], ref_results[k], rtol=1e-5)
    np.testing.assert_allclose(preds, ref_preds, rtol=1e-4, atol=1e-5)


def test_stateful_loss_fn_must_return_its_state():
    mesh = redeqx.make_mesh(2)
    model, model_state = eqx.nn.make_with_state(BNNet)(jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.adam(1e-2), mesh, specs, key=jax.random.key(1), model_state=model_state)
    step = redeqx.make_train_step(lambda m, b, k, s: bn_loss(m, b, k, s)[0], optax.adam(1e-2), mesh, specs)
    with pytest.raises(TypeError, match=r"must return \(loss, new_model_state\)"):
        step(state, bn_collate(bn_examples(16, 0)))
    # (loss, aux) from a stateful loss: the aux dict was taken for the state (a 3,000-character pytree diff)
    step = redeqx.make_train_step(lambda m, b, k, s: (bn_loss(m, b, k, s)[0], {"n": 1.0}), optax.adam(1e-2), mesh,
                                  specs)
    with pytest.raises(TypeError, match=r"returned as the new model_state \(\{'n': 1.0\}\) is not a model_state"):
        step(state, bn_collate(bn_examples(16, 0)))
    # a stateful loss given no state: Python's "missing 1 required positional argument" named no fix
    plain = redeqx.init_state(model, optax.adam(1e-2), mesh, specs, key=jax.random.key(1))
    with pytest.raises(TypeError, match=r"takes a model_state .* but none was given.*model_state="):
        redeqx.make_train_step(bn_loss, optax.adam(1e-2), mesh, specs)(plain, bn_collate(bn_examples(16, 0)))


def test_the_rules_read_a_stateful_loss_given_its_state_and_name_what_is_missing():
    """Before, a stateful loss_fn could not be read at all: the rules called it with three
    arguments and said only to pass it 'exactly as make_train_step receives' it."""
    mesh = redeqx.make_mesh(2)
    model, model_state = eqx.nn.make_with_state(BNNet)(jax.random.key(0))
    batch = bn_collate(bn_examples(16, 0))
    with pytest.raises(TypeError, match=r"takes a model_state .* model_state=state.model_state"):
        redeqx.sharding_rules(model, mesh, loss_fn=bn_loss, batch=batch)
    with pytest.raises(TypeError, match=r"signature \(m, b\), but redeqx calls it as loss_fn\(model, batch, key\)"):
        redeqx.sharding_rules(model, mesh, loss_fn=lambda m, b: 0.0, batch=batch)
    specs = redeqx.sharding_rules(model, mesh, loss_fn=bn_loss, batch=batch, model_state=model_state)
    table = redeqx.explain(model, specs, mesh, loss_fn=bn_loss, batch=batch, model_state=model_state)
    # read from the program: BatchNorm's batch statistics (a psum over vmap's axis) are per feature, so
    # the hidden layer is Megatron's, BatchNorm's scale and shift beside it. The reader once stopped at
    # the psum and left fc1 whole: a 32 -> 256 -> 32 -> 10 net moved 76,152 collective bytes a step at
    # 2 shards and 84,632 at 4, against 42,944 and 26,304 placed by hand, which the rules now equal
    assert "fc1.weight" in table and "column parallel" in table and "passes through psum" not in table, table
    assert (specs.fc1.weight, specs.bn.weight, specs.fc2.weight) == (P("model", None), P("model"), P(None, "model"))


def test_a_model_with_state_is_planned_with_its_state():
    """`plan` refused a stateful loss, naming a model_state= it did not take."""
    mesh = redeqx.make_mesh(2)
    model, model_state = eqx.nn.make_with_state(BNNet)(jax.random.key(0))
    batch = bn_collate(bn_examples(16, 0))
    with pytest.raises(TypeError, match=r"takes a model_state .* model_state="):
        redeqx.plan(model, bn_loss, optax.sgd(0.1), batch, mesh, explore=False)
    p = redeqx.plan(model, bn_loss, optax.sgd(0.1), batch, mesh, explore=False, model_state=model_state)
    # the step it compiled is the real one: its peak is the real step's
    specs = redeqx.sharding_rules(model, mesh, loss_fn=bn_loss, batch=batch, model_state=model_state)
    state = redeqx.init_state(model, optax.sgd(0.1), mesh, specs, key=jax.random.key(1), model_state=model_state)
    step = redeqx.make_train_step(bn_loss, optax.sgd(0.1), mesh, specs)
    stats = step.lower(state, next(iter(redeqx.batches(bn_examples(16, 0), bn_collate, 4, mesh)))).compile() \
        .memory_analysis()
    assert p.peak == (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                      + stats.temp_size_in_bytes)
    assert "all-reduce" in p.collectives and p.flops > 0
