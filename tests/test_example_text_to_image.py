"""examples/text_to_image: a tiny conditional DDPM's loss falls and it draws a grid per epoch."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_text_to_image_example_learns(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own 8 devices
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples/text_to_image/main.py"), "--n_epochs", "3", "--d_model", "64",
         "--n_blocks", "1", "--per_device_batch_size", "16", "--samples_per_digit", "2",
         "--workdir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"epoch \d+: .*test loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.05, out.stdout[-2000:]  # the loss falls
    assert sorted(p.name for p in tmp_path.glob("samples_epoch*.png")) == [f"samples_epoch{i}.png" for i in range(3)]
