"""Faults that end processes, with real processes: under
``python -m redeqx.launch``, a process that raises mid-run or ends its script
early ends the whole run, bounded in time and named; a checkpoint still being
written when a script ends without ``close()`` is finished, or its loss is an
exit status other than 0."""

import re
import subprocess
import textwrap
import time

import pytest

from _helpers import COLLECTIVES, run_python

pytestmark = pytest.mark.slow
PROCESS_TIMEOUT = 120  # a bug fails the test instead of hanging it (before: 300 s in JAX's shutdown barrier)

TRAINING = """
    import sys, time
""" + COLLECTIVES + """
    for step in range(10**6):  # a training loop: collectives with host work in between
        total(x).block_until_ready()
        if step == 3 and jax.process_index() == 1:
            print(f"process 1 {sys.argv[1]} at step {step}", flush=True)
            {action}
        time.sleep(0.05)
"""


def launch(tmp_path, body, *args, launcher=("-n", "2", "--devices", "8")):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    start = time.monotonic()
    done = run_python(script, *args, launch=launcher, timeout=PROCESS_TIMEOUT, check=False)
    return done, time.monotonic() - start


def test_a_process_raising_mid_run_ends_every_process_and_its_traceback_shows_once(tmp_path):
    done, elapsed = launch(tmp_path, TRAINING.replace("{action}", 'raise RuntimeError("boom at step 3")'), "raises")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "boom at step 3" in done.stderr and done.stderr.count("Traceback") == 1, done.stderr[-3000:]
    assert "KeyboardInterrupt" not in done.stderr  # the stopped process leaves quietly
    assert "process 1 (pid" in done.stderr and "exited with status 1; stopping the other 1 process" in done.stderr
    assert elapsed < 60, f"{elapsed:.0f} s"


def test_a_process_ending_its_script_early_is_named_and_the_run_ends(tmp_path):
    """Before: the other process waited in a collective for it, and it in JAX's
    shutdown barrier for the other, for 300 s, until both aborted."""
    done, elapsed = launch(tmp_path, TRAINING.replace("{action}", "sys.exit(0)"), "exits",
                           launcher=("-n", "2", "--devices", "8", "--exit-timeout", "3"))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "process 1 ended the script, and process 0 still ran 3 s later" in done.stderr, done.stderr[-3000:]
    assert elapsed < 60, f"{elapsed:.0f} s"


SAVE_AND_END = """
    import os, resource, signal, sys
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # the suite's, if set
    import jax, equinox as eqx, optax, redeqx
    mesh = redeqx.make_mesh(2)
    model = eqx.nn.MLP(512, 512, 512, depth=3, key=jax.random.key(0))   # ~3 MB of arrays, ~10 MB with Adam
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.adam(1e-3), mesh, specs, key=jax.random.key(1))
    manager = redeqx.CheckpointManager(sys.argv[1], keep_last=1)
    if sys.argv[2] == "full":  # a disk that fills up during the write (the write probe still fits)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    manager.save(state, force=True)
    print("saved, no close()", flush=True)
"""


@pytest.mark.parametrize("disk", ["full", "fine"])
def test_a_save_in_flight_at_the_end_of_a_script_is_finished_or_its_loss_is_an_error(tmp_path, disk):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SAVE_AND_END))
    done = run_python(script, tmp_path / "run", disk, timeout=PROCESS_TIMEOUT, check=False)
    saved = list((tmp_path / "run" / "checkpoints").glob("step_*"))
    if disk == "full":  # before: exit status 0, with a warning
        assert done.returncode == 1 and not saved, (done.returncode, done.stderr[-3000:])
        assert "could not write the checkpoint to" in done.stderr and "step_000000000" in done.stderr
        assert "a checkpoint was lost; exiting with status 1" in done.stderr
        # the cause: the size limit, or (when the write was slower than the script) Python's exit
        assert "a file grew past the size limit" in done.stderr or "Python was exiting" in done.stderr
        # redeqx's report is the one: not orbax's logged tracebacks, nor tensorstore's closed-loop echoes
        assert "_SignalingThread" not in done.stderr and "Event loop is closed" not in done.stderr, done.stderr[-3000:]
    else:  # the write may finish before Python stops its threads, or not; never exit 0 without it
        assert (done.returncode == 0) == bool(saved), (done.returncode, saved, done.stderr[-3000:])
        if done.returncode != 0:
            assert "a checkpoint was lost; exiting with status 1" in done.stderr
            assert "Python was exiting and had stopped the writer's threads: call manager.close()" in done.stderr
    if disk == "fine":  # under the launcher the end of the script is seen while the writer runs: it finishes
        run_python(script, tmp_path / "l", disk, launch=("-n", "1"), timeout=PROCESS_TIMEOUT)
        assert len(list((tmp_path / "l" / "checkpoints").glob("step_*"))) == 1


READ_ONLY = """
    import os, subprocess, sys
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # the suite's, if set
    import jax, equinox as eqx, optax, redeqx
    mesh = redeqx.make_mesh(2)
    model = eqx.nn.MLP(64, 64, 256, depth=3, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.adam(1e-3), mesh, specs, key=jax.random.key(1))
    manager = redeqx.CheckpointManager(sys.argv[1], keep_last=1)
    manager.save(state, force=True)
    manager.wait()
    subprocess.run(["mount", "-o", "remount,ro", sys.argv[1]], check=True)
    manager.save(eqx.tree_at(lambda s: s.step, state, state.step + 1), force=True)
"""


def test_a_read_only_workdir_fails_the_save_at_once_and_the_process_exits(tmp_path):
    """Before: the async save returned, its failure was a warning at exit, and
    orbax's writer threads kept the process alive 300 s waiting for a
    directory that never appeared. Needs a tmpfs (root); skipped elsewhere."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        script = tmp_path / "script.py"
        script.write_text(textwrap.dedent(READ_ONLY))
        start = time.monotonic()
        done = run_python(script, mount, timeout=PROCESS_TIMEOUT, check=False)
        elapsed = time.monotonic() - start
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
    assert done.returncode == 1 and elapsed < 60, (done.returncode, elapsed, done.stderr[-3000:])
    assert "step_000000001: the file system is read-only (EROFS" in done.stderr, done.stderr[-3000:]


HANG = """
    import sys, time
    import jax, jax.numpy as jnp, numpy as np, equinox as eqx, optax
    import redeqx
    redeqx.initialize()
    mesh = redeqx.make_mesh(2)
    model = eqx.nn.MLP(8, 4, 16, depth=2, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.adam(1e-3), mesh, specs, key=jax.random.key(1))
    train_step = redeqx.make_train_step(lambda m, b, k: jnp.mean(jax.vmap(m)(b["x"]) ** 2), optax.adam(1e-3), mesh,
                                        specs)
    batch = {"x": np.ones((8, 8), np.float32)}

    def step(state, batch):  # process 1 stops inside step 7: the other waits for it in the step's collectives
        if int(state.step) == 6 and jax.process_index() == 1:
            print(f"hang at {time.time()}", flush=True)
            time.sleep(600)
        return train_step(state, batch)

    with redeqx.CheckpointManager(sys.argv[1], keep_last=1) as manager, \\
            redeqx.StepWatchdog(factor=5, min_seconds=3) as watchdog:
        for _ in range(100):
            state, _ = step(state, batch)
            manager.save(state)
            watchdog.beat(int(state.step))
            time.sleep(0.05)
"""


def test_a_step_that_hangs_on_one_process_ends_the_job_with_every_stack_and_the_step(tmp_path):
    """Before: nothing noticed; both processes waited forever (the heartbeat
    sees them alive). With a StepWatchdog both print their stacks within
    seconds of the limit, naming the step, and the job exits non-zero; the
    last checkpoint is intact."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(HANG))
    done = run_python(script, tmp_path / "run", launch=("-n", "2", "--devices", "8"), timeout=PROCESS_TIMEOUT,
                      check=False)
    ended = time.time()
    out = done.stdout + done.stderr
    hung_at = float(re.search(r"hang at ([\d.]+)", out).group(1))
    print(f"hang to launcher exit: {ended - hung_at:.1f} s")
    assert done.returncode == 124, (done.returncode, out[-3000:])
    for i in (0, 1):
        assert f"StepWatchdog: process {i}: the step after step 6 has run" in out, out[-4000:]
    assert re.search(r'File ".*script\.py", line \d+ in step', out), out[-4000:]  # where process 1 stopped
    assert ended - hung_at < 30, ended - hung_at
    latest = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert latest[-1].name == "step_000000006", latest  # (step 5 is pruned by the next save, which never came)
    assert redeqx_metadata_step(latest[-1]) == 6


def redeqx_metadata_step(path):
    import json
    return json.loads((path / "metadata" / "metadata").read_text())["step"]
