"""batches, evaluate and predict: the host-side data pipeline."""

import collections
import gc
import threading
import time
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tqdm

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
    assert list(redeqx.batches(ex, collate, 2, mesh, shuffle=True, key=key, start=5)) == []  # an epoch done
    with pytest.raises(ValueError, match=r"start=6 is past this epoch's 5 batches \(40 examples, global batch 8"):
        redeqx.batches(ex, collate, 2, mesh, shuffle=True, key=key, start=6)  # once an empty epoch, silently
    with pytest.raises(ValueError, match="shuffle=True needs key="):
        list(redeqx.batches(ex, collate, 2, mesh, shuffle=True))


def test_partial_last_batch_is_filled_with_a_warning(devices):
    mesh = redeqx.make_mesh(2)
    with pytest.warns(UserWarning, match="last batch has 4 of 8 examples") as record:
        got = list(redeqx.batches(examples(12), collate, 2, mesh))
    assert record[0].filename == __file__  # the user's loop, not a wrapper
    np.testing.assert_array_equal(np.asarray(got[-1]["id"]), [8, 9, 10, 11, 0, 1, 2, 3])
    with pytest.warns(UserWarning, match="last batch has 3 of 8 examples"):  # fewer than the padding: cycled
        assert ids(redeqx.batches(examples(3), collate, 2, mesh)) == [[0, 1, 2, 0, 1, 2, 0, 1]]
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


# -- prefetch


def ids(it):
    return [np.asarray(b["id"]).tolist() for b in it]


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "redeqx-prefetch"]


def thread_count():
    """threading.active_count(), less tqdm's monitor thread, which every
    progress bar starts if none runs and which ends by itself."""
    return threading.active_count() - sum(isinstance(t, tqdm.std.TMonitor) for t in threading.enumerate())


@pytest.mark.parametrize("shuffle", [False, True])
def test_prefetch_gives_the_same_batches_and_resumes(shuffle, devices):
    mesh = redeqx.make_mesh(2)
    ex, key = examples(44), jax.random.key(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # in order, the last batch is filled up with a warning
        plain = ids(redeqx.batches(ex, collate, 2, mesh, shuffle=shuffle, key=key, prefetch=0))
        for prefetch in (1, 2, 7):
            assert ids(redeqx.batches(ex, collate, 2, mesh, shuffle=shuffle, key=key, prefetch=prefetch)) == plain
            assert ids(redeqx.batches(ex, collate, 2, mesh, shuffle=shuffle, key=key, start=3, prefetch=prefetch)) == plain[3:]
    with pytest.raises(ValueError, match="prefetch must be an int >= 0.*got -1"):
        redeqx.batches(ex, collate, 2, mesh, prefetch=-1)


def test_prefetch_collates_ahead_in_a_thread_and_at_most_prefetch_batches(devices):
    mesh = redeqx.make_mesh(2)
    made = []

    def recording(es):
        made.append((threading.current_thread() is threading.main_thread(), int(es[0]["id"])))
        return collate(es)

    def settle(n):  # waits for n collate calls, then gives the thread room to run further ahead if it would
        deadline = time.monotonic() + 30
        while len(made) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)

    it = redeqx.batches(examples(64), recording, 2, mesh, prefetch=2)  # 8 batches
    assert made == [] and not prefetch_threads()  # nothing runs before the loop asks
    first = next(it)
    settle(3)
    assert np.asarray(first["id"]).tolist() == list(range(8))
    assert [i for _, i in made] == [0, 8, 16] and not any(main for main, _ in made)  # 2 ahead, not more
    next(it)
    settle(4)
    assert [i for _, i in made] == [0, 8, 16, 24]
    it.close()
    made.clear()
    it = redeqx.batches(examples(64), recording, 2, mesh, prefetch=0)
    next(it)
    settle(1)
    assert made == [(True, 0)]  # in the loop's thread, only when asked


class CollateFailed(Exception):
    pass


def test_a_collate_error_is_raised_at_its_batch_with_its_traceback(devices):
    mesh = redeqx.make_mesh(2)
    raised = []

    def breaks_at_batch_3(es):
        if es[0]["id"] == 24:
            raised.append(CollateFailed("bad example 24"))
            raise raised[-1]
        return collate(es)

    for prefetch in (0, 2):
        got = []
        with pytest.raises(CollateFailed, match="bad example 24") as info:
            for b in redeqx.batches(examples(64), breaks_at_batch_3, 2, mesh, prefetch=prefetch):
                got.append(np.asarray(b["id"])[0])
        assert got == [0, 8, 16]  # the batches before it first
        assert info.value is raised[-1]  # the very exception collate_fn raised ...
        frames = [tb.tb_frame.f_code.co_name for tb in _walk(info.value.__traceback__)]
        assert frames[-1] == "breaks_at_batch_3"  # ... with the traceback to where it was raised
        assert "test_a_collate_error_is_raised_at_its_batch_with_its_traceback" in frames  # and through this loop
        assert not prefetch_threads()


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def test_leaving_the_loop_early_stops_the_thread(devices):
    mesh = redeqx.make_mesh(2)
    before = thread_count()
    for epoch in range(5):  # break, every epoch
        for i, _ in enumerate(redeqx.batches(examples(64), collate, 2, mesh, shuffle=True, key=jax.random.key(epoch))):
            assert len(prefetch_threads()) == 1
            if i == 2:
                break
        assert not prefetch_threads() and thread_count() <= before
    with pytest.raises(RuntimeError, match="step failed"):  # an exception in the loop
        for _ in redeqx.batches(examples(64), collate, 2, mesh):
            raise RuntimeError("step failed")
    assert not prefetch_threads()
    it = redeqx.batches(examples(64), collate, 2, mesh)  # closed by hand
    next(it)
    it.close()
    assert not prefetch_threads()
    it = redeqx.batches(examples(64), collate, 2, mesh)  # dropped and garbage-collected
    next(it)
    del it
    gc.collect()
    assert not prefetch_threads()
    list(redeqx.batches(examples(64), collate, 2, mesh))  # run to the end
    assert not prefetch_threads() and thread_count() <= before


def test_evaluate_and_predict_prefetch_too(devices):
    mesh = redeqx.make_mesh(2)
    model, loss_fn, pred_fn = _model_and_fns()
    specs = redeqx.sharding_rules(model, mesh)
    model = redeqx.shard(model, specs, mesh)
    threads = set()

    def recording(es):
        threads.add(threading.current_thread().name)
        return collate(es)

    ex, key = examples(37), jax.random.key(0)
    eval_step, predict_step = redeqx.make_eval_step(loss_fn, mesh, specs), redeqx.make_predict_step(pred_fn, mesh, specs)
    assert redeqx.evaluate(eval_step, model, ex, recording, 2, mesh, key=key) == \
        redeqx.evaluate(eval_step, model, ex, collate, 2, mesh, key=key, prefetch=0)
    assert threads == {"redeqx-prefetch"}
    got = redeqx.predict(predict_step, model, ex, recording, 2, mesh, key=key)
    want = redeqx.predict(predict_step, model, ex, collate, 2, mesh, key=key, prefetch=0)
    assert [int(p["id"]) for p in got] == list(range(37))
    assert [int(p["label"]) for p in got] == [int(p["label"]) for p in want]

    calls = []

    def fails_at_batch_2(m, batch, k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("predict_step failed")
        return predict_step(m, batch, k)

    with pytest.raises(RuntimeError, match="predict_step failed"):
        redeqx.predict(fails_at_batch_2, model, ex, collate, 2, mesh, key=key)
    assert not prefetch_threads()


# -- what examples can be


class DatasetLike:
    """What a Hugging Face datasets.Dataset offers batches: len() and [int] -> a dict."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if not isinstance(i, int):
            raise TypeError("an int index")
        return dict(self.rows[i])


def test_examples_can_be_anything_with_len_and_getitem(devices):
    mesh = redeqx.make_mesh(2)
    ex = examples(16)
    want = ids(redeqx.batches(ex, collate, 2, mesh))
    for kind in (tuple(ex), DatasetLike(ex), collections.UserList(ex)):
        assert ids(redeqx.batches(kind, collate, 2, mesh)) == want, type(kind)
    rows = np.stack([np.r_[e["x"], e["id"]] for e in ex])  # a NumPy array: a row per example
    stack = lambda rs: {"x": np.stack(rs)[:, :4], "id": np.stack(rs)[:, 4].astype(np.int32)}  # noqa: E731
    assert ids(redeqx.batches(rows, stack, 2, mesh)) == want
    model, loss_fn, pred_fn = _model_and_fns()
    specs = redeqx.sharding_rules(model, mesh)
    model = redeqx.shard(model, specs, mesh)
    step = redeqx.make_predict_step(pred_fn, mesh, specs)
    preds = redeqx.predict(step, model, DatasetLike(ex), collate, 2, mesh, key=jax.random.key(0))
    assert [int(p["id"]) for p in preds] == list(range(16))
    metrics = redeqx.evaluate(redeqx.make_eval_step(loss_fn, mesh, specs), model, tuple(ex), collate, 2, mesh,
                              key=jax.random.key(0))
    assert set(metrics) == {"loss", "accuracy"}


def test_examples_that_cannot_be_batched_are_named_with_the_fix(devices):
    mesh = redeqx.make_mesh(2)
    columns = {"x": np.zeros((16, 4), np.float32), "id": np.arange(16)}
    with pytest.raises(TypeError, match=r"examples is a dict \(keys \['x', 'id'\]\).*"
                                        r"\[dict\(zip\(d, row\)\) for row in zip\(\*d\.values\(\)\)\]"):
        redeqx.batches(columns, collate, 2, mesh)
    d = columns  # the fix the message gives works
    fixed = [dict(zip(d, row)) for row in zip(*d.values())]
    assert ids(redeqx.batches(fixed, lambda es: {"id": np.array([e["id"] for e in es])}, 2, mesh)) == [
        list(range(8)), list(range(8, 16))]
    # a generator or an iterator is a stream (tests/test_data_stream.py), read in its order
    assert ids(redeqx.batches((e for e in examples(16)), collate, 2, mesh)) == ids(redeqx.batches(iter(examples(16)),
                                                                                                   collate, 2, mesh))
    for unordered in ({1, 2, 3}, frozenset({1, 2}), {"a": 1}.keys()):  # no order every process shares
        with pytest.raises(TypeError, match=rf"examples is a {type(unordered).__name__}, which has no order of its "
                                            r"own.*examples = sorted\(examples\)"):
            redeqx.batches(unordered, collate, 2, mesh)
    with pytest.raises(TypeError, match=r"examples must be a sequence of examples.*or a stream of them.*got a int"):
        redeqx.batches(16, collate, 2, mesh)
    with pytest.raises(TypeError, match="examples is a str"):
        redeqx.batches("abcdefgh", collate, 2, mesh)

    class DataFrame(DatasetLike):  # what pandas offers: [i] is a column
        iloc, columns = None, ["x", "id"]

    with pytest.raises(TypeError, match=r"examples is a DataFrame, whose \[i\] picks a column.*to_dict\('records'\)"):
        redeqx.batches(DataFrame(examples(16)), collate, 2, mesh)
    for empty in ([], (), np.zeros((0, 4)), DatasetLike([])):
        with pytest.raises(ValueError, match=f"examples is empty \\(a {type(empty).__name__} of length 0\\)"):
            redeqx.batches(empty, collate, 2, mesh)
    model, loss_fn, pred_fn = _model_and_fns()
    specs = redeqx.sharding_rules(model, mesh)
    with pytest.raises(TypeError, match=r"examples is a dict .*dict\(zip\(d, row\)\)"):
        redeqx.evaluate(redeqx.make_eval_step(loss_fn, mesh, specs), model, columns, collate, 2, mesh, key=jax.random.key(0))
    read = (e for e in examples(16))
    list(read)
    with pytest.raises(ValueError, match=r"examples \(a generator\) gave no examples.*make a new one for every call"):
        redeqx.predict(redeqx.make_predict_step(pred_fn, mesh, specs), model, read, collate, 2, mesh,
                       key=jax.random.key(0))


# -- the progress bar


def test_progress_bar_shows_the_global_batch_and_the_data_axis(devices, capsys):
    list(redeqx.batches(examples(32), collate, 2, redeqx.make_mesh(2), desc="epoch 0"))
    assert "epoch 0 [global batch 8 = 2 x data 4]" in capsys.readouterr().err
    list(redeqx.batches(examples(32), collate, 2, redeqx.make_mesh(8), desc="epoch 1"))
    assert "epoch 1 [global batch 2 = 2 x data 1]" in capsys.readouterr().err
    mesh = redeqx.make_mesh(1)
    model, loss_fn, _ = _model_and_fns()
    specs = redeqx.sharding_rules(model, mesh)
    redeqx.evaluate(redeqx.make_eval_step(loss_fn, mesh, specs), redeqx.shard(model, specs, mesh), examples(32),
                    collate, 2, mesh, key=jax.random.key(0), desc="eval")
    assert "eval [global batch 16 = 2 x data 8]" in capsys.readouterr().err


def test_int64_beyond_32_bits_is_refused_with_the_key_and_range_and_smaller_ones_arrive_intact(devices):
    """Before: JAX's default has 64-bit types off, so 2**32 + 5 from a
    collate_fn arrived as 5, silently."""
    mesh = redeqx.make_mesh(2)

    def big_ids(es):
        return {"x": np.stack([e["x"] for e in es]), "id": np.array([2**32 + e["id"] for e in es], np.int64)}

    with pytest.raises(ValueError, match=r"\['id'\] is int64 with values from 4294967296 to 42949672\d\d, outside int32"):
        next(redeqx.batches(examples(8), big_ids, 1, mesh))
    from redeqx.steps._compiled import place_batch  # a NumPy batch given to a step directly meets the same check

    with pytest.raises(ValueError, match=r"batch\['id'\] is int64"):
        place_batch(big_ids(examples(8)), mesh)

    def small_ids(es):
        return {"x": np.stack([e["x"] for e in es]), "id": np.array([-(2**31) + e["id"] for e in es], np.int64)}

    got = next(redeqx.batches(examples(8), small_ids, 1, mesh))
    assert got["id"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got["id"]), -(2**31) + np.arange(4))  # data=4, one row each


def test_rows_of_another_count_are_named_by_key():
    from redeqx.data._batch import batch_size

    with pytest.raises(ValueError, match=r"got sizes \[1, 16\] \(batch\['scale'\]: \[1\], batch\['x'\]: \[16, 3\]\)"):
        batch_size({"x": np.ones((16, 3)), "scale": np.ones((1,))})


def test_a_python_list_in_a_batch_is_named_with_the_fix(devices):
    from redeqx.data._batch import check_batch

    mesh = redeqx.make_mesh(1, devices=devices[:2])
    with pytest.raises(TypeError, match=r"batch\['ids'\] is a Python list or tuple of numbers.*np\.asarray"):
        check_batch({"ids": [[1, 2], [3, 4]], "y": np.ones((2,))}, mesh)  # beside an array: it was taken
    with pytest.raises(TypeError, match=r"batch\['ids'\] is a Python list"):  # as a step sees it: numpy scalars
        check_batch({"ids": [[np.int32(1), np.int32(2)]]}, mesh)
    check_batch({"ids": (np.ones((2, 3)), np.ones((2,)))}, mesh)  # a tuple of arrays is a batch
    check_batch({"x": np.ones((4, 3)), "temperatures": [0.5, 1.0]}, mesh)  # numbers shared by the batch
