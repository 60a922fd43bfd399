"""Logger: TensorBoard event files (read back with TensorBoard's own reader),
JSONL, the log file, outputs, throughput, wandb when configured, process 0 only."""

import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import redeqx


def read_scalars(logdir):
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_event_files_hold_logged_values(tmp_path):
    workdir = tmp_path / "missing" / "run"  # created on demand
    logger = redeqx.Logger(workdir)
    logger.log({"loss": jnp.float32(2.5), "accuracy": np.float64(0.125)}, 1, examples=32)
    logger.log({"loss": 1.5, "accuracy": 0.5, "hist": jnp.arange(3)}, 2, examples=32, tokens=640)
    logger.close()
    scalars = read_scalars(workdir / "tensorboard")
    assert scalars["loss"] == [(1, 2.5), (2, 1.5)]
    assert scalars["accuracy"] == [(1, 0.125), (2, 0.5)]
    assert [s for s, _ in scalars["examples_per_s"]] == [1, 2] and all(v > 0 for _, v in scalars["examples_per_s"])
    assert [s for s, _ in scalars["tokens_per_s"]] == [2]
    assert [s for s, _ in scalars["time_to_first_step_s"]] == [1]
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[0]["loss"] == 2.5 and lines[1]["hist"] == [0, 1, 2] and "time_to_first_step_s" not in lines[1]


def test_a_resumed_run_records_each_step_once(tmp_path):
    """A run killed after step 5 whose last checkpoint is step 2 resumes and replays steps 3 to 5:
    its first log (step 3) drops the records of steps 3 on (and a line a kill cut short) from
    metrics.jsonl and hides them in TensorBoard. Before, the replayed steps were recorded twice."""
    first = redeqx.Logger(tmp_path)
    for step in range(1, 6):
        first.log({"loss": float(step)}, step)
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # the kill came mid-write
    resumed = redeqx.Logger(tmp_path)
    for step in range(3, 8):
        resumed.log({"loss": 10.0 + step}, step)
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(1, 1.0), (2, 2.0), *((s, 10.0 + s) for s in range(3, 8))]
    assert read_scalars(tmp_path / "tensorboard")["loss"] == [(1, 1.0), (2, 2.0), *((s, 10.0 + s) for s in range(3, 8))]
    assert "dropped 4 line(s)" in (tmp_path / "log.txt").read_text()
    again = redeqx.Logger(tmp_path)  # a run that starts past every record keeps them all
    again.log({"loss": 0.5}, 8)
    again.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 8


def test_info_and_outputs(tmp_path, capsys):
    logger = redeqx.Logger(tmp_path, tensorboard=False)
    logger.info("epoch 1 done")
    for _ in logger.bar(range(3), desc="x"):
        logger.log({"loss": 1.0, "learning_rate": 1e-3}, 0)
        logger.info("inside the bar")
    path = logger.save_outputs([{"label": np.int32(3)}, {"label": 4}], "test_preds", 7)
    logger.close()
    assert "epoch 1 done" in capsys.readouterr().out
    text = (tmp_path / "log.txt").read_text()
    assert "epoch 1 done" in text and text.count("inside the bar") == 3
    assert path == tmp_path / "outputs" / "test_preds_step7.json"
    assert json.loads(path.read_text()) == [{"label": 3}, {"label": 4}]
    assert not (tmp_path / "tensorboard").exists()


def test_wandb_only_when_configured(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", values["loss"], step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = redeqx.Logger(tmp_path / "a", tensorboard=False, wandb={"project": "p", "mode": "offline"})
    logger.log({"loss": 0.5}, 3)
    logger.close()
    assert calls == [("init", {"project": "p", "mode": "offline"}), ("log", 0.5, 3), ("finish",)]
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails: not needed without wandb=
    redeqx.Logger(tmp_path / "b", tensorboard=False).close()
    with pytest.raises(ImportError, match="pip install wandb"):
        redeqx.Logger(tmp_path / "c", tensorboard=False, wandb={})


def test_only_process_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    logger = redeqx.Logger(tmp_path / "run")
    logger.info("hello")
    assert logger.log({"loss": 1.0}, 1)["loss"] == 1.0
    assert logger.save_outputs([1], "p", 1) is None
    logger.close()
    assert not (tmp_path / "run").exists()


def test_bad_input(tmp_path):
    logger = redeqx.Logger(tmp_path, tensorboard=False)
    with pytest.raises(TypeError, match="step must be an int"):
        logger.log({"loss": 1.0}, 1.5)
    with pytest.raises(TypeError, match="metrics must be a dict"):
        logger.log([1.0], 1)
    with pytest.raises(ValueError, match="examples must be a count"):
        logger.log({"loss": 1.0}, 1, examples=-1)
    with pytest.raises(ValueError, match="name must be a plain file name"):
        logger.save_outputs([], "../x", 1)
    with pytest.raises(TypeError, match="argument wandb='my-project' is a str, expected Mapping"):
        redeqx.Logger(tmp_path, wandb="my-project")
    logger.close()


def test_batches_progress_bar_shows_loss_and_learning_rate(tmp_path):
    mesh = redeqx.make_mesh(2)
    examples = [{"x": np.full(3, i, np.float32)} for i in range(16)]
    collate = lambda es: {"x": np.stack([e["x"] for e in es])}  # noqa: E731
    logger = redeqx.Logger(tmp_path, tensorboard=False)
    shown = []
    for i, batch in enumerate(redeqx.batches(examples, collate, 1, mesh, desc="epoch 0")):
        logger.log({"loss": 1.0 / (i + 1), "learning_rate": 1e-3}, i)
        bar = redeqx._progress.innermost()
        shown.append(bar.postfix)
    assert redeqx._progress.innermost() is None  # the bar is gone with its loop
    assert "loss=0.5" in shown[1] and "learning_rate=0.001" in shown[1]
    logger.close()
