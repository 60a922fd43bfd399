"""batches, evaluate and predict over a stream (an iterable with no len() or
[i]: a generator, a reader over files, a Hugging Face IterableDataset): the
same batches as a list in the stream's order, a seeded buffer shuffle, and
an exact resume through CheckpointManager, in one process and in two.

Also a worker: ``python -m redeqx.launch -n 2 tests/test_data_stream.py OUT``
runs `resume_run` as 2 processes x 4 devices on ``OUT/train.jsonl``.
"""

import json
import sys
import warnings
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import multihost_utils

import redeqx
from _helpers import run_python

PER_DEVICE, N_EPOCHS, BUFFER = 2, 2, 16  # mesh data=4: a global batch of 8


def examples(n):
    return [{"x": [float(i), float(i % 5), 1.0, -float(i % 3)], "y": float(i % 7), "id": i} for i in range(n)]


def collate(es):
    return {
        "x": np.array([e["x"] for e in es], np.float32),
        "y": np.array([e["y"] for e in es], np.float32),
        "id": np.array([e["id"] for e in es], np.int32),
    }


def global_ids(batch) -> list[int]:
    return np.asarray(multihost_utils.process_allgather(batch["id"], tiled=True)).tolist()


def ids(it) -> list[list[int]]:
    return [global_ids(b) for b in it]


class JsonLines:
    """A reader over a file, one JSON example a line: each iter() reads it again."""

    def __init__(self, path):
        self.path = path

    def __iter__(self):
        with open(self.path) as f:
            for line in f:
                yield json.loads(line)


class IterableDatasetLike:
    """What a Hugging Face datasets.IterableDataset offers: __iter__ (dicts) and set_epoch, no len()."""

    def __init__(self, rows):
        self.rows, self.epoch = rows, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return (dict(r) for r in self.rows)


def write_jsonl(path, rows):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- the same batches as a list in the stream's order


def outcome(run):
    """What ``run()`` returns, or the error it raises (a stream raises it at the end, a list at once)."""
    try:
        return run()
    except ValueError as e:
        return f"ValueError: {e}"


def test_a_stream_gives_the_batches_a_list_in_its_order_gives(devices, tmp_path):
    for n_model_shards in (1, 2, 8):
        mesh = redeqx.make_mesh(n_model_shards)
        for n in (8, 37):
            ex = examples(n)
            reader, hf = JsonLines(write_jsonl(tmp_path / f"{n}.jsonl", ex)), IterableDatasetLike(ex)
            # a generator or an iterator is read once: a new one each call; a reader starts over
            streams = (lambda: (e for e in ex), lambda: iter(ex), lambda: reader, lambda: hf)
            for drop_last in (False, True):
                for start in (0, 2):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # the sequence fills its short last batch with a warning
                        want = outcome(lambda: ids(redeqx.batches(ex, collate, 3, mesh, drop_last=drop_last,
                                                                  start=start)))
                        for stream in streams:
                            for prefetch in (0, 2):
                                got = outcome(lambda: ids(redeqx.batches(stream(), collate, 3, mesh, prefetch=prefetch,
                                                                         drop_last=drop_last, start=start)))
                                assert got == want, (n_model_shards, n, drop_last, start, type(stream()), prefetch)


def test_a_streams_short_last_batch_is_filled_at_that_batch_or_dropped(devices):
    mesh = redeqx.make_mesh(2)  # global batch 8
    it = redeqx.batches((e for e in examples(12)), collate, 2, mesh)
    assert global_ids(next(it)) == list(range(8))  # no warning yet: the stream's length is not known
    with pytest.warns(UserWarning, match="last batch has 4 of 8 examples; it is filled up with 4 examples from the "
                                         "start of the order") as record:
        assert global_ids(next(it)) == [8, 9, 10, 11, 0, 1, 2, 3]
    assert record[0].filename == __file__  # the user's loop
    assert list(it) == []
    with pytest.warns(UserWarning, match="last batch has 3 of 8"):  # fewer than the padding: cycled, as a list is
        assert ids(redeqx.batches(iter(examples(3)), collate, 2, mesh)) == [[0, 1, 2, 0, 1, 2, 0, 1]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ids(redeqx.batches(iter(examples(12)), collate, 2, mesh, drop_last=True)) == [list(range(8))]
        assert ids(redeqx.batches(iter(examples(16)), collate, 2, mesh)) == [list(range(8)), list(range(8, 16))]
    with pytest.raises(ValueError, match="examples has 5 examples, fewer than one global batch of 8"):
        list(redeqx.batches(iter(examples(5)), collate, 2, mesh, drop_last=True))


def test_what_only_the_end_of_a_stream_tells_is_an_error_there(devices):
    mesh = redeqx.make_mesh(2)
    used = (e for e in examples(16))
    assert len(ids(redeqx.batches(used, collate, 2, mesh))) == 2
    with pytest.raises(ValueError, match=r"examples \(a generator\) gave no examples\. A generator or iterator is read "
                                         r"once.*make a new one for every call"):
        list(redeqx.batches(used, collate, 2, mesh))  # the same generator again: nothing, said out loud
    with pytest.raises(ValueError, match=r"examples \(a list_iterator\) gave no examples"):
        list(redeqx.batches(iter([]), collate, 2, mesh))
    with pytest.raises(ValueError, match=r"start=4 is past this epoch's 2 batches \(16 examples, global batch 8"):
        list(redeqx.batches(iter(examples(16)), collate, 2, mesh, start=4))
    assert list(redeqx.batches(iter(examples(16)), collate, 2, mesh, start=2)) == []  # an epoch already done

    def stops_early():  # a loop left early closes the generator: passed again, it is an error, not a read-ahead
        yield from examples(64)

    gen = stops_early()
    for _ in redeqx.batches(gen, collate, 2, mesh):
        break
    with pytest.raises(ValueError, match="gave no examples"):
        list(redeqx.batches(gen, collate, 2, mesh))


def test_shuffle_true_on_a_stream_names_the_buffer_shuffle(devices):
    mesh = redeqx.make_mesh(2)
    with pytest.raises(ValueError, match=r"shuffle=True draws a permutation.*examples is a generator, a stream.*"
                                         r"redeqx\.shuffled\(examples, buffer_size=10_000, key=key\).*ds\.set_epoch"):
        redeqx.batches((e for e in examples(16)), collate, 2, mesh, shuffle=True, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"key must be one PRNG key, e\.g\. key=jax\.random\.fold_in.*got 3"):
        redeqx.shuffled(examples(16), 4, key=3)
    with pytest.raises(ValueError, match="buffer_size must be a positive int, got 0"):
        redeqx.shuffled(examples(16), 0, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"examples is a dict"):
        redeqx.shuffled({"x": [1, 2]}, 4, key=jax.random.key(0))


def test_shuffled_is_a_seeded_buffer_shuffle(devices):
    ex = examples(100)
    order = lambda s: [e["id"] for e in s]  # noqa: E731
    a = redeqx.shuffled(ex, 10, key=jax.random.key(0))
    assert order(a) == order(a)  # each iter() starts over, in the same order
    assert order(a) == order(redeqx.shuffled((e for e in ex), 10, key=jax.random.key(0)))  # any stream of the same
    assert sorted(order(a)) == list(range(100)) and order(a) != list(range(100))  # a permutation
    assert order(a) != order(redeqx.shuffled(ex, 10, key=jax.random.key(1)))
    assert order(redeqx.shuffled(ex, 10, key=jax.random.PRNGKey(0))) == order(a)  # a raw key: the same words
    for position, i in enumerate(order(a)):  # the buffer: nothing moves more than 10 places earlier
        assert position >= i - 10
    # a buffer as large as the data is a full shuffle: the first example out is any of them, evenly
    first = [order(redeqx.shuffled(ex[:10], 10, key=jax.random.key(k)))[0] for k in range(400)]
    assert np.bincount(first, minlength=10).min() >= 20  # 40 expected each
    # batches over a shuffled stream: the batches of a list in the shuffled order
    mesh = redeqx.make_mesh(2)
    want = ids(redeqx.batches(list(a), collate, 2, mesh, drop_last=True))
    assert ids(redeqx.batches(a, collate, 2, mesh, drop_last=True)) == want
    assert ids(redeqx.batches(a, collate, 2, mesh, drop_last=True, start=7)) == want[7:]


def test_progress_bar_of_a_stream_counts_without_a_total(devices, capsys):
    mesh = redeqx.make_mesh(2)
    list(redeqx.batches(iter(examples(32)), collate, 2, mesh, desc="epoch 0", start=1))
    err = capsys.readouterr().err
    assert "epoch 0 [global batch 8 = 2 x data 4]: 1it [" in err  # counting from start=1, no "1/4" total


# -- evaluate and predict


def _model_and_fns():
    model = eqx.nn.MLP(4, 3, 8, depth=1, key=jax.random.key(0))

    def loss_fn(m, batch, key):
        out = jax.vmap(m)(batch["x"])
        return jnp.mean((out.sum(-1) - batch["y"]) ** 2), {"max": jnp.max(out)}

    def pred_fn(m, batch, key):
        return {"out": jax.vmap(m)(batch["x"]), "id": batch["id"]}

    return model, loss_fn, pred_fn


def test_evaluate_and_predict_on_a_stream_match_the_list(devices, tmp_path):
    mesh = redeqx.make_mesh(2)
    model, loss_fn, pred_fn = _model_and_fns()
    specs = redeqx.sharding_rules(model, mesh)
    model = redeqx.shard(model, specs, mesh)
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)
    predict_step = redeqx.make_predict_step(pred_fn, mesh, specs)
    ex, key = examples(37), jax.random.key(0)
    reader = JsonLines(write_jsonl(tmp_path / "test.jsonl", ex))
    want = redeqx.evaluate(eval_step, model, ex, collate, 3, mesh, key=key)
    assert redeqx.evaluate(eval_step, model, reader, collate, 3, mesh, key=key) == want  # the padding weighs 0
    assert redeqx.evaluate(eval_step, model, iter(ex), collate, 3, mesh, key=key, prefetch=0) == want
    whole = collate(ex)  # one batch of everything, on one device
    np.testing.assert_allclose(want["loss"], float(loss_fn(model, whole, None)[0]), rtol=1e-5)
    want = redeqx.predict(predict_step, model, ex, collate, 3, mesh, key=key)
    got = redeqx.predict(predict_step, model, reader, collate, 3, mesh, key=key)
    assert [int(p["id"]) for p in got] == list(range(37))  # one output per example, in order
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g["out"], w["out"])


# -- resuming mid-epoch through CheckpointManager


def loss_fn(model, batch, key):
    return jnp.mean((jax.vmap(model)(batch["x"]).sum(-1) - batch["y"]) ** 2)


def training():
    """The mesh, model, specs, optimizer and train step every `train` call
    starts from: made (and the step compiled) once per `resume_run`."""
    mesh = redeqx.make_mesh(2)
    model = eqx.nn.MLP(4, 2, 8, depth=1, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.adam(1e-2)
    return mesh, model, specs, optimizer, redeqx.make_train_step(loss_fn, optimizer, mesh, specs)


def train(setup, workdir, data_path, collate_fn, stop_after=None):
    """The README's resume loop over a shuffled stream, saving after every
    step, from a fresh state (as a new process starts); stops after step
    ``stop_after``. Returns the state, the global ids of every batch this call
    trained on, and, per batch, the ids of the rows this process's devices hold."""
    mesh, model, specs, optimizer, train_step = setup
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    manager = redeqx.CheckpointManager(workdir)
    start_epoch, start_batch, seen, local = 0, 0, [], []
    if (found := manager.restore(state, mesh, specs)) is not None:
        state, meta = found
        start_epoch, start_batch = meta["epoch"], meta["batch"]
    for epoch in range(start_epoch, N_EPOCHS):
        data_key = jax.random.fold_in(jax.random.key(2), epoch)
        s = start_batch if epoch == start_epoch else 0
        stream = redeqx.shuffled(JsonLines(data_path), BUFFER, key=data_key)
        for i, batch in enumerate(redeqx.batches(stream, collate_fn, PER_DEVICE, mesh, drop_last=True, start=s),
                                  start=s):
            state, _ = train_step(state, batch)
            seen.append(global_ids(batch))
            shards = {s.index[0].start or 0: np.asarray(s.data).tolist() for s in batch["id"].addressable_shards}
            local.append([i for start in sorted(shards) for i in shards[start]])
            manager.save(state, epoch=epoch, batch=i + 1, data_key=data_key)
            if int(state.step) == stop_after:
                manager.close()
                return state, seen, local
    manager.close()
    return state, seen, local


def parameters(state):
    return [np.asarray(multihost_utils.process_allgather(x, tiled=True))
            for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))]


STOP = 7  # epoch 1, batch 2 of 5


def resume_run(out: Path) -> dict:
    """Trains on ``out/train.jsonl`` in one go, then stopped at step STOP and
    resumed (checkpoints in ``out``, which every process shares); JSON-able."""
    sizes = []

    def recording(es):
        sizes.append(len(es))
        return collate(es)

    data, setup = out / "train.jsonl", training()
    whole, seen, local = train(setup, out / "whole", data, recording)
    first, seen_first, local_first = train(setup, out / "stopped", data, recording, stop_after=STOP)
    resumed, seen_resumed, local_resumed = train(setup, out / "stopped", data, recording)
    same = all(np.array_equal(a, b) for a, b in zip(parameters(whole), parameters(resumed), strict=True))
    return {"seen": seen, "seen_first": seen_first, "seen_resumed": seen_resumed, "local": local,
            "local_resumed": local_first + local_resumed, "same_parameters": same, "collated": sorted(set(sizes)),
            "steps": [int(whole.step), int(first.step), int(resumed.step)]}


def write_train(out: Path) -> Path:
    write_jsonl(out / "train.jsonl", examples(44))  # 5 batches of 8 an epoch; 4 examples dropped
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return resume_run(write_train(tmp_path_factory.mktemp("stream_resume")))


def test_a_stream_resumed_mid_epoch_sees_every_example_once(devices, one_process):
    run = one_process
    assert run["steps"] == [10, STOP, 10] and len(run["seen"]) == 10
    assert run["seen_first"] + run["seen_resumed"] == run["seen"]  # none skipped, none seen twice
    for epoch in (run["seen"][:5], run["seen"][5:]):
        flat = [i for batch in epoch for i in batch]
        assert len(set(flat)) == 40  # 44 examples, the 4 that do not fill a batch dropped
    assert run["seen"][:5] != run["seen"][5:]  # a new order each epoch
    assert run["same_parameters"]  # bit-identical


@pytest.mark.slow
def test_two_processes_read_the_same_stream_and_resume_alike(one_process, tmp_path):
    """2 processes x 4 devices: the same global batches as one process, each
    process collating only its own rows (4 of each 8), and the same resume."""
    run_python(__file__, write_train(tmp_path), launch=("-n", "2", "--devices", "8"))
    for p in range(2):
        got = json.loads((tmp_path / f"process_{p}.json").read_text())
        assert got["steps"] == one_process["steps"]
        assert got["seen"] == one_process["seen"]
        assert got["seen_first"] + got["seen_resumed"] == got["seen"]
        assert got["same_parameters"]
        for local in (got["local"], got["local_resumed"]):
            assert local == [batch[4 * p:4 * p + 4] for batch in got["seen"]]  # its own rows only
        assert got["collated"] == [4]  # collate_fn got 4 examples a call, never the whole batch
    assert one_process["collated"] == [8]


if __name__ == "__main__":
    assert jax.process_count() == 2, "run me as python -m redeqx.launch -n 2 tests/test_data_stream.py OUT"
    out = Path(sys.argv[1])
    (out / f"process_{jax.process_index()}.json").write_text(json.dumps(resume_run(out)))
