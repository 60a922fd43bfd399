"""What the faults of issue 24 cost and how long each takes to end, with real
processes and signals on 8 simulated CPU devices:

    python -m benchmarks.faults              # writes its section of benchmarks/RESULTS.md (about 2 minutes)
    python -m benchmarks.faults --no-write   # prints only

SIGTERM to a run saving every step (one process, and two under
``python -m redeqx.launch``, also with a second signal 50 ms later); a
process raising, ending early or hanging under a `StepWatchdog` under the
launcher; a read-only workdir under an async save (where this process may
mount a tmpfs); and `Logger.log`'s divergence check against its step time.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from benchmarks._common import ROOT, parser, report, worker_env

WORKER = ROOT / "tests" / "resume_worker.py"


def preemption(n_processes: int, signal_at: int = 4, second: int | None = None) -> dict:
    """Runs tests/resume_worker.py (every=1000, 0.3 s after each step) and
    SIGTERMs it after step ``signal_at`` (then sends ``second`` 50 ms later,
    if given); seconds from the first signal to exit."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(WORKER), tmp, "1000", "0.3"]
        cmd = [sys.executable, "-m", "redeqx.launch", "-n", str(n_processes), *cmd] if n_processes > 1 else \
            [sys.executable, *cmd]
        proc = subprocess.Popen(cmd, env=worker_env(8), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sent = None
        for line in proc.stdout:
            if sent is None and re.search(rf"step {signal_at}$", line.strip()):
                proc.send_signal(signal.SIGTERM)
                sent = time.perf_counter()
                if second is not None:
                    time.sleep(0.05)
                    proc.send_signal(second)
        rc = proc.wait()
        elapsed = time.perf_counter() - sent
        saved = sorted(int(p.name.split("_")[1]) for p in (Path(tmp) / "checkpoints").glob("step_*"))
        left = [p.name for p in (Path(tmp) / "checkpoints").iterdir() if not re.match(r"^step_\d+$", p.name)]
        said = "nothing was saved" in proc.stderr.read()
    return {"exit status": rc, "signal after step": signal_at, "saved step": saved, "seconds to exit": elapsed,
            "left": left, "said nothing saved": said}


def launcher_fault(action: str, *extra: str, watchdog: bool = False, at: int = 3) -> dict:
    """Process 1 of 2 runs ``action`` at step ``at`` of a collective loop; seconds
    from then until the launcher exits, and its status. ``watchdog``: the
    loop runs under a `StepWatchdog(factor=5, min_seconds=3)`."""
    start = "redeqx.StepWatchdog(factor=5, min_seconds=3).start()" if watchdog else "None"
    body = textwrap.dedent(f"""
        import sys, time
        import jax, jax.numpy as jnp, numpy as np
        import redeqx
        redeqx.initialize()
        mesh = redeqx.make_mesh()
        x = jax.make_array_from_callback((8,), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
                                         lambda idx: np.ones(8, np.float32)[idx])
        total = jax.jit(jnp.sum)
        watchdog = {start}
        for step in range(10**6):
            total(x).block_until_ready()
            if step == {at} and jax.process_index() == 1:
                print(f"FAULT AT {{time.time()}}", flush=True)
                {action}
            time.sleep(0.05)
            if watchdog is not None:
                watchdog.beat(step)
    """)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "script.py"
        script.write_text(body)
        done = subprocess.run([sys.executable, "-m", "redeqx.launch", "-n", "2", *extra, str(script)],
                              capture_output=True, text=True, env=worker_env(8))
        end = time.time()
    at = float(re.search(r"FAULT AT ([0-9.]+)", done.stdout).group(1))
    return {"exit status": done.returncode, "seconds to exit": end - at,
            "tracebacks shown": done.stderr.count("Traceback"),
            "watchdog reports": done.stderr.count("redeqx.StepWatchdog: process")}


READ_ONLY = """
import os, subprocess, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, equinox as eqx, optax, redeqx
mesh = redeqx.make_mesh(2)
model = eqx.nn.MLP(64, 64, 256, depth=3, key=jax.random.key(0))
specs = redeqx.sharding_rules(model, mesh)
state = redeqx.init_state(model, optax.adam(1e-3), mesh, specs, key=jax.random.key(1))
manager = redeqx.CheckpointManager(sys.argv[1], keep_last=1)
manager.save(state, force=True)
manager.wait()
subprocess.run(["mount", "-o", "remount,ro", sys.argv[1]], check=True)
print(f"READ-ONLY AT {time.time()}", flush=True)
try:
    manager.save(eqx.tree_at(lambda s: s.step, state, state.step + 1), force=True)
    print("NO ERROR", flush=True)
except redeqx.CheckpointError as e:
    print(f"RAISED AFTER {time.time()}: {e}", flush=True)
"""


def read_only_workdir() -> dict | None:
    """A tmpfs remounted read-only under the manager; None where this process
    may not mount one."""
    with tempfile.TemporaryDirectory() as tmp:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", tmp], capture_output=True).returncode:
            return None
        try:
            script = Path(tmp).parent / f"read_only_{os.getpid()}.py"
            script.write_text(READ_ONLY)
            done = subprocess.run([sys.executable, str(script), tmp], capture_output=True, text=True, env=worker_env(8))
            end = time.time()
            script.unlink()
        finally:
            subprocess.run(["umount", tmp], capture_output=True)
    at = float(re.search(r"READ-ONLY AT ([0-9.]+)", done.stdout).group(1))
    raised = re.search(r"RAISED AFTER ([0-9.]+): (.*)", done.stdout)
    return {"exit status": done.returncode, "seconds to the error": float(raised.group(1)) - at if raised else None,
            "seconds to exit": end - at, "error": raised.group(2)[:160] if raised else "none"}


def main():
    args = parser(__doc__).parse_args()

    rows = []
    for n in (1, 2):
        r = preemption(n)
        print("preemption", n, r, flush=True)
        rows.append(f"| SIGTERM, {n} process(es){' under redeqx.launch' if n > 1 else ''} | exit {r['exit status']} "
                    f"| {r['seconds to exit']:.1f} s after the signal | signal after step {r['signal after step']}, "
                    f"checkpoint of step {', '.join(map(str, r['saved step']))} |")
    for second in (signal.SIGTERM, signal.SIGINT):
        r = preemption(2, second=second)
        print("two signals", second, r, flush=True)
        outcome = (f"checkpoint of step {', '.join(map(str, r['saved step']))}" if r["saved step"]
                   else "nothing saved" + (", and said so" if r["said nothing saved"] else ", NOT said"))
        rows.append(f"| SIGTERM then {signal.Signals(second).name} 50 ms later, redeqx.launch | exit "
                    f"{r['exit status']} | {r['seconds to exit']:.1f} s after the first | {outcome}; "
                    f"{'no' if not r['left'] else ', '.join(r['left'])} unfinished save left |")
    r = launcher_fault("time.sleep(600)", watchdog=True, at=8)  # after the warm-up, with a median to judge by
    print("hang", r, flush=True)
    rows.append(f"| process 1 of 2 hangs in a step, StepWatchdog(factor=5, min_seconds=3), redeqx.launch | exit "
                f"{r['exit status']} | {r['seconds to exit']:.1f} s after the hang | stacks printed by "
                f"{r['watchdog reports']} of 2 processes |")
    r = launcher_fault('raise RuntimeError("boom")')
    print("raise", r, flush=True)
    rows.append(f"| process 1 of 2 raises mid-run, redeqx.launch | exit {r['exit status']} | "
                f"{r['seconds to exit']:.1f} s after the raise | tracebacks shown: {r['tracebacks shown']} |")
    r = launcher_fault("sys.exit(0)")
    print("sys.exit", r, flush=True)
    rows.append(f"| process 1 of 2 calls sys.exit(0) mid-run, redeqx.launch (default --exit-timeout 60) | exit "
                f"{r['exit status']} | {r['seconds to exit']:.1f} s after the exit | both processes named |")
    ro = read_only_workdir()
    print("read-only", ro, flush=True)
    if ro is not None:
        rows.append(f"| workdir remounted read-only, async save | exit {ro['exit status']} | error after "
                    f"{ro['seconds to the error']:.2f} s, exit after {ro['seconds to exit']:.1f} s | "
                    f"`{ro['error'][:90]}...` |")

    body = "\n".join([
        f"Real processes and signals on 8 simulated CPU devices ({os.cpu_count()} CPU cores).",
        "",
        "| fault | exit status | time | notes |",
        "|---|---|---|---|",
        *rows,
    ])
    report(args, "Faults (benchmarks/faults.py)", body)


if __name__ == "__main__":
    main()
