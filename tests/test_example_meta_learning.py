"""examples/meta_learning (MAML, sinusoids): a few hundred meta-steps already
make one inner gradient step pay off on held-out tasks."""

import re

import pytest

from _helpers import run_example


@pytest.mark.slow
def test_maml_adaptation_beats_no_adaptation(tmp_path):
    out = run_example("meta_learning/main.py", "--n_epochs", "4", "--tasks_per_epoch", "1280", "--n_test_tasks", "128",
                      "--learning_rate", "1e-2", "--test_steps", "5", "--workdir", tmp_path,
                      "--plot", tmp_path / "curves.png")
    rows = re.findall(r"test MSE before adapting ([0-9.]+), after 1 step\(s\) ([0-9.]+), after 5 step\(s\) ([0-9.]+)",
                      out)
    assert len(rows) == 4, out[-3000:]
    (_, first_1, _), (pre, post_1, post_5) = [tuple(map(float, r)) for r in (rows[0], rows[-1])]
    assert post_1 < 0.9 * first_1, out[-3000:]  # meta-training made the one-step adaptation better
    assert post_1 < 0.75 * pre and post_5 < post_1, out[-3000:]  # and adapting beats not adapting
    assert (tmp_path / "curves.png").stat().st_size > 0 and (tmp_path / "metrics.jsonl").exists()
