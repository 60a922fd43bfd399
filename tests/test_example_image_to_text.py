"""examples/image_to_text: a tiny captioner learns to describe 8x8 digits within a few epochs."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_image_to_text_example_learns(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own 8 devices
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples/image_to_text/main.py"), "--n_epochs", "4", "--d_model", "64",
         "--n_layers", "1", "--per_device_batch_size", "8", "--learning_rate", "3e-3", "--workdir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"test loss ([0-9.]+)", out.stdout)]
    bleus = [float(x) for x in re.findall(r"BLEU ([0-9.]+)", out.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, out.stdout[-2000:]  # the loss falls
    assert bleus[-1] > bleus[0], out.stdout[-2000:]  # and the captions get better
    assert (tmp_path / "captions.png").exists()
