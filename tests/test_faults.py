"""Faults a run meets on a real cluster, in one process: a diverging loss, a
full or unwritable disk, a checkpoint of another model or another tool, a
second run in a used workdir, a step saved twice, NaN in JSON files, a
TensorBoard writer that cannot write. Each is an error naming what and where,
and the last good checkpoint stays the one `restore` picks."""

import errno
import json
import math
import resource
import signal
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import redeqx
from _helpers import mlp, mse_loss
from redeqx.checkpoints import _format, _save

OPT = optax.adamw(1e-2)
BATCH = {"x": jnp.ones((8, 8)), "y": jnp.zeros((8, 4))}


@pytest.fixture(scope="module")
def setup(devices):
    mesh = redeqx.make_mesh(2)
    model = mlp()
    specs = redeqx.sharding_rules(model, mesh)
    step = redeqx.make_train_step(mse_loss, OPT, mesh, specs)
    return mesh, model, specs, step


def fresh_state(setup):
    mesh, model, specs, _ = setup
    return redeqx.init_state(model, OPT, mesh, specs, key=jax.random.key(1))


def at_step(state, step):
    return eqx.tree_at(lambda s: s.step, state, jnp.int32(step))


def poisoned(state):
    """``state`` with a NaN in its first weight, as a diverged run has."""
    w = state.model.layers[0].weight
    return eqx.tree_at(lambda s: s.model.layers[0].weight, state, w.at[0, 0].set(jnp.nan))


def arrays(tree):
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def assert_same(a, b):
    for x, y in zip(arrays(a), arrays(b), strict=True):
        np.testing.assert_array_equal(x, y)


def strict_load(text):
    """JSON as a strict reader takes it: a bare NaN or Infinity is an error."""
    def refuse(name):
        raise ValueError(f"bare {name} is not JSON")
    return json.loads(text, parse_constant=refuse)


# ----------------------------------------------------------------------------- divergence


def test_logger_stops_at_the_step_a_loss_turns_nan(tmp_path):
    logger = redeqx.Logger(tmp_path, tensorboard=False)
    logger.log({"loss": 1.0, "grad_norm": 2.0}, 6)
    with pytest.raises(FloatingPointError, match=r"step 7: grad_norm = inf, loss = nan: training diverged"):
        logger.log({"loss": jnp.float32(jnp.nan), "grad_norm": jnp.float32(jnp.inf), "accuracy": 0.5}, 7)
    lines = [strict_load(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 7 and lines[-1]["loss"] == "NaN" and lines[-1]["grad_norm"] == "Infinity"
    with pytest.warns(UserWarning, match=r"step 8: critic_loss = -inf"):
        redeqx.Logger(tmp_path / "warn", tensorboard=False, nonfinite="warn").log({"critic_loss": -np.inf}, 8)
    logger.log({"eval_accuracy": float("nan")}, 9)  # only losses and gradient norms mean divergence
    with pytest.raises(TypeError, match="argument nonfinite='ignore' is a str, expected 'raise' or 'warn'"):
        redeqx.Logger(tmp_path, nonfinite="ignore")
    logger.close()


def test_manager_never_saves_a_nonfinite_state_and_restore_keeps_the_good_one(tmp_path, setup):
    mesh, _, specs, _ = setup
    state = fresh_state(setup)
    manager = redeqx.CheckpointManager(tmp_path, keep_last=2)  # no best=: before, NaN states pushed out good ones
    manager.save(at_step(state, 1))
    manager.save(at_step(state, 2))
    for s in (3, 4):
        with pytest.raises(FloatingPointError, match=rf"state at step {s} holds NaN or inf \(model/layers\.0\.weight"):
            manager.save(at_step(poisoned(state), s))
    manager.wait()
    assert manager.steps() == [1, 2]
    restored, meta = manager.restore(state, mesh, specs)
    assert meta["step"] == 2 and all(np.isfinite(x).all() for x in arrays(restored.model))
    manager.close()
    allowed = redeqx.CheckpointManager(tmp_path / "allowed", allow_nonfinite=True, async_save=False)
    assert allowed.save(at_step(poisoned(state), 3))
    allowed.close()


def test_a_nonfinite_metric_is_never_the_best(tmp_path, setup):
    state = fresh_state(setup)
    manager = redeqx.CheckpointManager(tmp_path, keep_last=1, best={"acc": "max", "loss": "min"}, async_save=False)
    manager.save(at_step(state, 1), metrics={"acc": 0.5, "loss": 2.0})
    manager.save(at_step(state, 2), metrics={"acc": jnp.float32(jnp.nan), "loss": -math.inf}, force=True)
    manager.save(at_step(state, 3), metrics={"acc": 0.25, "loss": 3.0}, force=True)
    assert manager.best("acc") == manager.path(1) and manager.best("loss") == manager.path(1)
    assert manager.steps() == [1, 3]
    manager.close()
    meta = strict_load((tmp_path / "checkpoints" / "step_000000003" / "metadata" / "metadata").read_text())
    assert meta["metrics"] == {"acc": 0.25, "loss": 3.0}
    redeqx.save_checkpoint(tmp_path / "c", state, metadata={"metrics": {"acc": math.nan, "x": [1.0, math.inf]}})
    meta = strict_load((tmp_path / "c" / "metadata" / "metadata").read_text())
    assert meta["metrics"] == {"acc": "NaN", "x": [1.0, "Infinity"]}


def test_retention_is_a_pure_function():
    from redeqx.checkpoints._retention import retained

    metrics = {1: {"acc": 0.9}, 2: {"acc": math.nan}, 3: {"acc": 0.1}, 4: {}, 5: {"acc": 0.9}}
    assert retained([1, 2, 3, 4, 5], metrics, keep_last=2, best={"acc": "max"}) == {1, 4, 5}  # ties: the older
    assert retained([1, 2, 3, 4, 5], metrics, keep_last=1, best={"acc": "min"}) == {3, 5}
    assert retained([3, 1, 2], {}, keep_last=5, best={}) == {1, 2, 3}


# ----------------------------------------------------------------------------- full disk, no permission


def test_a_full_disk_names_the_directory_and_the_cause_and_the_state_trains_on(tmp_path, setup, monkeypatch):
    mesh, _, specs, step = setup
    state = fresh_state(setup)
    manager = redeqx.CheckpointManager(tmp_path, keep_last=1)
    manager.save(state, force=True)
    manager.wait()

    def full(directory):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))

    monkeypatch.setattr(_save, "_probe", full)
    with pytest.raises(redeqx.CheckpointError, match=r"step_000000001: the disk is full \(ENOSPC; .*checkpoints"):
        manager.save(at_step(state, 1))
    monkeypatch.undo()
    state, metrics = step(state, BATCH)  # the state is not donated away by a failed save
    assert np.isfinite(float(metrics["loss"]))
    assert manager.steps() == [0]
    restored, _ = manager.restore(state, mesh, specs)
    assert int(restored.step) == 0
    manager.close()


def test_an_async_save_failing_midway_surfaces_at_the_next_save(tmp_path, setup, caplog):
    """Also: orbax's own error records of that save (each with a ~100-line
    traceback, several per save) are not printed; the CheckpointError is
    the one report."""
    mesh = setup[0]
    model = eqx.nn.MLP(64, 64, 128, depth=2, key=jax.random.key(0))  # files larger than the limit below
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, OPT, mesh, specs, key=jax.random.key(1))
    manager = redeqx.CheckpointManager(tmp_path, keep_last=1)
    manager.save(at_step(state, 1))
    manager.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))  # the write probe passes; the arrays do not
    try:
        with caplog.at_level("ERROR"):
            manager.save(at_step(state, 2))  # async: returns before the failure
            with pytest.raises(redeqx.CheckpointError, match=r"step_000000002: a file grew past the size limit \(EFBIG; "):
                manager.save(at_step(state, 3))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert manager.steps() == [1]
    assert_same(at_step(state, 1), manager.restore(state, mesh, specs)[0])
    manager.close()
    echoes = [r for r in caplog.records if r.name in ("absl", "asyncio")
              and "step_000000002" in r.getMessage() + str(r.exc_info and r.exc_info[1])]
    assert not echoes, [r.getMessage()[:200] for r in echoes]


def test_an_unwritable_workdir_is_refused_at_once(tmp_path, setup):
    (tmp_path / "file").write_text("a file where a directory should be")
    with pytest.raises(redeqx.CheckpointError, match=r"cannot create the checkpoint directory .*file/checkpoints: "
                                                     r"a file stands where a directory is needed"):
        redeqx.CheckpointManager(tmp_path / "file")


def test_a_logger_that_cannot_write_raises_instead_of_hanging(tmp_path):
    """tensorboardX's writer thread died on a full disk and every later log()
    blocked on its full queue. Here a file-size limit stands for the disk."""
    logger = redeqx.Logger(tmp_path)
    scalars = {f"metric_{i}": float(i) for i in range(200)}
    outcome = []

    def log_many():
        try:
            for step in range(200):
                logger.log(scalars, step)
            outcome.append("no error")
        except OSError as e:
            outcome.append(e)

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        worker = threading.Thread(target=log_many, daemon=True)
        worker.start()
        worker.join(timeout=60)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert not worker.is_alive(), "Logger.log hung"
    assert isinstance(outcome[0], OSError) and "Logger could not write to" in str(outcome[0]), outcome
    assert str(tmp_path) in str(outcome[0])


def test_logger_info_and_close_on_a_full_disk_name_the_file(tmp_path):
    """Before: info() printed the logging module's "--- Logging error ---"
    traceback and went on, and close() then raised an OSError naming no file."""
    logger = redeqx.Logger(tmp_path, tensorboard=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(OSError, match=r"Logger could not write to .*log\.txt: a file grew past the size limit"):
            logger.info("x" * 100_000)
        try:  # what is left in a buffer fails again, or was dropped with the failed write
            logger.close()
        except OSError as e:
            assert "Logger could not write to" in str(e) and "log.txt" in str(e), e
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    logger.close()  # closed: a second close does nothing


# ----------------------------------------------------------------------------- another model, another tool


def test_another_model_names_the_first_difference_and_both_shapes(tmp_path, setup):
    mesh, model, _, _ = setup
    redeqx.save_checkpoint(tmp_path / "c", model)
    deeper = mlp(depth=3)
    with pytest.raises(ValueError, match=r"does not match like: first model/layers\.2\.weight: checkpoint \(4, 16\), "
                                         r"like \(16, 16\)"):
        redeqx.restore_checkpoint(tmp_path / "c", deeper, mesh, redeqx.sharding_rules(deeper, mesh))
    family = eqx.nn.Linear(8, 4, key=jax.random.key(0))
    with pytest.raises(ValueError) as e:
        redeqx.restore_checkpoint(tmp_path / "c", family, mesh, redeqx.sharding_rules(family, mesh))
    text = str(e.value)
    assert "first model/weight: in like (4, 8), missing from the checkpoint. Then:" in text
    assert "model/layers.0.weight: in the checkpoint (16, 8), not in like" in text
    assert "another model" in text and "orbax" not in text.lower()


def test_another_tools_orbax_checkpoint_says_what_it_is(tmp_path, setup):
    mesh, model, specs, _ = setup
    ocp.PyTreeCheckpointer().save(tmp_path / "theirs", {"w": np.ones(3)})
    with pytest.raises(redeqx.CheckpointError, match=r"theirs is an orbax checkpoint, not a redeqx checkpoint"):
        redeqx.restore_checkpoint(tmp_path / "theirs", model, mesh, specs)
    with ocp.CheckpointManager(tmp_path / "orbax_run") as theirs:
        theirs.save(0, args=ocp.args.StandardSave({"w": np.ones(3)}))
        theirs.save(1, args=ocp.args.StandardSave({"w": np.ones(3)}))
    with pytest.raises(redeqx.CheckpointError, match=r"orbax CheckpointManager directory \(steps 0, 1\), not a redeqx "
                                                     r"workdir"):
        redeqx.CheckpointManager(tmp_path / "orbax_run")
    redeqx.save_checkpoint(tmp_path / "ours", model)
    with pytest.raises(redeqx.CheckpointError, match="is one checkpoint, not a run's workdir"):
        redeqx.CheckpointManager(tmp_path / "ours")


def test_a_newer_format_is_refused_not_read_half_right(tmp_path, setup):
    mesh, model, specs, _ = setup
    manager = redeqx.CheckpointManager(tmp_path, keep_last=3, async_save=False)
    manager.save(model, step=1)
    manager.save(model, step=2)
    file = manager.path(2) / "metadata" / "metadata"
    meta = json.loads(file.read_text())
    meta["redeqx"]["format_version"] = _format.FORMAT_VERSION + 1
    file.write_text(json.dumps(meta))
    with pytest.raises(redeqx.CheckpointError, match=r"format version 2, written by redeqx .*Upgrade redeqx"):
        redeqx.restore_checkpoint(manager.path(2), model, mesh, specs)
    with pytest.raises(redeqx.CheckpointError, match="Upgrade redeqx"):
        manager.restore(model, mesh, specs)  # not a fall back to step 1: that would drop the newer run's work
    manager.close()


# ----------------------------------------------------------------------------- one run, no skipped save


def test_metrics_for_a_step_already_saved_are_recorded(tmp_path, setup):
    """The README's loop: a periodic save lands on an epoch's last step, then
    the epoch-end save of the same step brings the metrics."""
    mesh, _, specs, _ = setup
    state = fresh_state(setup)
    manager = redeqx.CheckpointManager(tmp_path, keep_last=1, every=2, best={"accuracy": "max"})
    for step, accuracy in ((2, 0.9), (4, 0.5)):
        assert manager.save(at_step(state, step), epoch=0, batch=step)  # periodic
        assert manager.save(at_step(state, step), epoch=1, metrics={"accuracy": accuracy}, force=True)
    manager.wait()
    assert manager.best("accuracy") == manager.path(2) and manager.steps() == [2, 4]
    meta = redeqx.read_metadata(manager.path(2))
    assert (meta["epoch"], meta["batch"], meta["metrics"]) == (1, 0, {"accuracy": 0.9})
    with pytest.raises(redeqx.CheckpointError, match="step 4 is already saved .* with other arrays"):
        manager.save(eqx.tree_at(lambda s: s.key, at_step(state, 4), jax.random.key(99)), force=True)
    manager.close()


def test_a_second_run_in_a_used_workdir_is_refused(tmp_path, setup):
    mesh, _, specs, _ = setup
    state = fresh_state(setup)
    first = redeqx.CheckpointManager(tmp_path, keep_last=1)
    first.save(at_step(state, 5))
    first.close()
    second = redeqx.CheckpointManager(tmp_path, keep_last=1)  # a new run, no restore
    with pytest.raises(redeqx.CheckpointError, match=r"already holds checkpoints \(steps 5\) that this manager did "
                                                     r"not restore from.*overwrite=True"):
        second.save(at_step(state, 1))
    assert second.restore(state, mesh, specs)[1]["step"] == 5  # resuming is the way on
    assert second.save(at_step(state, 6))
    second.close()
    with pytest.raises(TypeError, match="argument overwrite='yes' is a str, expected bool"):
        redeqx.CheckpointManager(tmp_path, overwrite="yes")  # not a truthy string deleting a run
    with pytest.warns(UserWarning, match="deleting the checkpoints of steps 6"):
        third = redeqx.CheckpointManager(tmp_path, keep_last=1, overwrite=True)
    assert third.steps() == [] and third.save(at_step(state, 1))
    third.close()
    assert third.steps() == [1]


def test_a_relative_workdir_saves_and_restores(tmp_path, setup, monkeypatch):
    """The README's `--workdir runs/mnist`: orbax refused relative paths, and
    every save failed with advice about disk space."""
    mesh, model, specs, _ = setup
    state = fresh_state(setup)
    monkeypatch.chdir(tmp_path)
    with redeqx.CheckpointManager("runs/mnist", keep_last=1) as manager:
        assert manager.save(at_step(state, 3))
    assert redeqx.CheckpointManager("runs/mnist").restore(state, mesh, specs)[1]["step"] == 3
    redeqx.save_checkpoint("one", model)
    assert_same(model, redeqx.restore_checkpoint("one", model, mesh, specs))


def test_a_batch_that_changes_a_feature_size_names_the_key_and_the_change(setup):
    """Before: the error came from inside the model (dot_general ... (8,) and
    (7,)), naming neither the batch key nor what changed."""
    mesh, model, specs, step = setup
    state, _ = step(fresh_state(setup), BATCH)
    narrow = {"x": jnp.ones((8, 7)), "y": jnp.zeros((8, 4))}
    with pytest.raises(TypeError) as e:
        step(state, narrow)
    notes = [n for n in getattr(e.value, "__notes__", []) if "differs from the previous call's" in n]
    assert len(notes) == 1 and "batch['x'] (8, 8) -> (8, 7)" in notes[0] and "batch['y']" not in notes[0], notes
