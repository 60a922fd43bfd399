"""Preemption: a run following the README's loop (`manager.save` every step,
``every`` far larger than the run, so only a preemption writes) that receives
SIGTERM at a random step saves at the next step every process agrees on,
exits with status 143, and the resumed run ends where an uninterrupted one
does. Real processes, real signals: one process, and two under
``python -m redeqx.launch`` with the signal sent to the launcher (it reaches
both) and to one process only (JAX's preemption service tells the other).
And exact resume without a signal: a run saving every step, killed with
SIGKILL at a random step (often mid-save), resumes from its latest
checkpoint and ends bit-identical to the uninterrupted run."""

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from _helpers import script_env

# one worker runs this module, so its module-scoped process run happens once under -n 2
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_resume_preempted")]
WORKER = Path(__file__).with_name("resume_worker.py")
ENV = script_env(JAX_PLATFORMS="cpu")  # 8 devices
N_STEPS, EVERY, PACE = 12, 1000, "0.3"  # PACE: seconds after each step, so a signal lands mid-run
TIMEOUT = 240


def start(workdir, *, launch=False, pace="0", every=EVERY, n_processes=2):
    cmd = [str(WORKER), str(workdir), str(every), pace]
    cmd = ([sys.executable, "-m", "redeqx.launch", "-n", str(n_processes), *cmd] if launch else [sys.executable, *cmd])
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, signal_at=None, target=None, sig=signal.SIGTERM):
    """Reads "step N" lines; at ``signal_at`` sends ``sig`` to ``target(proc)``
    (the process itself by default). Returns (lines, stderr, exit status)."""
    lines = []
    for line in proc.stdout:
        # the worker's lines; gloo's connection notes from two processes may be cut into them
        found = re.search(r"(step \d+|resumed at step \d+, epoch \d+, batch \d+)$", line.strip())
        if found is None:
            continue
        lines.append(found.group(1))
        if signal_at is not None and lines[-1] == f"step {signal_at}":
            os.kill(target(proc) if target else proc.pid, sig)
    proc.wait(timeout=TIMEOUT)
    return lines, proc.stderr.read(), proc.returncode


def launched_process(launcher, index):
    """The pid of process ``index`` under a `redeqx.launch` launcher."""
    for _ in range(100):
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        for pid in children:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"REDEQX_PROCESS_ID={index}".encode() in env:
                return int(pid)
        time.sleep(0.05)
    raise AssertionError(f"no process {index} under the launcher")


def saved_steps(workdir):
    return sorted(int(p.name.split("_")[1]) for p in (Path(workdir) / "checkpoints").glob("step_*"))


def final(workdir):
    with np.load(Path(workdir) / "final.npz", allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference")
    lines, err, rc = finish(start(workdir))
    assert rc == 0 and lines[-1] == f"step {N_STEPS}", err[-3000:]
    assert saved_steps(workdir) == [], "every=1000: an uninterrupted run writes nothing but its close()"
    return final(workdir)


def assert_final(workdir, want, exact):
    got = final(workdir)
    assert want.keys() == got.keys() and int(got["step"]) == N_STEPS
    for k in want:
        assert want[k].dtype == got[k].dtype, k
        if exact or k in ("key", "step"):
            assert np.array_equal(want[k], got[k]), k
        else:  # 2 x 4 devices sum in another order than 1 x 8: ~1e-8 apart; a wrong resume is ~1e-2 off
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)


def test_sigterm_one_process_saves_exits_143_then_killed_and_resumed_run_is_bit_identical(tmp_path, reference):
    """One process gets SIGTERM at a random step: it saves at the next step
    and exits 143. Its restart, saving every step, is SIGKILLed as soon as it
    reports a random later step (often mid-save), and the run restarted after
    that resumes from the latest checkpoint that was finished and ends
    bit-identical to the uninterrupted run: each restart carries on from what
    the run before it saved."""
    at = random.randrange(2, N_STEPS - 4)
    lines, err, rc = finish(start(tmp_path, pace=PACE), signal_at=at)
    assert rc == 143, (rc, err[-3000:])
    saved = saved_steps(tmp_path)
    assert len(saved) == 1 and at < saved[0] < N_STEPS - 1, (at, saved, lines)
    assert f"preempted (SIGTERM): saved step {saved[0]}" in err and "exiting with status 143" in err
    assert lines[-1] == f"step {saved[0]}" or lines[-1] == f"step {saved[0] - 1}", lines  # stopped at the save

    kill = random.randrange(saved[0] + 1, N_STEPS)
    lines, err, rc = finish(start(tmp_path, every=1), signal_at=kill, sig=signal.SIGKILL)
    assert rc == -signal.SIGKILL, (rc, err[-3000:])
    assert lines[0].startswith(f"resumed at step {saved[0]},"), (lines, err[-3000:])
    lines, err, rc = finish(start(tmp_path, every=1))
    assert rc == 0 and lines[0].startswith("resumed at step") and lines[-1] == f"step {N_STEPS}", (kill, lines, err)
    assert_final(tmp_path, reference, exact=True)


def signal_twice(proc, signal_at, second):
    """``finish``, sending SIGTERM to the launcher at ``signal_at`` and then
    ``second`` 50 ms later (a scheduler that signals twice, or Ctrl-C after a
    SIGTERM). Returns (lines, stderr, exit status, seconds from the first
    signal to the launcher's exit)."""
    lines, sent = [], None
    for line in proc.stdout:
        found = re.search(r"(step \d+|resumed at step \d+, epoch \d+, batch \d+)$", line.strip())
        if found is None:
            continue
        lines.append(found.group(1))
        if sent is None and lines[-1] == f"step {signal_at}":
            os.kill(proc.pid, signal.SIGTERM)
            sent = time.monotonic()
            time.sleep(0.05)
            os.kill(proc.pid, second)
    proc.wait(timeout=TIMEOUT)
    return lines, proc.stderr.read(), proc.returncode, time.monotonic() - sent


def unfinished(workdir):
    """What a save cut short leaves in the checkpoints directory (orbax's tmp directories)."""
    return [p.name for p in (Path(workdir) / "checkpoints").iterdir() if not re.match(r"^step_\d+$", p.name)]


# Under the full suite on 2 cores (two such 2-process runs at once) JAX's coordination barrier once
# timed out in the first run (the process left exited 1 with a CheckpointError, not 143); alone it
# passes. One rerun, and the root cause stays open in the issue tracker (issue 30's note).
@pytest.mark.flaky(reruns=1)
def test_sigterm_two_processes_to_one_or_twice_to_both_saves_and_resumes(tmp_path, reference):
    """First the signal reaches process 1 only (as when one host of a slice is
    preempted): both processes save at the same step and exit 143. The
    resumed run gets it through the launcher (both processes at once), twice
    50 ms apart (a scheduler that signals twice): before, the second signal
    SIGKILLed the processes at once, the save in flight was left as a tmp
    directory, and the launcher still exited 143 ("saved a checkpoint")
    without a word. A repeated SIGTERM is the same notice: the checkpoint is
    saved, nothing is left half-written, and the run exits 143. The third run
    finishes."""
    at = random.randrange(2, N_STEPS - 6)
    proc = start(tmp_path, launch=True, pace=PACE)
    lines, err, rc = finish(proc, signal_at=at, target=lambda p: launched_process(p, 1))
    assert rc == 143, (rc, err[-3000:])
    first = saved_steps(tmp_path)
    assert len(first) == 1 and at < first[0] < N_STEPS, (at, first, lines)
    assert "redeqx.launch: process 1 was preempted" in err or "redeqx.launch: process 0 was preempted" in err, err

    at = first[0] + 1
    lines, err, rc, elapsed = signal_twice(start(tmp_path, launch=True, pace=PACE), at, signal.SIGTERM)
    print(f"SIGTERM 50 ms after SIGTERM: exit {rc} {elapsed:.1f} s after the first signal")
    assert rc == 143, (rc, err[-3000:])
    assert lines[0].startswith(f"resumed at step {first[0]},"), lines
    second = [s for s in saved_steps(tmp_path) if s > first[0]]
    tmp = unfinished(tmp_path)
    assert len(second) == 1 and at < second[0] < N_STEPS and not tmp, (first, at, second, tmp, lines)
    assert f"preempted (SIGTERM): saved step {second[0]}" in err, err[-3000:]
    assert elapsed < 30, elapsed

    lines, err, rc = finish(start(tmp_path, launch=True))
    assert rc == 0 and lines[0].startswith(f"resumed at step {second[0]},"), (lines, err[-3000:])
    assert_final(tmp_path, reference, exact=False)


def test_sigterm_and_ctrl_c_50ms_apart_to_the_launcher_kill_at_once_and_say_nothing_was_saved(tmp_path):
    """A Ctrl-C after a SIGTERM kills at once, and the exit status and output
    say that nothing was saved (a repeated SIGTERM: the two-process test
    above). The launcher kills every process it started alike: one shows it."""
    at = random.randrange(2, N_STEPS - 6)
    lines, err, rc, elapsed = signal_twice(start(tmp_path, launch=True, pace=PACE, n_processes=1), at, signal.SIGINT)
    print(f"SIGINT 50 ms after SIGTERM: exit {rc} {elapsed:.1f} s after the first signal")
    assert rc not in (0, 143), (rc, err[-3000:])
    assert "nothing was saved" in err, err[-3000:]
    assert not saved_steps(tmp_path)  # every=1000: only a preemption's save could have written one
    assert elapsed < 30, elapsed
