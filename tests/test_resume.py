"""Exact resume: a run killed with SIGKILL at a random step (often mid-save)
and restarted from its latest checkpoint ends bit-identical to a run that was
never interrupted."""

import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _helpers import fresh_env

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("resume_worker.py")
ENV = fresh_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
N_STEPS = 12


def run(workdir, kill_at=None):
    """Runs the worker; with ``kill_at``, SIGKILLs it as soon as it reports that step."""
    proc = subprocess.Popen([sys.executable, str(WORKER), str(workdir)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if kill_at is not None and line.strip() == f"step {kill_at}":
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=300)
    err = proc.stderr.read()
    if kill_at is None:
        assert proc.returncode == 0, err[-3000:]
    else:
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, err[-3000:])
    return lines


def final(workdir):
    with np.load(Path(workdir) / "final.npz", allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def test_killed_and_resumed_run_is_bit_identical(tmp_path):
    run(tmp_path / "reference")
    kill = random.randrange(2, N_STEPS)
    run(tmp_path / "resumed", kill_at=kill)
    lines = run(tmp_path / "resumed")
    assert lines[0].startswith("resumed at step") and lines[-1] == f"step {N_STEPS}", (kill, lines)
    want, got = final(tmp_path / "reference"), final(tmp_path / "resumed")
    assert want.keys() == got.keys() and int(got["step"]) == N_STEPS
    for k in want:
        assert want[k].dtype == got[k].dtype and np.array_equal(want[k], got[k]), (k, kill)
