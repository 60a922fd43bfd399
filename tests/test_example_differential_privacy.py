"""examples/differential_privacy (DP-SGD on digits): the private model learns,
and the epsilon it prints is the accountant's for the rate, noise and steps used."""

import os
import re
import subprocess
import sys
from pathlib import Path

import dp_accounting

ROOT = Path(__file__).resolve().parents[1]


def test_dp_sgd_learns_and_accounts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own 8 devices
    cmd = [sys.executable, str(ROOT / "examples/differential_privacy/main.py"), "--n_epochs", "3", "--hidden", "32",
           "--workdir", str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    rows = [tuple(map(float, r)) for r in re.findall(
        r"step (\d+), test accuracy DP-SGD ([0-9.]+) \(epsilon ([0-9.]+) at delta 1e-05\), non-private ([0-9.]+)", text)]
    assert len(rows) == 3, text[-3000:]
    assert rows[-1][1] > rows[0][1] and rows[-1][1] > 0.5, text[-3000:]  # learns, well above chance (0.1)
    assert all(a[2] < b[2] for a, b in zip(rows, rows[1:]))  # the budget only grows
    rate = float(re.search(r"sampling rate ([0-9.]+)", text).group(1))
    steps, eps = int(rows[-1][0]), rows[-1][2]
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(1.0)), steps)
    expected = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    assert abs(eps - expected) < 0.02, (eps, expected)  # the printed rate is rounded to 4 digits
    assert list((tmp_path / "checkpoints").iterdir())
