"""examples/text_to_text: a tiny T5 learns docstring -> function name on the stdlib for a few steps."""

import re

import pytest

from _helpers import run_example


@pytest.mark.slow
def test_text_to_text_example_learns(tmp_path):
    out = run_example("text_to_text/main.py", "--n_epochs", "3", "--n_train", "1024", "--d_model", "64",
                      "--n_layers", "1", "--vocab_size", "512", "--src_len", "24", "--tgt_len", "6", "--num_beams", "2",
                      "--n_eval", "32", "--learning_rate", "5e-3", "--workdir", tmp_path)
    losses = [float(x) for x in re.findall(r"test loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.1, out[-2000:]  # the loss falls
    assert re.search(r"best checkpoint by ROUGE-L: step \d+", out), out[-2000:]
    final = re.search(r"final test rouge1 ([0-9.]+), rouge2 ([0-9.]+), rougeL ([0-9.]+) \((\d+) names\)", out)
    assert final and int(final.group(4)) > 300, out[-2000:]  # a name for every test function
    assert list((tmp_path / "outputs").glob("test_names_step*.json")), "the predictions were not saved"
