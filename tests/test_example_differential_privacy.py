"""examples/differential_privacy (DP-SGD on digits): the private model learns,
and the epsilon it prints is the accountant's for the rate, noise and steps used."""

import re

import dp_accounting
import pytest

from _helpers import run_example


@pytest.mark.slow
def test_dp_sgd_learns_and_accounts(tmp_path):
    text = run_example("differential_privacy/main.py", "--n_epochs", "3", "--hidden", "32", "--workdir", tmp_path)
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
