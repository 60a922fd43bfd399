"""Run a script as N processes on this machine, as it would run on N hosts.

    python -m redeqx.launch -n 2 train.py --lr 1e-3

starts ``train.py --lr 1e-3`` twice, as processes 0 and 1 of one JAX run:
process 0 listens on 127.0.0.1 at a free port, the simulated CPU devices
(``--devices``, 8 by default) are split evenly between the processes, and
their collectives go through gloo. Each process joins the run
(`redeqx.initialize`) before the script starts, so a script needs no change;
a ``redeqx.initialize()`` call in it is then a no-op.

Ctrl-C and SIGTERM reach every process. SIGTERM is a preemption notice:
a script that calls `CheckpointManager.save` every step saves and exits with
status 143 (`redeqx.Preempted`); processes still running ``--grace`` seconds
(default 20) after the signal are killed. A second SIGTERM while they save
(a scheduler that signals twice) changes nothing; a second Ctrl-C kills them
at once. The launcher exits with 143 only when a checkpoint was saved;
otherwise it says that nothing was saved and exits with another status
(137 when it had to kill, 130 after Ctrl-C). If one process fails or dies, the
launcher stops the others (within a few seconds) and exits with that
process's exit status; if the launcher itself is killed (a scheduler's
SIGKILL, the OOM killer), its processes are killed with it, never left
training unsupervised, and so is what they started (Grain's worker processes,
a data loader's pool: each process's whole process group); if one process ends its script while the others still
run ``--exit-timeout`` seconds later (default 60; a ``sys.exit`` taken by one
process only leaves the others waiting for it in a collective forever), it
stops them all and exits with status 1, naming which ended and which did not.
A process that has not run its first redeqx step ``--startup-timeout``
seconds after the start (default 1800; stuck joining, compiling, restoring
or in the script's own start) stops the run with status 124, naming the
process and what it was doing.
It is for trying multi-host code on one machine and for tests; on a real
cluster start one process per host (or per GPU) with SLURM, mpirun or by
hand, and call `redeqx.initialize` in the script.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .run import ENV
from ._hooks import StoppedByLauncher, stop_on_launcher_signal
from . import _startup
from ._startup import DOING, ENDED, LAUNCH_DIR, STEPPED
from .checkpoints import PREEMPTED_EXIT_CODE

GRACE_SECONDS = 5.0  # after a failure or a Ctrl-C, before SIGKILL
DEFAULT_PREEMPTION_GRACE = 20  # after a forwarded SIGTERM: time to save a checkpoint and exit
DEFAULT_EXIT_TIMEOUT = 60  # one process done, the others not: how long until that is a failure
DEFAULT_HEARTBEAT_TIMEOUT = 10  # the processes are all here: a dead one is noticed fast
DEFAULT_STARTUP_TIMEOUT = 1800  # how long a process may take to reach its first step (0: no limit)
STARTUP_EXIT_CODE = 124  # a process never reached its first step: what `timeout` returns
LAUNCHER_PID = "REDEQX_LAUNCHER_PID"  # the launcher's pid: a launched process dies with it
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_SIGNAL = signal.SIGUSR1  # "another process failed": stop quietly


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(
    process_id: int,
    n_processes: int,
    port: int,
    devices_per_process: int,
    *,
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one launched process: the ``REDEQX_*`` settings of
    `redeqx.initialize`, CPU devices simulated by XLA, gloo collectives.

    **Example:**

    ```python
    env = child_env(1, 2, free_port(), 4)   # process 1 of 2, 4 CPU devices each
    subprocess.Popen([sys.executable, "worker.py"], env=env)
    ```
    """
    env = dict(os.environ if base is None else base)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={devices_per_process}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    env[ENV["host0_address"]] = "127.0.0.1"
    env[ENV["host0_port"]] = str(port)
    env[ENV["n_processes"]] = str(n_processes)
    env[ENV["process_id"]] = str(process_id)
    env[ENV["heartbeat_timeout"]] = str(heartbeat_timeout)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _leave(code: int) -> None:
    """Exit now rather than wait in JAX's shutdown barrier for processes that
    are busy or blocked on this one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _script_ended() -> None:
    """The script returned: finish any checkpoint still being written (the
    writer's threads still run here, unlike at interpreter exit), then tell
    the launcher this process is done."""
    from .checkpoints import finish_in_flight

    failures = finish_in_flight("at the end of the script, without close()")
    for line in failures:
        print(line, file=sys.stderr)
    _startup.ended()
    if failures:
        _leave(1)


def _die_with_launcher() -> None:
    """End this process when the launcher ends, however it ends: on Linux
    the kernel sends SIGKILL when the parent dies (``prctl(PR_SET_PDEATHSIG)``,
    even while Python is busy in a collective); elsewhere a daemon thread
    sees the parent change. A launcher already gone ends it now."""
    launcher = int(os.environ.get(LAUNCHER_PID, os.getppid()))
    watched = False
    if sys.platform.startswith("linux"):
        watched = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if os.getppid() != launcher:  # it died before the kernel was told to watch it
        os.kill(os.getpid(), signal.SIGKILL)
    if not watched:
        def watch():
            while os.getppid() == launcher:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="redeqx-launcher-watch", daemon=True).start()


def _child() -> None:
    """Runs in each launched process: join the run, then run the script as
    ``__main__`` with its own argv, as ``python script.py args`` would."""
    _die_with_launcher()
    script, *args = sys.argv[1:]
    from .run import launcher_start

    launcher_start()
    _startup.doing("running the script, before its first redeqx step (building the model, reading data, ...)")
    stop_on_launcher_signal(STOP_SIGNAL)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            _leave(e.code if isinstance(e.code, int) else 1)
    except StoppedByLauncher:  # the launcher already said why
        _leave(128 + STOP_SIGNAL)
    _script_ended()


def _describe_exit(rc: int) -> str:
    if rc == PREEMPTED_EXIT_CODE:
        return f"was preempted: it saved a checkpoint and exited with status {rc}"
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: list[subprocess.Popen], sig: int = STOP_SIGNAL) -> None:
    """``sig`` to every live process, then SIGKILL to those still alive after
    a grace period. Not SIGTERM: JAX takes it as a preemption notice and keeps
    running; `STOP_SIGNAL` ends a launched process quietly (``finally``
    blocks run), leaving the failing process's traceback the only one."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, sig)
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m redeqx.launch",
        description="Run SCRIPT as N processes of one JAX run on this machine (CPU devices, gloo collectives).",
    )
    parser.add_argument("-n", "--n-processes", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices", type=int, default=8, help="simulated CPU devices in all, split evenly between processes (default 8)"
    )
    parser.add_argument("--port", type=int, default=None, help="port for process 0 on 127.0.0.1 (default: a free one)")
    parser.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_PREEMPTION_GRACE,
        help=f"seconds after a SIGTERM for the processes to save and exit before SIGKILL (default "
        f"{DEFAULT_PREEMPTION_GRACE})",
    )
    parser.add_argument(
        "--exit-timeout",
        type=float,
        default=DEFAULT_EXIT_TIMEOUT,
        help=f"seconds one process may have ended its script while others still run (default {DEFAULT_EXIT_TIMEOUT})",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=DEFAULT_HEARTBEAT_TIMEOUT,
        help=f"seconds before a silent process counts as dead (default {DEFAULT_HEARTBEAT_TIMEOUT})",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT,
        help=f"seconds each process may take to run its first redeqx step (joining, building, compiling, "
        f"restoring); past it the run is stopped, naming the process and what it was doing (default "
        f"{DEFAULT_STARTUP_TIMEOUT}; 0: no limit)",
    )
    parser.add_argument("script", help="the Python script every process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.n_processes < 1:
        parser.error(f"-n must be >= 1, got {ns.n_processes}.")
    if ns.devices < 1 or ns.devices % ns.n_processes:
        parser.error(
            f"--devices={ns.devices} cannot be split evenly over -n {ns.n_processes} processes; "
            f"use a multiple of {ns.n_processes}, e.g. --devices {ns.n_processes * max(1, ns.devices // ns.n_processes)}."
        )
    for name in ("grace", "exit_timeout"):
        if getattr(ns, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(ns, name)}.")
    if ns.startup_timeout < 0:
        parser.error(f"--startup-timeout must be >= 0 seconds (0: no limit), got {ns.startup_timeout}.")
    if ns.heartbeat_timeout < 1:
        parser.error(f"--heartbeat-timeout must be >= 1 second, got {ns.heartbeat_timeout}.")
    if not os.path.isfile(ns.script):
        parser.error(f"script {ns.script!r} does not exist.")
    return ns


def _final_status(codes: list[int], received: list[int], preempted: bool, failed: list) -> int:
    """The launcher's exit status once every process has ended. 143 means
    "a preemption checkpoint was saved" (a process exits with it only after
    the save every process agreed on is complete), so it is returned only
    when some process did; a signal that ended the run without one gives
    128 + SIGKILL when the launcher had to kill, 128 + SIGINT after Ctrl-C."""
    if preempted or PREEMPTED_EXIT_CODE in codes:
        return PREEMPTED_EXIT_CODE
    if received:
        if received[0] == signal.SIGINT:
            return 128 + signal.SIGINT
        if any(rc == -signal.SIGKILL for rc in codes):
            return 128 + signal.SIGKILL
        bad = [rc for rc in codes if rc != 0]
        if not bad:
            return 0  # every script finished before it had to stop
        return bad[0] if bad[0] > 0 else 1
    if failed:
        return 128 - failed[0][1] if failed[0][1] < 0 else failed[0][1]
    return 0


def _names(indices) -> str:
    indices = list(indices)
    return ("process " if len(indices) == 1 else "processes ") + ", ".join(map(str, indices))


def _spawn(ns: argparse.Namespace, port: int, marks: Path) -> list[subprocess.Popen]:
    """Starts the ``ns.n_processes`` processes of the script."""
    procs, per = [], ns.devices // ns.n_processes
    for i in range(ns.n_processes):
        env = child_env(i, ns.n_processes, port, per, heartbeat_timeout=ns.heartbeat_timeout)
        env[LAUNCH_DIR] = str(marks)
        env[LAUNCHER_PID] = str(os.getpid())
        cmd = [sys.executable, "-c", "from redeqx.launch import _child; _child()", ns.script, *ns.args]
        # Own process group: a Ctrl-C reaches each process once, through the launcher.
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    return procs


# The reaper: a small process of the launcher's that outlives it by a moment, to SIGKILL each launched
# process's whole group (what the script started too: Grain's worker processes, a data loader's pool)
# when the launcher ends, however it ends. The launched processes themselves die with the launcher
# (PR_SET_PDEATHSIG), but the kernel does not reach their children. SIGUSR2 (from the kernel when the
# launcher dies, or from the launcher at its end) reaps; a SIGTERM or Ctrl-C sent to the terminal's or
# the job's process group is the launcher's to handle, and ignored here.
_REAPER = """
import ctypes, os, signal, sys, time
groups = [int(g) for g in sys.argv[2:]]
def reap(*_):
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
signal.signal(signal.SIGUSR2, reap)
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, signal.SIGUSR2, 0, 0, 0)
launcher = int(sys.argv[1])
while os.getppid() == launcher:
    time.sleep(0.5)
reap()
"""


def _start_reaper(procs: list[subprocess.Popen]) -> subprocess.Popen:
    """The reaper of ``procs``' process groups (each launched process leads its own)."""
    return subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), *(str(p.pid) for p in procs)])


def _say(text: str) -> None:
    print(f"redeqx.launch: {text}", file=sys.stderr, flush=True)


class _Run:
    """The launched processes, and what the launcher has seen of them so far:
    the signals it forwarded, the processes that exited preempted, the first
    process to end its script, and why it SIGKILLed them, if it did."""

    def __init__(self, ns: argparse.Namespace, marks: Path, procs: list[subprocess.Popen]):
        self.ns, self.marks, self.procs = ns, marks, procs
        self.received: list[int] = []
        self.received_at: list[float] = []
        self.killed: list[str] = []
        self.preempted: dict[int, float] = {}  # process -> when it exited with the preemption status
        self.first_end: float | None = None
        self.started = time.monotonic()

    def kill_all(self, why: str) -> None:
        self.killed.append(why)
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)

    def forward(self, sig, frame) -> None:
        if self.received:
            if sig == signal.SIGINT:  # Ctrl-C again: the person at the keyboard wants out now
                self.kill_all("a second Ctrl-C")
            # a repeated SIGTERM (a scheduler that signals twice, or every process of a job) is the
            # same notice: the checkpoint it asked for is being written, so keep waiting for it
            return
        self.received.append(sig)
        self.received_at.append(time.monotonic())
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p, sig)

    def poll(self) -> int | None:
        """The launcher's exit status once the run is over, else None."""
        codes = [p.poll() for p in self.procs]
        now = time.monotonic()
        failed = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0, PREEMPTED_EXIT_CODE)]
        if failed and not self.received and not self.preempted:
            return self._one_failed(codes, *failed[0])
        for i, rc in enumerate(codes):
            if rc == PREEMPTED_EXIT_CODE and i not in self.preempted:
                self.preempted[i] = now
                _say(f"process {i} {_describe_exit(rc)}.")
        if self._ended_alone(codes, now):
            _stop(self.procs)
            return 1
        if self._never_stepped(codes, now):
            _stop(self.procs)
            return STARTUP_EXIT_CODE
        self._kill_after_grace(codes, now)
        if all(rc is not None for rc in codes):
            return self._all_ended(codes, failed)
        return None

    def _one_failed(self, codes, i: int, rc: int) -> int:
        alive = sum(rc is None for rc in codes)
        stopping = f"; stopping the other {alive} process(es)" if alive else ""
        _say(f"process {i} (pid {self.procs[i].pid}) {_describe_exit(rc)}{stopping}.")
        _stop(self.procs)
        return 128 - rc if rc < 0 else rc

    def _ended_alone(self, codes, now: float) -> bool:
        """Whether some processes ended the script and others still run ``--exit-timeout`` later."""
        ended = sorted(i for i, rc in enumerate(codes) if rc == 0 or (self.marks / f"{ENDED}_{i}").exists())
        running = [i for i, rc in enumerate(codes) if rc is None and i not in ended]
        if not (ended and running and not self.received and not self.preempted):
            return False
        self.first_end = self.first_end if self.first_end is not None else now
        if now - self.first_end <= self.ns.exit_timeout:
            return False
        _say(f"{_names(ended)} ended the script, and {_names(running)} still ran {self.ns.exit_timeout:g} s "
             "later: a process that ends early (sys.exit, return or break taken by one process only) "
             "leaves the others waiting for it in a collective forever. Stopping them all "
             "(--exit-timeout sets the wait).")
        return True

    def _never_stepped(self, codes, now: float) -> bool:
        """Whether a process still runs ``--startup-timeout`` after the start without having run its
        first step (a hang in joining, compiling, restoring or the script's own start), said with
        what each such process was last doing."""
        limit = self.ns.startup_timeout
        if not limit or now - self.started <= limit or self.received:
            return False
        late = [i for i, rc in enumerate(codes) if rc is None and not (self.marks / f"{STEPPED}_{i}").exists()
                and not (self.marks / f"{ENDED}_{i}").exists()]
        if not late:
            return False
        for i in late:
            try:
                what = (self.marks / f"{DOING}_{i}").read_text()
            except OSError:
                what = "starting Python and importing redeqx"
            _say(f"process {i} (pid {self.procs[i].pid}) has not run its first step {limit:g} s after the start; "
                 f"it was {what}.")
        _say(f"stopping every process (exit status {STARTUP_EXIT_CODE}). A hang before the first step is often a "
             "process waiting in a collective the others never join (each process must make the same meshes and "
             "steps, in the same order); if the start is just slow, raise --startup-timeout.")
        return True

    def _kill_after_grace(self, codes, now: float) -> None:
        since = self.received_at[0] if self.received else min(self.preempted.values(), default=None)
        grace = GRACE_SECONDS if self.received and self.received[0] == signal.SIGINT else self.ns.grace
        if since is not None and now - since > grace and any(rc is None for rc in codes):
            # JAX takes SIGTERM as a preemption notice and keeps running
            # (jax.experimental.multihost_utils.reached_preemption_sync_point):
            # after the grace period, stop for good, as a scheduler would.
            late = [i for i, rc in enumerate(codes) if rc is None]
            what = "signal" if self.received else "preemption"
            _say(f"{_names(late)} still ran {grace:g} s after the {what}; killing them.")
            self.kill_all(f"the end of the {grace:g} s grace period")

    def _all_ended(self, codes, failed) -> int:
        status = _final_status(codes, self.received, bool(self.preempted), failed)
        if self.received and self.received[0] == signal.SIGTERM and status != PREEMPTED_EXIT_CODE:
            why = f" (killed at {self.killed[0]})" if self.killed else ""
            _say(f"no process saved a checkpoint after the SIGTERM{why}: nothing was saved for this "
                 f"preemption; exiting with status {status}, not {PREEMPTED_EXIT_CODE}. A restart resumes "
                 "from the last complete checkpoint (an unfinished save is never picked).")
        elif self.killed and status != PREEMPTED_EXIT_CODE:
            _say(f"killed every process at {self.killed[0]}: nothing was saved; exiting with status {status}.")
        return status


def main(argv: list[str] | None = None) -> int:
    """``python -m redeqx.launch -n N script.py [args]``; returns the exit status."""
    ns = _parse(argv)
    marks = Path(tempfile.mkdtemp(prefix="redeqx-launch-"))
    run = _Run(ns, marks, _spawn(ns, ns.port or free_port(), marks))
    reaper = _start_reaper(run.procs)
    previous = {s: signal.signal(s, run.forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while (status := run.poll()) is None:
            time.sleep(0.1)
    finally:
        _stop(run.procs)
        reaper.send_signal(signal.SIGUSR2)  # what the processes started and left behind goes too
        reaper.wait()
        for s, h in previous.items():
            signal.signal(s, h)
        shutil.rmtree(marks, ignore_errors=True)
    return status

if __name__ == "__main__":
    sys.exit(main())
