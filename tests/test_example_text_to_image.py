"""examples/text_to_image: a tiny conditional DDPM's loss falls and it draws a grid per epoch."""

import re

import pytest

from _helpers import run_example


@pytest.mark.slow
def test_text_to_image_example_learns(tmp_path):
    out = run_example("text_to_image/main.py", "--n_epochs", "3", "--d_model", "64", "--n_blocks", "1",
                      "--per_device_batch_size", "16", "--samples_per_digit", "2", "--workdir", tmp_path)
    losses = [float(x) for x in re.findall(r"epoch \d+: .*test loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.05, out[-2000:]  # the loss falls
    assert sorted(p.name for p in tmp_path.glob("samples_epoch*.png")) == [f"samples_epoch{i}.png" for i in range(3)]
