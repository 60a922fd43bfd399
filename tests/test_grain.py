"""`grain_batches`: a Grain pipeline's rows as global batches, compared with
`batches` over the same examples in the same order, and its position saved
and restored (in memory and through `CheckpointManager`) so the batches
after a restore are the ones an uninterrupted read gives. The same with
real processes, killed and resumed: tests/test_grain_resume.py."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from redeqx._json import state_from_json, state_to_json

grain = pytest.importorskip("grain")

N = 48


def examples():
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=3).astype(np.float32), "y": np.int32(i)} for i in range(N)]


def collate_fn(rows):
    return {"x": np.stack([r["x"] for r in rows]), "y": np.stack([r["y"] for r in rows])}


def host(batch):
    return {k: np.asarray(v) for k, v in batch.items()}


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in g:
            np.testing.assert_array_equal(g[k], w[k])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_examples_collated_as_batches_collates_them(prefetch):
    """A Grain dataset in the order of a shuffled list: the same global
    batches, split over data the same way, as `batches` over that list."""
    mesh = redeqx.make_mesh(2)
    data = examples()
    ds = grain.MapDataset.source(data).shuffle(seed=3)
    ordered = [ds[i] for i in range(len(ds))]
    got = [host(b) for b in redeqx.grain_batches(ds, collate_fn, 2, mesh, prefetch=prefetch)]
    want = [host(b) for b in redeqx.batches(ordered, collate_fn, 2, mesh, prefetch=0)]
    assert len(got) == N // 8
    assert_same(got, want)
    batch = next(iter(redeqx.grain_batches(ds, collate_fn, 2, mesh)))
    assert batch["x"].shape == (8, 3) and batch["x"].sharding.spec[0] == "data"


def test_dataset_batched_by_grain_is_taken_as_this_process_rows():
    mesh = redeqx.make_mesh(2)
    ds = grain.MapDataset.source(examples()).batch(8, batch_fn=collate_fn)
    got = [host(b) for b in redeqx.grain_batches(ds, None, 2, mesh)]
    want = [host(b) for b in redeqx.batches(examples(), collate_fn, 2, mesh)]
    assert_same(got, want)
    wrong = grain.MapDataset.source(examples()).batch(4, batch_fn=collate_fn)
    with pytest.raises(ValueError, match=r"has shape \(4, 3\).*holds 8 rows.*dataset.batch\(8"):
        next(redeqx.grain_batches(wrong, None, 2, mesh))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_state_after_the_batches_taken_not_the_read_ahead(prefetch):
    """The state taken after 2 batches (with the thread reading ahead) gives
    batch 3 onwards, in a new iterator and in the same one sent back."""
    mesh = redeqx.make_mesh(2)
    ds = grain.MapDataset.source(examples()).shuffle(seed=1).repeat().to_iter_dataset()
    it = redeqx.grain_batches(ds, collate_fn, 1, mesh, prefetch=prefetch)
    first = [host(next(it)) for _ in range(2)]
    state = it.get_state()
    json.dumps(state, allow_nan=False)  # strict JSON, as it is saved
    assert state["batches"] == 2
    rest = [host(next(it)) for _ in range(5)]
    again = redeqx.grain_batches(ds, collate_fn, 1, mesh, prefetch=prefetch)
    again.set_state(state)
    assert_same([host(next(again)) for _ in range(5)], rest)
    it.set_state(state)
    assert_same([host(next(it)) for _ in range(5)], rest)
    it.close()
    fresh = redeqx.grain_batches(ds, collate_fn, 1, mesh, prefetch=prefetch)
    assert_same([host(next(fresh)) for _ in range(2)], first)


def test_short_end_dropped_with_a_warning():
    mesh = redeqx.make_mesh(2)
    ds = grain.MapDataset.source(examples()[:20])
    with pytest.warns(UserWarning, match="ended with 4 examples.*dropped"):
        loader = redeqx.grain_batches(ds, collate_fn, 2, mesh)
        got = list(loader)
    assert len(got) == 2
    with pytest.raises(RuntimeError, match=r"has ended: .*\.repeat\(num_epochs\)"):  # a second epoch got nothing
        for _ in loader:
            pass


def test_manager_saves_and_restores_the_position(tmp_path):
    mesh = redeqx.make_mesh(2)
    ds = grain.MapDataset.source(examples()).shuffle(seed=2).repeat().to_iter_dataset()
    state = redeqx.shard({"w": jax.numpy.zeros(4)}, {"w": P()}, mesh)
    it = redeqx.grain_batches(ds, collate_fn, 1, mesh)
    with redeqx.CheckpointManager(tmp_path, async_save=False) as manager:
        for step in range(1, 4):
            next(it)
            manager.save(state, step=step, data_iterator=it)
        want = [host(next(it)) for _ in range(3)]
    again = redeqx.grain_batches(ds, collate_fn, 1, mesh)
    with redeqx.CheckpointManager(tmp_path) as manager:
        _, meta = manager.restore(state, mesh, data_iterator=again)
        assert meta["step"] == 3 and len(meta["data_iterator"]) == 1
    assert again.get_state()["batches"] == 3
    assert_same([host(next(again)) for _ in range(3)], want)


def _damage(position, damage):
    """Changes the first ``next_index`` inside a saved position, in place."""
    for key, value in list(position.items()):
        if key == "next_index":
            if damage == "a number changed":
                position[key] = value + 1
            else:
                del position[key]
            return True
        if isinstance(value, dict) and _damage(value, damage):
            return True
    return False


@pytest.mark.parametrize("damage", ["a number changed", "a key removed"])
def test_a_damaged_position_falls_back_to_the_older_checkpoint(tmp_path, damage):
    """Before: "next_index" one higher (still valid JSON) resumed on shifted
    batches without a word, and a removed one failed with KeyError:
    'next_index', never trying the older checkpoint, whose position is
    intact. The position is covered by the metadata's hash now."""
    mesh = redeqx.make_mesh(2)
    ds = grain.MapDataset.source(examples()).shuffle(seed=2).repeat().to_iter_dataset()
    state = redeqx.shard({"w": jax.numpy.zeros(4)}, {"w": P()}, mesh)
    it = redeqx.grain_batches(ds, collate_fn, 1, mesh, prefetch=0)
    with redeqx.CheckpointManager(tmp_path, keep_last=2, async_save=False) as manager:
        next(it)
        manager.save(state, step=1, data_iterator=it)
        want = [host(next(it)) for _ in range(3)]
        manager.save(state, step=2, data_iterator=it)
    file = manager.path(2) / "metadata" / "metadata"
    meta = json.loads(file.read_text())
    assert _damage(meta["data_iterator"][0], damage)
    file.write_text(json.dumps(meta))
    again = redeqx.grain_batches(ds, collate_fn, 1, mesh, prefetch=0)
    with redeqx.CheckpointManager(tmp_path) as manager, \
            pytest.warns(UserWarning, match=r"skipping .*step_000000002.*data position"):
        _, meta = manager.restore(state, mesh, data_iterator=again)
    assert meta["step"] == 1
    assert_same([host(next(again)) for _ in range(3)], want)


def test_restore_without_a_saved_position_or_a_plain_iterator_is_an_error(tmp_path):
    mesh = redeqx.make_mesh(2)
    state = redeqx.shard({"w": jax.numpy.zeros(4)}, {"w": P()}, mesh)
    with redeqx.CheckpointManager(tmp_path, async_save=False) as manager:
        manager.save(state, step=1)
        with pytest.raises(TypeError, match="get_state.*set_state.*redeqx.batches"):
            manager.save(state, step=2, data_iterator=iter([1, 2]))
    it = redeqx.grain_batches(grain.MapDataset.source(examples()), collate_fn, 1, mesh)
    with redeqx.CheckpointManager(tmp_path) as manager:
        with pytest.raises(ValueError, match="holds no data iterator position"):
            manager.restore(state, mesh, data_iterator=it)
    with pytest.raises(TypeError, match="Grain dataset or iterator"):
        redeqx.grain_batches([1, 2, 3], collate_fn, 1, mesh)


def test_states_as_json_bytes_and_dicts_round_trip():
    for state in (b'{"a": 1}\n\xff', {"next_index": 3, "nested": [{"a": 1}]}):
        saved = state_to_json(state)
        assert state_from_json(json.loads(json.dumps(saved))) == state
    with pytest.raises(TypeError, match="does not give back unchanged"):
        state_to_json({"a": (1, 2)})
    with pytest.raises(TypeError, match="not JSON"):
        state_to_json({"a": object()})


def test_a_data_loader_and_its_bytes_state():
    """A `grain.DataLoader` (its state is bytes, saved as base64)."""
    mesh = redeqx.make_mesh(2)
    sampler = grain.samplers.IndexSampler(num_records=N, shard_options=grain.sharding.NoSharding(), shuffle=True,
                                          seed=4, num_epochs=2)
    loader = grain.DataLoader(data_source=examples(), sampler=sampler, worker_count=0)
    it = redeqx.grain_batches(loader, collate_fn, 1, mesh)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert "base64" in state["grain"]
    rest = [host(next(it)) for _ in range(3)]
    again = redeqx.grain_batches(loader, collate_fn, 1, mesh)
    again.set_state(state)
    assert_same([host(next(again)) for _ in range(3)], rest)
