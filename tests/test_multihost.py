"""Several real OS processes on 127.0.0.1 (4 simulated CPU devices each),
checked against this pytest process's single-process run on 8 devices."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import equinox as eqx
import jax
import numpy as np
import pytest

import checkpoint_damage_worker
import multihost_worker
import redeqx
from _helpers import COLLECTIVES, DAMAGES, run_python
from redeqx import launch
from redeqx.run import _distributed, _settings

HERE = os.path.dirname(os.path.abspath(__file__))
PROCESS_TIMEOUT = 240  # a generous cap so a bug fails the test instead of hanging it


def run_launcher(*args, timeout=PROCESS_TIMEOUT):
    return run_python("-m", "redeqx.launch", *args, timeout=timeout, check=False)


def write_script(tmp_path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def wait_for_files(paths, procs, timeout=120):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a process exited early with status {p.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"processes did not get ready in {timeout}s")
        time.sleep(0.1)


# --- 2 processes x 4 devices compute what 1 process x 8 devices computes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-process run of `multihost_worker` and the same computation in this
    process, each saving a checkpoint the other restores."""
    assert len(jax.devices()) == 8 and jax.process_count() == 1
    tmp = tmp_path_factory.mktemp("multihost")
    reference, state = multihost_worker.run(save_to=tmp / "saved_by_1")
    params = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))]
    key_data = np.asarray(jax.random.key_data(state.key))
    mesh, model, specs, optimizer = multihost_worker.setup()
    reference["continued_losses"] = multihost_worker.continue_from(tmp / "saved_by_1", mesh, model, specs, optimizer)[1]
    done = run_launcher("-n", 2, "--devices", 8, os.path.join(HERE, "multihost_worker.py"), tmp, tmp / "saved_by_2",
                        tmp / "saved_by_1")
    assert done.returncode == 0, done.stderr[-3000:]
    got = [json.loads((tmp / f"process_{i}.json").read_text()) for i in range(2)]
    return dict(reference=reference, got=got, params=params, key_data=key_data, tmp=tmp)


@pytest.mark.slow
@pytest.mark.xdist_group("multihost_runs")  # the module's runs fixture, made once
def test_two_processes_train_predict_and_evaluate_like_one(runs):
    reference = runs["reference"]
    assert reference["n_processes"] == 1 and reference["n_devices"] == 8
    for got in runs["got"]:
        assert got["n_processes"] == 2 and got["n_devices"] == 8
        assert len(got["losses"]) == multihost_worker.N_STEPS
        np.testing.assert_allclose(got["losses"], reference["losses"], rtol=1e-5)
        # 13 examples, global batch 8: every output once, in order, on every process
        assert len(got["preds"]) == 13
        np.testing.assert_allclose(got["preds"], reference["preds"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["eval_loss"], reference["eval_loss"], rtol=1e-5)
        # the script's own initialize() was a no-op; different settings were refused
        assert "already started" in got["second_call"]
        # each process's NumPy rows are its share of the batch, not the whole of it
        np.testing.assert_allclose(got["local_rows_preds"], reference["local_rows_preds"], rtol=1e-5, atol=1e-6)
        assert "NumPy array" in got["make_step_numpy"] and "make_array_from_process_local_data" in got["make_step_numpy"]
    assert reference["make_step_numpy"] == "no error"  # one process: the array is the value


@pytest.mark.slow
@pytest.mark.xdist_group("multihost_runs")  # the module's runs fixture, made once
def test_checkpoints_move_between_process_counts(runs):
    # saved by 1 process, restored by 2: training goes on as in the 1-process run
    for got in runs["got"]:
        np.testing.assert_allclose(got["continued_losses"], runs["reference"]["continued_losses"], rtol=1e-5)
    # saved by 2 processes, restored by 1: the same parameters, step and key
    mesh, model, specs, optimizer = multihost_worker.setup()
    like = eqx.filter_eval_shape(redeqx.init_state, model, optimizer, mesh, specs, key=jax.random.key(1))
    state = redeqx.restore_checkpoint(runs["tmp"] / "saved_by_2", like, mesh, specs)
    restored = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))]
    for a, b in zip(restored, runs["params"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert int(state.step) == multihost_worker.N_STEPS
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(state.key)), runs["key_data"])


@pytest.mark.slow
def test_damage_is_caught_by_two_processes_on_every_layout(tmp_path):
    """Before: restored by 2 processes on a layout other than the saving
    one, a piece spread over processes was left to the sum of words, so
    swapped pieces, swapped values and paired sign flips restored as
    values, and the manager returned that step. Checkpoints saved by 1
    process (here) and by 2 (the worker), restored by 2 onto a data,
    model, fsdp and context split."""
    by_1 = tmp_path / "by_1"
    checkpoint_damage_worker.save_set(by_1)
    model, _ = checkpoint_damage_worker.saved_model(redeqx.make_mesh(2))
    with redeqx.CheckpointManager(by_1 / "run", keep_last=2, async_save=False) as manager:
        manager.save(model, step=1)
        manager.save(model, step=2)
    shutil.rmtree(manager.path(2) / "model")
    shutil.copytree(by_1 / "values swapped" / "model", manager.path(2) / "model")
    done = run_launcher("-n", 2, "--devices", 8, os.path.join(HERE, "checkpoint_damage_worker.py"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for i in range(2):
        got = json.loads((tmp_path / f"process_{i}.json").read_text())
        wrong = {}
        for layout in checkpoint_damage_worker.LAYOUTS:
            for source in ("by_1", "by_2"):
                for case in ("intact", *DAMAGES):
                    name = f"{source}/{case}@{layout}"
                    if got[name] != ("restored" if case == "intact" else "CheckpointError"):
                        wrong[name] = got[name]
            found = got[f"manager@{layout}"]
            if found["step"] != 1 or not any("skipping" in w and "step_000000002" in w for w in found["warned"]):
                wrong[f"manager@{layout}"] = found
        assert not wrong, f"process {i}: {wrong}"


# --- failures end the run, fast and loudly

RUN_UNTIL_KILLED = """
    import os, sys, time
""" + COLLECTIVES + """
    total(x).block_until_ready()
    open(os.path.join(sys.argv[1], f"ready_{jax.process_index()}"), "w").write(str(os.getpid()))
    while True:  # a training loop: collectives with host work in between
        total(x).block_until_ready()
        time.sleep(0.1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_process_stops_the_other_naming_it(tmp_path, victim):
    """No launcher here: JAX's coordination service alone must notice the
    lost peer (within the heartbeat timeout) and stop the survivor."""
    script = write_script(tmp_path, RUN_UNTIL_KILLED)
    port = launch.free_port()
    procs, logs = [], []
    for i in range(2):
        env = launch.child_env(i, 2, port, 4, heartbeat_timeout=5)
        log = open(tmp_path / f"stderr_{i}.txt", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, script, str(tmp_path)], env=env, stdout=log, stderr=log))
    try:
        wait_for_files([tmp_path / "ready_0", tmp_path / "ready_1"], procs)
        procs[victim].kill()
        start = time.monotonic()
        survivor = procs[1 - victim]
        rc = survivor.wait(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    message = (tmp_path / f"stderr_{1 - victim}.txt").read_text()
    assert rc != 0
    assert elapsed < 30, f"the survivor took {elapsed:.0f}s to stop"
    if victim == 1:  # the coordination service (in process 0) names the silent task
        assert "stopped sending heartbeats" in message and "\n1\n" in message, message[-2000:]
    else:  # process 0 hosts the coordination service: the survivor reports losing it
        assert "leader task" in message or "coordination service" in message, message[-2000:]


@pytest.mark.slow
def test_launcher_stops_the_others_when_one_fails(tmp_path):
    script = write_script(
        tmp_path,
        """
        import time, jax, redeqx
        redeqx.initialize()
        if jax.process_index() == 1:
            raise RuntimeError("boom in process 1")
        time.sleep(600)
        """,
    )
    start = time.monotonic()
    done = run_launcher("-n", 2, "--devices", 2, script)
    assert done.returncode == 1
    assert time.monotonic() - start < 60
    assert "boom in process 1" in done.stderr
    assert "process 1" in done.stderr and "stopping the other 1 process" in done.stderr


@pytest.mark.slow
def test_launcher_forwards_sigterm(tmp_path):
    script = write_script(
        tmp_path,
        """
        import os, sys, time, jax, redeqx
        redeqx.initialize()
        open(os.path.join(sys.argv[1], f"ready_{jax.process_index()}"), "w").write(str(os.getpid()))
        time.sleep(600)
        """,
    )
    proc = subprocess.Popen([sys.executable, "-m", "redeqx.launch", "-n", "2", "--devices", "2", "--grace", "2", script,
                             str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_files([tmp_path / "ready_0", tmp_path / "ready_1"], [proc])
        pids = [int((tmp_path / f"ready_{i}").read_text()) for i in range(2)]
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the script saves nothing, so the processes are killed after --grace: not 143, which means "saved"
    assert rc == 128 + signal.SIGKILL
    assert "nothing was saved for this preemption" in proc.stderr.read()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_processes_die_with_a_killed_launcher(tmp_path):
    """Before: a SIGKILL to the launcher (a scheduler's hard kill, the OOM
    killer) left its processes training on, unsupervised."""
    script = write_script(
        tmp_path,
        """
        import os, subprocess, sys, time, jax, redeqx
        redeqx.initialize()
        child = subprocess.Popen(["sleep", "600"])  # what a script starts (Grain's workers) goes too
        open(os.path.join(sys.argv[1], f"ready_{jax.process_index()}"), "w").write(f"{os.getpid()} {child.pid}")
        time.sleep(600)
        """,
    )
    proc = subprocess.Popen([sys.executable, "-m", "redeqx.launch", "-n", "2", "--devices", "2", script,
                             str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = []
    try:
        wait_for_files([tmp_path / "ready_0", tmp_path / "ready_1"], [proc])
        pids = [int(pid) for i in range(2) for pid in (tmp_path / f"ready_{i}").read_text().split()]
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(map(running, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(running, pids)), "the launched processes (or their children) outlived their launcher"
    finally:
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_process_that_never_reaches_its_first_step_ends_the_run_naming_it(tmp_path):
    """Before: a process stuck before its first step (compile, data, restore) hung `launch -n 2` forever:
    the watchdog judges steps, and --exit-timeout starts only when a process ends."""
    script = write_script(
        tmp_path,
        """
        import time, jax, redeqx
        if jax.process_index() == 1:
            time.sleep(600)  # stuck before its first step
        mesh = redeqx.make_mesh(devices=jax.local_devices())
        step = redeqx.make_step(lambda state: (state + 1, None), mesh)
        step(jax.numpy.zeros(2))
        time.sleep(600)  # then waits, as in a collective with the stuck one
        """,
    )
    started = time.monotonic()
    done = run_launcher("-n", "2", "--devices", "2", "--startup-timeout", "10", script, timeout=120)
    assert done.returncode == launch.STARTUP_EXIT_CODE == 124, done.stderr[-2000:]
    assert time.monotonic() - started < 90
    assert "process 1 (pid" in done.stderr and "has not run its first step 10 s after the start" in done.stderr
    assert "running the script, before its first redeqx step" in done.stderr
    assert "process 0 (pid" not in done.stderr and "raise --startup-timeout" in done.stderr


@pytest.mark.slow
def test_preflight_names_the_process_that_differs(tmp_path):
    script = write_script(
        tmp_path,
        """
        import redeqx
        redeqx.initialize()
        print("preflight passed")
        """,
    )
    port = launch.free_port()
    procs = [
        subprocess.Popen([sys.executable, script], env=launch.child_env(i, 2, port, n, heartbeat_timeout=5),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i, n in enumerate([4, 3])
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode != 0
        assert "preflight passed" not in out
    assert "process 1 has 3" in outputs[0], outputs[0][-2000:]


# --- errors that need no second process


@pytest.fixture
def fresh_runtime_state(monkeypatch):
    monkeypatch.setattr(_distributed, "_started_by", None)
    monkeypatch.setattr(_distributed, "_started_with", None)
    for name in _settings.ENV.values():
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(host0_address="10.0.0.1", n_processes=0, process_id=0), "n_processes must be >= 1"),
        (dict(host0_address="10.0.0.1", n_processes=2, process_id=2), "process_id=2 is not below n_processes=2"),
        (dict(host0_address="10.0.0.1:x", n_processes=2, process_id=0), "port that is not a number"),
        (dict(host0_address="10.0.0.1:1234", host0_port=99, n_processes=2, process_id=0), "give the port once"),
        (dict(host0_address="10.0.0.1", host0_port=70000, n_processes=2, process_id=0), "1..65535"),
        (dict(host0_address="10.0.0.1", n_processes=2, process_id=0, timeout=0), "timeout must be >= 1"),
        (dict(host0_address="10.0.0.1", n_processes=2, process_id=0, local_device_ids="0,1"), "local_device_ids"),
    ],
)
def test_initialize_rejects_bad_settings(fresh_runtime_state, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        redeqx.initialize(**kwargs)


def test_initialize_rejects_bad_environment(fresh_runtime_state, monkeypatch):
    monkeypatch.setenv("REDEQX_N_PROCESSES", "two")
    with pytest.raises(ValueError, match="REDEQX_N_PROCESSES .* must be an integer, got 'two'"):
        redeqx.initialize()


def test_initialize_after_jax_started_says_to_call_it_first(fresh_runtime_state, devices):
    jax.devices()
    with pytest.raises(RuntimeError, match="must run before anything starts JAX"):
        redeqx.initialize("127.0.0.1", n_processes=2, process_id=0)


CLUSTER_MARKERS = ["JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri",
                   "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "CLOUD_TPU_TASK_ID"]


def test_without_settings_or_cluster_a_late_call_is_a_no_op(fresh_runtime_state, monkeypatch, devices):
    for name in CLUSTER_MARKERS:
        monkeypatch.delenv(name, raising=False)
    redeqx.initialize()
    assert jax.process_count() == 1


def test_on_a_cluster_a_late_call_is_an_error(fresh_runtime_state, monkeypatch, devices):
    for name in CLUSTER_MARKERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(RuntimeError, match="must run before anything starts JAX"):
        redeqx.initialize()


def test_an_unreachable_host0_fails_within_the_timeout(fresh_runtime_state):
    port = launch.free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"could not reach process 0 at 127.0.0.1:{port} within timeout=2s"):
        redeqx.initialize("127.0.0.1", port, n_processes=2, process_id=1, timeout=2)
    assert time.monotonic() - start < 10


def test_one_process_is_a_no_op_and_a_second_call_is_an_error(fresh_runtime_state):
    redeqx.initialize(n_processes=1)
    assert jax.process_count() == 1
    with pytest.raises(RuntimeError, match="already called"):
        redeqx.initialize(n_processes=1)


def test_launcher_rejects_an_uneven_device_split(tmp_path, capsys):
    script = write_script(tmp_path, "print('hi')\n")
    with pytest.raises(SystemExit):
        launch.main(["-n", "3", "--devices", "8", script])
    assert "--devices=8 cannot be split evenly over -n 3" in capsys.readouterr().err


ROLL_CALL = """
import sys, redeqx
redeqx.initialize("127.0.0.1", int(sys.argv[1]), n_processes=3, process_id=int(sys.argv[2]), timeout=4)
"""


@pytest.mark.slow
def test_a_process_that_never_comes_is_named_by_every_process_within_the_timeout(tmp_path):
    """Before: process 0 waited in JAX's runtime and aborted (status 134,
    "DEADLINE_EXCEEDED", a C++ stack) naming nobody; the default timeout was
    60 s, too short for a large job's cold start."""
    assert _settings.DEFAULT_TIMEOUT >= 1800
    script = tmp_path / "roll.py"
    script.write_text(ROLL_CALL)
    port = launch.free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(script), str(port), str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in (0, 1)]  # process 2 never starts
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    elapsed = time.monotonic() - start
    assert [p.returncode for p in procs] == [1, 1], outputs
    assert "process 0 waited 4s for process 2 (of 3), which never connected" in outputs[0], outputs[0][-2000:]
    assert "process 1 reached process 0, which waited 4s for process 2 (of 3)" in outputs[1], outputs[1][-2000:]
    assert elapsed < 60, elapsed
