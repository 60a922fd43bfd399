"""batches, evaluate and predict: the host-side data pipeline."""


import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redeqx


def examples(n, dim=4, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=dim).astype(np.float32), "y": i % 3, "id": i} for i in range(n)]


def collate(es):
    return {
        "x": np.stack([e["x"] for e in es]),
        "y": np.array([e["y"] for e in es], np.int32),
        "id": np.array([e["id"] for e in es], np.int32),
    }


def test_batches_are_global_and_sharded_over_data(devices):
    mesh = redeqx.make_mesh(2)  # data = 4
    got = list(redeqx.batches(examples(32), collate, 2, mesh))
    assert len(got) == 4
    for i, b in enumerate(got):
        assert b["x"].shape == (8, 4)
        assert b["x"].sharding.spec == jax.sharding.PartitionSpec("data", None)
        np.testing.assert_array_equal(np.asarray(b["id"]), np.arange(8 * i, 8 * i + 8))


def test_shuffle_is_deterministic_and_start_resumes(devices):
    mesh = redeqx.make_mesh(2)
    ex = examples(40)
    key = jax.random.key(3)
    a = [np.asarray(b["id"]) for b in redeqx.batches(ex, collate, 2, mesh, shuffle=True, key=key)]
    b = [np.asarray(b["id"]) for b in redeqx.batches(ex, collate, 2, mesh, shuffle=True, key=key)]
    assert len(a) == 5  # drop_last defaults to shuffle: 40 // 8
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(np.concatenate(a), np.arange(40))
    assert sorted(np.concatenate(a).tolist()) == list(range(40))
    resumed = [np.asarray(b["id"]) for b in redeqx.batches(ex, collate, 2, mesh, shuffle=True, key=key, start=3)]
    assert all(np.array_equal(x, y) for x, y in zip(resumed, a[3:])) and len(resumed) == 2
    with pytest.raises(ValueError, match="shuffle=True needs key="):
        list(redeqx.batches(ex, collate, 2, mesh, shuffle=True))


def test_partial_last_batch_is_filled_with_a_warning(devices):
    mesh = redeqx.make_mesh(2)
    with pytest.warns(UserWarning, match="last batch has 4 of 8 examples"):
        got = list(redeqx.batches(examples(12), collate, 2, mesh))
    np.testing.assert_array_equal(np.asarray(got[-1]["id"]), [8, 9, 10, 11, 0, 1, 2, 3])
    with pytest.raises(ValueError, match="fewer than one global batch of 8"):
        list(redeqx.batches(examples(5), collate, 2, mesh, drop_last=True))


def test_collate_fn_errors(devices):
    mesh = redeqx.make_mesh(2)
    ex = examples(8)
    ragged = lambda es: {"x": [list(range(e["id"] + 1)) for e in es]}
    with pytest.raises(ValueError, match=r"output\['x'\] is ragged.*Pad every row"):
        next(redeqx.batches(ex, ragged, 2, mesh))
    strings = lambda es: {"text": np.array([str(e["id"]) for e in es])}
    with pytest.raises(TypeError, match=r"output\['text'\] has dtype <U1.*numeric NumPy"):
        next(redeqx.batches(ex, strings, 2, mesh))
    wrong_rows = lambda es: {"x": np.zeros((3, 2), np.float32)}
    with pytest.raises(ValueError, match=r"has shape \(3, 2\), but collate_fn got 8 examples"):
        next(redeqx.batches(ex, wrong_rows, 2, mesh))
    with pytest.raises(ValueError, match="per_device_batch_size must be a positive int, got 0"):
        next(redeqx.batches(ex, collate, 0, mesh))


def _model_and_fns():
    model = eqx.nn.MLP(4, 3, 16, depth=1, key=jax.random.key(0))

    def loss_fn(m, batch, key):
        logits = jax.vmap(m)(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}

    def pred_fn(m, batch, key):
        return {"label": jax.vmap(m)(batch["x"]).argmax(-1), "id": batch["id"]}

    return model, loss_fn, pred_fn


@pytest.mark.parametrize("n_model_shards", [1, 2, 8])
def test_predict_returns_one_output_per_example_in_order(n_model_shards, devices):
    mesh = redeqx.make_mesh(n_model_shards)
    model, _, pred_fn = _model_and_fns()
    specs = redeqx.sharding_rules(model, mesh)
    model = redeqx.shard(model, specs, mesh)
    step = redeqx.make_predict_step(pred_fn, mesh, specs)
    ex = examples(37)  # not a multiple of any global batch here
    preds = redeqx.predict(step, model, ex, collate, 3, mesh, key=jax.random.key(0))
    assert len(preds) == 37
    assert [int(p["id"]) for p in preds] == list(range(37))
    expect = np.asarray(jax.vmap(model)(jnp.stack([e["x"] for e in ex])).argmax(-1))
    np.testing.assert_array_equal([int(p["label"]) for p in preds], expect)
    texts = redeqx.predict(step, model, ex, collate, 3, mesh, key=jax.random.key(0),
                           output_fn=lambda p: [f"#{i}:{l}" for i, l in zip(p["id"], p["label"])])
    assert texts[5] == f"#5:{expect[5]}" and len(texts) == 37


def test_evaluate_is_example_weighted(devices):
    mesh = redeqx.make_mesh(2)
    model, loss_fn, _ = _model_and_fns()
    specs = redeqx.sharding_rules(model, mesh)
    sharded = redeqx.shard(model, specs, mesh)
    ex = examples(21)
    metrics = redeqx.evaluate(redeqx.make_eval_step(loss_fn, mesh, specs), sharded, ex, collate, 2, mesh,
                              key=jax.random.key(0))
    full = collate(ex)
    loss, aux = loss_fn(model, full, None)  # one batch of everything, on one device
    np.testing.assert_allclose(metrics["loss"], float(loss), rtol=1e-5)
    np.testing.assert_allclose(metrics["accuracy"], float(aux["accuracy"]), rtol=1e-6)


def test_eval_step_uses_inference_mode(devices):
    mesh = redeqx.make_mesh(1)
    model = eqx.nn.Sequential([eqx.nn.Dropout(0.9), eqx.nn.Linear(4, 1, key=jax.random.key(0))])
    specs = redeqx.sharding_rules(model, mesh)
    loss_fn = lambda m, b, k: jnp.mean(jax.vmap(lambda x, kk: m(x, key=kk))(b["x"], jax.random.split(k, b["x"].shape[0])))
    step = redeqx.make_eval_step(loss_fn, mesh, specs)
    batch = next(redeqx.batches(examples(8), collate, 1, mesh))
    a = step(model, batch, jax.random.key(0))["loss"]
    b = step(model, batch, jax.random.key(1))["loss"]
    assert float(a) == float(b)  # dropout is off
