"""Sharded training computes what a single-device run computes."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redeqx
from _helpers import mlp, mse_loss, sharded_state
from tiny_transformer import TinyLM, collate_tokens, lm_loss, token_examples

N_STEPS = 5
GLOBAL_BATCH = 16


def train(n_model_shards, devices, *, accumulate=1, compute_dtype=None, n_steps=N_STEPS, fsdp=False, loss_fn=lm_loss):
    mesh = redeqx.make_mesh(n_model_shards, devices=devices)
    model = TinyLM(vocab=56, dim=48, n_heads=4, hidden=80, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh, fsdp=fsdp)
    optimizer = optax.adamw(3e-3, weight_decay=0.1)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs, accumulate=accumulate,
                                  compute_dtype=compute_dtype)
    per_device = GLOBAL_BATCH // mesh.shape["data"]
    examples = token_examples(GLOBAL_BATCH * n_steps, vocab=56)
    losses = []
    for batch in redeqx.batches(examples, collate_tokens, per_device, mesh):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return np.asarray(losses), state


@pytest.fixture(scope="module")
def reference():
    return {acc: train(1, jax.devices()[:1], accumulate=acc) for acc in (1, 2)}


@pytest.fixture(scope="module")
def two_shards():
    """The float32 run at n_model_shards=2: compared with one device below, its state's shardings read,
    and its first loss the bfloat16 run's reference (the first step's batch is the same whatever n_steps)."""
    return train(2, jax.devices())


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("n_model_shards", [1, 2, 4, 8])
def test_matches_single_device(reference, two_shards, n_model_shards, accumulate, devices):
    ref_losses, ref_state = reference[accumulate]
    if (n_model_shards, accumulate) == (2, 1):
        losses, state = two_shards
    else:
        losses, state = train(n_model_shards, devices, accumulate=accumulate)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-6)
    for a, b in zip(jax.tree.leaves(eqx.filter(state.model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(ref_state.model, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert int(state.step) == N_STEPS


def test_fsdp_matches_single_device(reference, devices, monkeypatch):
    monkeypatch.setattr(redeqx.sharding._specs, "FSDP_MIN_SIZE", 1)  # this tiny model's leaves count as large
    ref_losses, ref_state = reference[1]
    losses, state = train(2, devices, fsdp=True)
    assert state.model.blocks[0].mlp.fc1.weight.sharding.spec == jax.sharding.PartitionSpec("model", "data")
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-6)
    for a, b in zip(jax.tree.leaves(eqx.filter(state.model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(ref_state.model, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_accumulate_equals_big_batch(reference):
    np.testing.assert_allclose(reference[2][0], reference[1][0], rtol=2e-5, atol=2e-6)


def test_accumulating_a_loss_that_is_no_row_mean_warns_once():
    """``accumulate`` averages its micro-batches' gradients: a mean over the batch's non-padding
    tokens then trains on another update than the whole batch's (here half the rows hold one real
    token), which went unsaid. The first call warns; a mean over rows does not."""
    mesh = redeqx.make_mesh(2)
    model = eqx.nn.Linear(4, 3, key=jax.random.key(0))
    x = np.random.RandomState(0).randn(16, 5, 4).astype(np.float32)
    mask = np.ones((16, 5), np.float32)
    mask[1::2, 1:] = 0  # every other row: one real token
    batch = {"x": x, "mask": mask}

    def token_mean(model, batch, key):
        per_token = jnp.sum(jax.vmap(jax.vmap(model))(batch["x"]) ** 2, -1)
        return jnp.sum(per_token * batch["mask"]) / jnp.sum(batch["mask"])

    def row_mean(model, batch, key):
        per_token = jnp.sum(jax.vmap(jax.vmap(model))(batch["x"]) ** 2, -1)
        return jnp.mean(jnp.sum(per_token * batch["mask"], 1) / jnp.sum(batch["mask"], 1))

    specs = redeqx.sharding_rules(model, mesh)
    for loss_fn, warns in ((token_mean, True), (row_mean, False)):
        state = redeqx.init_state(model, optax.sgd(0.1), mesh, specs, key=jax.random.key(1))
        step = redeqx.make_train_step(loss_fn, optax.sgd(0.1), mesh, specs, accumulate=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, _ = step(state, batch)
            state, _ = step(state, batch)
        said = [str(w.message) for w in caught if "accumulate=2" in str(w.message)]
        assert len(said) == (1 if warns else 0), said
        if warns:
            assert "'token_mean' is not a mean over the batch's rows" in said[0]


def test_parameters_and_optimizer_state_stay_sharded(two_shards):
    _, state = two_shards
    mesh_specs = redeqx.sharding_rules(state.model, redeqx.make_mesh(2))
    w = state.model.blocks[0].attn.wo.weight
    assert w.sharding.spec == mesh_specs.blocks[0].attn.wo.weight
    adam = state.opt_state[0]
    assert adam.mu.blocks[0].attn.wo.weight.sharding.spec == w.sharding.spec
    assert adam.nu.blocks[0].mlp.fc1.weight.sharding.spec == state.model.blocks[0].mlp.fc1.weight.sharding.spec
    assert adam.count.sharding.spec == jax.sharding.PartitionSpec()


@pytest.mark.parametrize("k,fsdp", [(2, False), (4, False), (8, False), (2, True)])
def test_memory_per_device_is_total_over_k(k, fsdp, devices):
    """Parameters + Adam state per device: total / n_model_shards, or total /
    n_devices with fsdp=True (large leaves also split over data)."""
    mesh = redeqx.make_mesh(k)
    model = TinyLM(vocab=256, dim=128, n_heads=8, hidden=512, n_layers=2, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh, fsdp=fsdp)
    k = len(devices) if fsdp else k
    state = redeqx.init_state(model, optax.adam(1e-3), mesh, specs, key=jax.random.key(0))
    arrays = [x for x in jax.tree.leaves((state.model, state.opt_state)) if isinstance(x, jax.Array)]
    total = sum(x.nbytes for x in arrays)
    dev0 = devices[0]
    on_dev0 = sum(s.data.nbytes for x in arrays for s in x.addressable_shards if s.device == dev0)
    assert abs(on_dev0 - total / k) <= 0.10 * total / k, (on_dev0, total / k)


def test_no_parameter_is_all_gathered(devices):
    from redeqx.planner._hlo import collectives, compiled_text

    mesh = redeqx.make_mesh(2)
    model = TinyLM(vocab=56, dim=48, n_heads=4, hidden=80, n_layers=2, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.adamw(1e-3)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(lm_loss, optimizer, mesh, specs)
    batch = next(redeqx.batches(token_examples(8, vocab=56), collate_tokens, 2, mesh))
    text = compiled_text(step, state, batch)
    found = collectives(text)
    summary = redeqx.collective_summary(text)
    assert summary["all-reduce"]["count"] >= 1 and summary["all-reduce"]["bytes"] > 0
    param_shapes = {tuple(x.shape) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)) if x.ndim >= 2}
    for c in found:
        if c.kind == "all-gather":
            for _, shape in c.shapes:
                assert shape not in param_shapes, f"a parameter of shape {shape} is all-gathered"
    # the printed report later work tightens toward the Megatron plan
    print(summary)


def test_compiles_once_and_donates(devices):
    mesh = redeqx.make_mesh(2)
    optimizer = optax.sgd(0.1)
    specs, state = sharded_state(mlp(), optimizer, mesh, key=0)
    traces = []

    def loss_fn(m, batch, key):
        traces.append(1)
        return mse_loss(m, batch, key)

    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    rng = np.random.default_rng(0)
    examples = [{"x": rng.normal(size=8).astype(np.float32), "y": rng.normal(size=4).astype(np.float32)}
                for _ in range(64)]
    collate = lambda es: {k: np.stack([e[k] for e in es]) for k in ("x", "y")}
    data = list(redeqx.batches(examples, collate, 2, mesh))
    state, _ = step(state, data[0])
    n_traces = len(traces)
    with jax.transfer_guard("disallow"):  # no host round trip inside the loop
        for batch in data[1:]:
            old = state
            state, metrics = step(state, batch)
            assert old.model.layers[0].weight.is_deleted()  # donated: the old buffers were reused
    assert len(traces) == n_traces
    assert state.model.layers[0].weight.sharding.spec == specs.layers[0].weight
    assert state.model.layers[1].weight.sharding.spec == specs.layers[1].weight
    assert int(state.step) == len(data)


def test_a_donated_state_reused_is_named_not_run(devices, tmp_path):
    """Calling a step again with the state an earlier call donated (a notebook
    cell run twice) segfaulted XLA:CPU; each entry point now names the leaf."""
    mesh = redeqx.make_mesh(2)
    optimizer = optax.adam(1e-2)
    specs, state = sharded_state(mlp(4, 3, depth=1), optimizer, mesh)
    kept = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, state)  # what the message advises
    step = redeqx.make_train_step(mse_loss, optimizer, mesh, specs)
    batch = {"x": np.ones((8, 4), np.float32), "y": np.zeros((8, 3), np.float32)}
    new, _ = step(state, batch)
    examples = [{k: v[0] for k, v in batch.items()}] * 8
    collate = lambda es: {k: np.stack([e[k] for e in es]) for k in ("x", "y")}
    deleted = "leaf 'model.layers.0.weight' of the state was deleted: an earlier step was given it and donated"
    for call in (lambda: step(state, batch),
                 lambda: redeqx.make_step(lambda s, b: (s, 0.0), mesh)(state, batch),
                 lambda: redeqx.save_checkpoint(tmp_path / "a", state),
                 lambda: redeqx.CheckpointManager(tmp_path / "m").save(state)):
        with pytest.raises(ValueError, match=deleted):
            call()
    with pytest.raises(ValueError, match="leaf 'layers.0.weight' of the model was deleted"):
        redeqx.evaluate(redeqx.make_eval_step(mse_loss, mesh, specs), state.model, examples, collate, 1, mesh,
                        key=jax.random.key(0))
    with pytest.raises(ValueError, match="leaf 'layers.0.weight' of the step's argument 2 was deleted"):
        redeqx.make_step(lambda s, m: (s, m.layers[0].weight.sum()), mesh)(new, state.model)
    assert not (tmp_path / "a").exists()
    again, _ = step(kept, batch)  # the copy trains as the original did
    np.testing.assert_array_equal(np.asarray(again.model.layers[0].weight), np.asarray(new.model.layers[0].weight))


def test_trainable_freezes_the_rest(devices):
    mesh = redeqx.make_mesh(2)
    model = TinyLM(vocab=56, dim=48, n_heads=4, hidden=80, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    trainable = jax.tree.map(lambda _: False, model)
    trainable = eqx.tree_at(lambda m: m.lm_head, trainable, replace=jax.tree.map(lambda _: True, model.lm_head))
    optimizer = optax.adam(1e-2)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1), trainable=trainable)
    assert state.opt_state[0].mu.blocks[0].attn.wq.weight is None  # no optimizer state for frozen leaves
    before = jax.tree.map(np.asarray, eqx.filter(state.model, eqx.is_array))
    step = redeqx.make_train_step(lm_loss, optimizer, mesh, specs, trainable=trainable)
    for batch in redeqx.batches(token_examples(32, vocab=56), collate_tokens, 2, mesh):
        state, _ = step(state, batch)
    after = jax.tree.map(np.asarray, eqx.filter(state.model, eqx.is_array))
    assert not np.array_equal(after.lm_head.weight, before.lm_head.weight)
    for path, a, b in zip(jax.tree_util.tree_flatten_with_path(after)[0], jax.tree.leaves(after), jax.tree.leaves(before)):
        if "lm_head" not in jax.tree_util.keystr(path[0]):
            assert np.array_equal(a, b), jax.tree_util.keystr(path[0])  # bit-identical
    wrong = redeqx.make_train_step(lm_loss, optimizer, mesh, specs)  # trainable not passed here
    with pytest.raises(ValueError, match="same optimizer and trainable"):
        wrong(state, next(redeqx.batches(token_examples(8, vocab=56), collate_tokens, 2, mesh)))


@pytest.mark.slow
def test_compute_dtype_bf16(devices, two_shards):
    seen = []

    def loss_fn(m, batch, key):
        seen.append(m.blocks[0].attn.wq.weight.dtype)
        return lm_loss(m, batch, key)

    losses, state = train(2, devices, compute_dtype=jnp.bfloat16, n_steps=1, loss_fn=loss_fn)
    assert seen[-1] == jnp.bfloat16
    assert state.model.blocks[0].attn.wq.weight.dtype == jnp.float32
    assert state.opt_state[0].mu.blocks[0].attn.wq.weight.dtype == jnp.float32
    assert losses.dtype == np.float32  # the step's metrics["loss"]
    # bf16 forward: close to, not equal to, the float32 loss (the same first batch)
    np.testing.assert_allclose(losses, two_shards[0][:1], rtol=2e-2)


def test_make_step_per_example_clipping_against_hand_computation(devices):
    """DP-SGD: a user-written step on make_step, checked against a NumPy loop."""
    mesh = redeqx.make_mesh(2)
    w = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    x = np.random.default_rng(1).normal(size=(8, 8)).astype(np.float32)
    y = np.random.default_rng(2).normal(size=(8, 4)).astype(np.float32)
    clip, lr = 0.5, 0.1

    def dp_step(state, batch):
        def one_grad(xi, yi):
            return jax.grad(lambda w: 0.5 * jnp.sum((w @ xi - yi) ** 2))(state["w"])

        grads = jax.vmap(one_grad)(batch["x"], batch["y"])  # (B, 4, 8)
        norms = jnp.sqrt(jnp.sum(grads**2, axis=(1, 2), keepdims=True))
        grads = grads * jnp.minimum(1.0, clip / norms)
        return {"w": state["w"] - lr * grads.mean(0), "n": state["n"] + 1}, {"norms": norms[:, 0, 0]}

    state = redeqx.shard({"w": w, "n": np.int32(0)}, {"w": jax.sharding.PartitionSpec("model"), "n": None}, mesh)
    step = redeqx.make_step(dp_step, mesh)
    batch = redeqx.data._data.to_global({"x": x, "y": y}, mesh, 8)
    new, out = step(state, batch)
    expect = w.copy()
    gs = []
    for xi, yi in zip(x, y):
        g = np.outer(w @ xi - yi, xi)
        gs.append(g * min(1.0, clip / np.linalg.norm(g)))
    expect = w - lr * np.mean(gs, axis=0)
    np.testing.assert_allclose(np.asarray(new["w"]), expect, rtol=1e-5, atol=1e-6)
    assert new["w"].sharding.spec == jax.sharding.PartitionSpec("model")
    assert int(new["n"]) == 1


def test_make_step_two_models_two_optimizers(devices):
    """A GAN-shaped step: two models, two optimizers, one compiled step."""
    mesh = redeqx.make_mesh(2)
    g = eqx.nn.MLP(4, 4, 8, depth=1, key=jax.random.key(0))
    d = eqx.nn.MLP(4, "scalar", 8, depth=1, key=jax.random.key(1))
    opt_g, opt_d = optax.sgd(0.1), optax.sgd(0.2)
    sg, sd = redeqx.sharding_rules(g, mesh), redeqx.sharding_rules(d, mesh)
    state = (redeqx.shard(g, sg, mesh), redeqx.shard(d, sd, mesh),
             opt_g.init(eqx.filter(g, eqx.is_array)), opt_d.init(eqx.filter(d, eqx.is_array)))

    def d_loss(d, g, z):
        return jnp.mean(jax.vmap(d)(jax.vmap(g)(z)) ** 2)

    def g_loss(g, d, z):
        return -jnp.mean(jax.vmap(d)(jax.vmap(g)(z)))

    def gan_step(state, z):
        g, d, og, od = state
        gd = eqx.filter_grad(d_loss)(d, g, z)
        ud, od = opt_d.update(gd, od)
        d = eqx.apply_updates(d, ud)
        gg = eqx.filter_grad(g_loss)(g, d, z)
        ug, og = opt_g.update(gg, og)
        return (eqx.apply_updates(g, ug), d, og, od), {}

    z = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    expect, _ = gan_step((g, d, state[2], state[3]), jnp.asarray(z))  # plain, single-device
    got, _ = redeqx.make_step(gan_step, mesh)(state, redeqx.data._data.to_global(z, mesh, 8))
    for a, b in zip(jax.tree.leaves(eqx.filter(got[:2], eqx.is_array)), jax.tree.leaves(eqx.filter(expect[:2], eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert got[0].layers[0].weight.sharding.spec == sg.layers[0].weight


def test_make_step_rejects_changed_structure(devices):
    mesh = redeqx.make_mesh(2)
    step = redeqx.make_step(lambda s, x: ({"a": s["a"], "b": s["a"]}, None), mesh)
    with pytest.raises(ValueError, match="structure differs"):
        step({"a": jnp.ones(4)}, jnp.ones(8))


def test_loss_fn_must_return_scalar(devices):
    mesh = redeqx.make_mesh(2)
    specs, state = sharded_state(mlp(depth=1), optax.sgd(0.1), mesh, key=0)
    step = redeqx.make_train_step(lambda m, b, k: jax.vmap(m)(b["x"]).sum(-1), optax.sgd(0.1), mesh, specs)
    batch = redeqx.data._data.to_global({"x": np.ones((8, 8), np.float32)}, mesh, 8)
    with pytest.raises(ValueError, match=r"must return a scalar loss, got shape \(8,\).*jnp.mean"):
        step(state, batch)


def test_batch_the_data_axis_cannot_split(devices):
    mesh = redeqx.make_mesh(2)  # data = 4
    specs, state = sharded_state(mlp(depth=1), optax.sgd(0.1), mesh, key=0)
    step = redeqx.make_train_step(lambda m, b, k: jax.vmap(m)(b["x"]).mean(), optax.sgd(0.1), mesh, specs)
    with pytest.raises(ValueError, match=r"batch of 6 rows cannot be split over the data axis of 4 devices"):
        step(state, {"x": jnp.ones((6, 8))})
    acc = redeqx.make_train_step(lambda m, b, k: jax.vmap(m)(b["x"]).mean(), optax.sgd(0.1), mesh, specs, accumulate=3)
    with pytest.raises(ValueError, match=r"accumulate=3 cannot split a batch of 8 rows"):
        acc(state, redeqx.data._data.to_global({"x": np.ones((8, 8), np.float32)}, mesh, 8))
