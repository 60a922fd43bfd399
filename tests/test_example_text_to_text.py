"""examples/text_to_text: a tiny T5 learns docstring -> function name on the stdlib for a few steps."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_text_to_text_example_learns(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own 8 devices
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples/text_to_text/main.py"), "--n_epochs", "3", "--n_train", "1024",
         "--d_model", "64", "--n_layers", "1", "--vocab_size", "512", "--src_len", "24", "--tgt_len", "6",
         "--num_beams", "2", "--n_eval", "32", "--learning_rate", "5e-3", "--workdir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"test loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.1, out.stdout[-2000:]  # the loss falls
    assert re.search(r"best checkpoint by ROUGE-L: step \d+", out.stdout), out.stdout[-2000:]
    final = re.search(r"final test rouge1 ([0-9.]+), rouge2 ([0-9.]+), rougeL ([0-9.]+) \((\d+) names\)", out.stdout)
    assert final and int(final.group(4)) > 300, out.stdout[-2000:]  # a name for every test function
    assert list((tmp_path / "outputs").glob("test_names_step*.json")), "the predictions were not saved"
