"""The checkpoint package's pure parts, each on its own: when a save is due,
whether its metrics improve on a tracked best, which steps are kept, and
the data position a checkpoint keeps (issue 42). No disk, no orbax: these
run in milliseconds."""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import redeqx
from redeqx.checkpoints._integrity import same_arrays
from redeqx.checkpoints._position import (
    DATA_ITERATOR,
    data_shards_of,
    position,
    restore_position,
    warn_moved_position,
)
from redeqx.checkpoints._retention import check_best, check_unit, due, improves, ranked, retained

NAN = math.nan


# ----------------------------------------------------------------------------- due


@pytest.mark.parametrize(("step", "epoch", "every", "unit", "want"), [
    (0, 0, 5, "step", True),
    (10, 1, 5, "step", True),
    (11, 1, 5, "step", False),
    (11, 2, 2, "epoch", True),  # the epoch counts, not the step
    (10, 3, 2, "epoch", False),
    (7, 0, 1, "step", True),
])
def test_due_counts_steps_or_epochs(step, epoch, every, unit, want):
    assert due(step, epoch, every=every, unit=unit) is want


def test_a_unit_that_is_neither_steps_nor_epochs_is_refused():
    with pytest.raises(ValueError, match="unit must be 'step' or 'epoch', got 'batch'"):
        due(1, 1, every=1, unit="batch")
    with pytest.raises(ValueError, match="got 'batch'"):
        check_unit("batch")


def test_best_modes_are_max_or_min():
    assert check_best(None) == {}
    assert check_best({"acc": "max", "loss": "min"}) == {"acc": "max", "loss": "min"}
    with pytest.raises(ValueError, match=r"best\['acc'\] must be 'max' or 'min', got 'up'"):
        check_best({"acc": "up"})


# ----------------------------------------------------------------------------- improves


def test_improves_on_the_best_by_each_metric_in_its_direction():
    known = {1: {"acc": 0.9, "loss": 0.5}, 2: {"acc": 0.7, "loss": 0.3}}
    best = {"acc": "max", "loss": "min"}
    assert not improves({"acc": 0.9, "loss": 0.3}, known, best)  # a tie is no improvement
    assert improves({"acc": 0.95}, known, best)
    assert improves({"loss": 0.2}, known, best)
    assert not improves({"acc": 0.8, "loss": 0.4}, known, best)
    assert not improves({"other": 99.0}, known, best)  # untracked metrics do not count


def test_a_first_finite_value_improves_and_non_finite_ones_never_do():
    best = {"acc": "max"}
    assert improves({"acc": 0.1}, {}, best)
    assert improves({"acc": 0.1}, {1: {"acc": NAN}, 2: {}}, best)  # no finite value on disk yet
    assert not improves({"acc": NAN}, {}, best)
    assert not improves({"acc": math.inf}, {1: {"acc": 0.5}}, best)
    assert not improves({}, {}, best)


# ----------------------------------------------------------------------------- which steps are kept


def test_ranked_puts_the_best_first_and_older_steps_first_among_ties():
    metrics = {1: {"acc": 0.5}, 2: {"acc": 0.9}, 3: {"acc": 0.5}, 4: {"acc": NAN}, 5: {}}
    assert ranked([5, 4, 3, 2, 1], metrics, "acc", "max") == [2, 1, 3]
    assert ranked([1, 2, 3, 4, 5], metrics, "acc", "min") == [1, 3, 2]
    assert ranked([1, 2], {}, "acc", "max") == []


@pytest.mark.parametrize(("keep_last", "best", "want"), [
    (1, {}, {6}),
    (3, {}, {4, 5, 6}),
    (10, {}, {1, 2, 3, 4, 5, 6}),
    (1, {"acc": "max"}, {2, 6}),
    (1, {"acc": "max", "loss": "min"}, {2, 3, 6}),
    (2, {"loss": "min"}, {3, 5, 6}),
])
def test_retained_keeps_the_newest_and_the_best_of_each_metric(keep_last, best, want):
    metrics = {1: {"acc": 0.1, "loss": 9.0}, 2: {"acc": 0.9, "loss": 5.0}, 3: {"acc": 0.5, "loss": 1.0},
               4: {"acc": NAN, "loss": NAN}, 5: {"acc": 0.2}, 6: {}}
    assert retained([6, 5, 4, 3, 2, 1], metrics, keep_last=keep_last, best=best) == want


def test_retained_never_keeps_a_non_finite_metric_as_best():
    metrics = {1: {"loss": math.inf}, 2: {"loss": NAN}, 3: {"loss": 2.0}, 4: {}}
    assert retained([1, 2, 3, 4], metrics, keep_last=1, best={"loss": "min"}) == {3, 4}
    assert retained([1, 2], {1: {"loss": NAN}}, keep_last=1, best={"loss": "min"}) == {2}
    assert retained([], {}, keep_last=1, best={"loss": "min"}) == set()


# ----------------------------------------------------------------------------- the same arrays twice


def _meta(**leaves):
    return {"redeqx": {"leaves": {"model": leaves}}}


def test_same_arrays_compares_names_word_sums_and_content_hashes():
    a = _meta(w={"checksum": 1, "content_hash": "ab"}, b={"checksum": 2, "content_hash": "cd"})
    assert same_arrays(a, _meta(w={"checksum": 1, "content_hash": "ab"}, b={"checksum": 2, "content_hash": "cd"}))
    assert same_arrays(a, _meta(w={"checksum": 1}, b={"checksum": 2}))  # an older checkpoint has no hashes
    assert not same_arrays(a, _meta(w={"checksum": 1, "content_hash": "ab"}, b={"checksum": 3}))
    assert not same_arrays(a, _meta(w={"checksum": 1, "content_hash": "ab"}, b={"checksum": 2, "content_hash": "ce"}))
    assert not same_arrays(a, _meta(w={"checksum": 1, "content_hash": "ab"}))


# ----------------------------------------------------------------------------- the data position


class _Iterator:
    def __init__(self, state):
        self.state = state

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


def test_position_holds_the_epoch_batch_key_data_size_and_iterator():
    mesh = redeqx.make_mesh(2)  # data = 4 of the 8 devices
    state = {"w": jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P("data")))}
    assert data_shards_of(state) == mesh.shape["data"] == 4
    assert data_shards_of({"w": np.ones(3)}) is None
    key = jax.random.key(3)
    fields = position(state, epoch=2, batch=7, data_key=key, per_device_batch_size=8,
                      data_iterator=_Iterator(b"\x00\x01"))
    assert fields == {"epoch": 2, "batch": 7, "data_key": key, "per_device_batch_size": 8, "data_shards": 4,
                      DATA_ITERATOR: [{"base64": "AAE="}]}
    assert position({}, epoch=0, batch=0, data_key=None, per_device_batch_size=None, data_iterator=None) == {
        "epoch": 0, "batch": 0}
    with pytest.raises(ValueError, match="per_device_batch_size"):
        position({}, epoch=0, batch=0, data_key=None, per_device_batch_size=0, data_iterator=None)


def test_restore_position_sets_this_process_state_or_says_what_is_missing():
    it = _Iterator(None)
    restore_position(it, {DATA_ITERATOR: [{"json": {"next": 5}}]}, Path("step_000000005"))
    assert it.state == {"next": 5}
    with pytest.raises(ValueError, match="step_000000005 holds no data iterator position"):
        restore_position(it, {}, Path("step_000000005"))
    with pytest.raises(ValueError, match="the data positions of 2 processes, and this run has 1"):
        restore_position(it, {DATA_ITERATOR: [{"json": 1}, {"json": 2}]}, Path("step_000000005"))


def test_a_mid_epoch_position_on_another_global_batch_warns_with_the_batch_to_start_at():
    mesh = redeqx.make_mesh(2)  # data = 4
    path = Path("step_000000010")
    saved = {"batch": 6, "data_shards": 2, "per_device_batch_size": 8}  # 16 examples a batch: next is example 96
    with pytest.warns(UserWarning, match=r"start at example 192, not 96.*Example 96 starts batches\(\.\.\., start=3\)"):
        warn_moved_position(saved, mesh, path, 8)
    with pytest.warns(UserWarning, match="data=2, and this mesh has data=4"):
        warn_moved_position({"batch": 6, "data_shards": 2}, mesh, path, None)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_moved_position(saved, mesh, path, 4)  # the same global batch of 16
        warn_moved_position({**saved, "batch": 0}, mesh, path, 8)  # the start of an epoch
        warn_moved_position({"batch": 6, "data_shards": 4}, mesh, path, None)
