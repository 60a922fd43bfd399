"""Run a script as N processes on this machine, as it would run on N hosts.

    python -m redeqx.launch -n 2 train.py --lr 1e-3

starts ``train.py --lr 1e-3`` twice, as processes 0 and 1 of one JAX run:
process 0 listens on 127.0.0.1 at a free port, the simulated CPU devices
(``--devices``, 8 by default) are split evenly between the processes, and
their collectives go through gloo. Each process joins the run
(`redeqx.initialize`) before the script starts, so a script needs no change;
a ``redeqx.initialize()`` call in it is then a no-op.

Ctrl-C and SIGTERM reach every process. If one process fails or dies, the
launcher stops the others and exits with that process's exit status.
It is for trying multi-host code on one machine and for tests; on a real
cluster start one process per host (or per GPU) with SLURM, mpirun or by
hand, and call `redeqx.initialize` in the script.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time

from ._distributed import ENV

GRACE_SECONDS = 5.0  # after a signal or a failure, before SIGKILL
DEFAULT_HEARTBEAT_TIMEOUT = 10  # the processes are all here: a dead one is noticed fast


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


def _child() -> None:
    """Runs in each launched process: join the run, then run the script as
    ``__main__`` with its own argv, as ``python script.py args`` would."""
    script, *args = sys.argv[1:]
    from ._distributed import launcher_start

    launcher_start()
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code in (None, 0):
            raise
        # A failing exit: leave now rather than wait in JAX's shutdown barrier
        # for processes that are busy or blocked on this one.
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)


def _describe_exit(rc: int) -> str:
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


def _stop(procs: list[subprocess.Popen], sig: int = signal.SIGINT) -> None:
    """``sig`` to every live process, then SIGKILL to those still alive after
    a grace period. SIGINT rather than SIGTERM: JAX takes SIGTERM as a
    preemption notice and keeps running; SIGINT raises KeyboardInterrupt,
    so ``finally`` blocks run."""
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
        "--heartbeat-timeout",
        type=int,
        default=DEFAULT_HEARTBEAT_TIMEOUT,
        help=f"seconds before a silent process counts as dead (default {DEFAULT_HEARTBEAT_TIMEOUT})",
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
    if ns.heartbeat_timeout < 1:
        parser.error(f"--heartbeat-timeout must be >= 1 second, got {ns.heartbeat_timeout}.")
    if not os.path.isfile(ns.script):
        parser.error(f"script {ns.script!r} does not exist.")
    return ns


def main(argv: list[str] | None = None) -> int:
    """``python -m redeqx.launch -n N script.py [args]``; returns the exit status."""
    ns = _parse(argv)
    port = ns.port or free_port()
    per = ns.devices // ns.n_processes
    procs: list[subprocess.Popen] = []
    for i in range(ns.n_processes):
        env = child_env(i, ns.n_processes, port, per, heartbeat_timeout=ns.heartbeat_timeout)
        cmd = [sys.executable, "-c", "from redeqx.launch import _child; _child()", ns.script, *ns.args]
        # Own process group: a Ctrl-C reaches each process once, through the launcher.
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))

    received: list[int] = []
    received_at: list[float] = []

    def forward(sig, frame):
        if received:  # a second signal: no more waiting
            for p in procs:
                _signal_group(p, signal.SIGKILL)
        received.append(sig)
        received_at.append(time.monotonic())
        for p in procs:
            if p.poll() is None:
                _signal_group(p, sig)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in handled}
    status = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)]
            if failed and not received:
                i, rc = failed[0]
                alive = sum(rc is None for rc in codes)
                stopping = f"; stopping the other {alive} process(es)" if alive else ""
                print(
                    f"redeqx.launch: process {i} (pid {procs[i].pid}) {_describe_exit(rc)}{stopping}.",
                    file=sys.stderr,
                    flush=True,
                )
                _stop(procs)
                status = 128 - rc if rc < 0 else rc
                break
            if received and time.monotonic() - received_at[0] > GRACE_SECONDS:
                # JAX takes SIGTERM as a preemption notice and keeps running
                # (see jax.experimental.multihost_utils.reached_preemption_sync_point);
                # after the grace period, stop for good.
                for p in procs:
                    if p.poll() is None:
                        _signal_group(p, signal.SIGKILL)
            if all(rc is not None for rc in codes):
                if received:
                    status = 128 + received[0]
                break
            time.sleep(0.1)
    finally:
        _stop(procs)
        for s, h in previous.items():
            signal.signal(s, h)
    return status


if __name__ == "__main__":
    sys.exit(main())
