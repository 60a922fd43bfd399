"""Grain in, resumed exactly, with real processes: a run fed by a Grain
pipeline through `grain_batches` is SIGKILLed at a random step (between
checkpoints, or with a save in flight), started again, and must see the
very batches (hashes of the global batch at every step) and end with the
very parameters, bit for bit, of an uninterrupted run: at one process with
Grain worker processes, and at two processes."""

import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("grain")

from test_resume_preempted import ENV, TIMEOUT  # noqa: E402

WORKER = Path(__file__).with_name("grain_resume_worker.py")
N_STEPS = 10
# one process (with Grain worker processes, the harder case) and two; one process without workers is
# what tests/test_grain.py checks in-process
CASES = {"one-process-2-grain-workers": (1, 2), "two-processes": (2, 0)}


def run(workdir, n_processes, workers, kill_at=0):
    """Runs the worker; returns ({step: batch hash}, its stdout lines, stderr, exit status)."""
    cmd = [str(WORKER), str(workdir), str(kill_at), str(workers)]
    cmd = [sys.executable, "-m", "redeqx.launch", "-n", "2", *cmd] if n_processes == 2 else [sys.executable, *cmd]
    # a session of its own: the worker kills its process group (with its Grain workers), never pytest's
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=TIMEOUT, start_new_session=True)
    lines = [m.group(1) for line in proc.stdout.splitlines()
             if (m := re.search(r"(step \d+ [0-9a-f]{16}|resumed at step \d+, batch \d+)$", line.strip()))]
    seen = {int(w[1]): w[2] for w in (line.split() for line in lines if line.startswith("step"))}
    return seen, lines, proc.stderr, proc.returncode


def final(workdir):
    with np.load(Path(workdir) / "final.npz", allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_killed_and_resumed_run_sees_the_same_batches_and_ends_bit_identical(tmp_path, case):
    n_processes, workers = CASES[case]
    want, _, err, rc = run(tmp_path / "reference", n_processes, workers)
    assert rc == 0 and sorted(want) == list(range(1, N_STEPS + 1)), err[-3000:]

    # the save of step 6 waits for step 3's (async) to be on disk: at 7..9 step 3 at least is there, and
    # step 6 may still be in flight (then the run resumes at 3)
    kill_at = random.randrange(7, N_STEPS)
    killed, _, err, rc = run(tmp_path / "run", n_processes, workers, kill_at)
    assert rc != 0 and max(killed) == kill_at, (rc, killed, err[-3000:])
    resumed, lines, err, rc = run(tmp_path / "run", n_processes, workers)
    assert rc == 0, err[-3000:]
    found = re.match(r"resumed at step (\d+), batch (\d+)$", lines[0])
    assert found and found.group(1) == found.group(2) and int(found.group(1)) in (3, 6), (kill_at, lines, err[-3000:])
    start = int(found.group(1))
    print(f"{case}: killed at step {kill_at}, resumed at step {start}")
    assert sorted(resumed) == list(range(start + 1, N_STEPS + 1))
    assert {s: killed[s] for s in killed} == {s: want[s] for s in killed}
    assert resumed == {s: want[s] for s in resumed}, "the resumed run read other batches"
    got, ref = final(tmp_path / "run"), final(tmp_path / "reference")
    assert got.keys() == ref.keys()
    for k in ref:
        assert ref[k].dtype == got[k].dtype and np.array_equal(ref[k], got[k]), k
