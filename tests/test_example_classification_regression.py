"""examples/classification_regression learns both tasks in a few epochs and
writes its checkpoints and logs."""

import re

import pytest

from _helpers import run_example


@pytest.mark.slow
def test_classification_regression_learns(tmp_path):
    text = run_example("classification_regression/main.py", "--n_epochs", "4", "--hidden", "32", "--log_every", "1",
                       "--workdir", tmp_path)
    for task in ("classification", "regression"):
        part = text[text.index(f"--- {task}"):]
        losses = [float(x) for x in re.findall(r"test loss ([0-9.]+)", part)[:4]]
        assert len(losses) == 4 and losses[-1] < losses[0], text[-3000:]
        assert (tmp_path / task / "metrics.jsonl").exists() and list((tmp_path / task / "checkpoints").iterdir())
    accuracy = float(re.search(r"classification test accuracy MLP \(redeqx\) +([0-9.]+)", text).group(1))
    mse = float(re.search(r"regression test MSE MLP \(redeqx\) +([0-9.]+)", text).group(1))
    assert accuracy >= 0.9, text[-3000:]
    assert mse < 4500, text[-3000:]  # the target's variance is ~5900: predicting the mean scores about that
