"""examples/image_to_text: a tiny captioner learns to describe 8x8 digits within a few epochs."""

import re

import pytest

from _helpers import run_example


@pytest.mark.slow
def test_image_to_text_example_learns(tmp_path):
    out = run_example("image_to_text/main.py", "--n_epochs", "3", "--d_model", "64", "--n_layers", "1",
                      "--per_device_batch_size", "8", "--learning_rate", "3e-3", "--workdir", tmp_path)
    losses = [float(x) for x in re.findall(r"test loss ([0-9.]+)", out)]
    bleus = [float(x) for x in re.findall(r"BLEU ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.1, out[-2000:]  # the loss falls: 0.99 -> 0.71
    assert bleus[-1] > bleus[0], out[-2000:]  # and the captions get better
    assert (tmp_path / "captions.png").exists()
