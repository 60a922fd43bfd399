"""Shared by the benchmarks: the small transformer's size flags, timing a
call, running a script's workers (on 8 simulated CPU devices, or in the
libtpu virtual environment), and writing one benchmark's section of
benchmarks/RESULTS.md while keeping the others."""

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADER = "# Benchmark results\n\nEach section is rewritten by the script named in its title; ratios are measured side by side in one run.\n"


def write_section(title: str, body: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    stamp = f"_{datetime.date.today().isoformat()}, {platform.machine()}, {platform.node() or 'host'}_"
    section = f"## {title}\n\n{stamp}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + section
    RESULTS.write_text(text.rstrip() + "\n")
    print(f"wrote section '{title}' of {RESULTS}")


def add_tiny_lm_args(parser, *, steps: int = 20, rounds: int = 5) -> None:
    """Size of the TinyLM (tests/tiny_transformer.py) and of the timing loop."""
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")


def timed(fn, n: int) -> list[float]:
    """Wall seconds of ``n`` calls of ``fn``, each waited for (``jax.block_until_ready``)."""
    import jax

    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return times


def cpu8_env() -> dict:
    """This process's environment with 8 simulated CPU devices."""
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")


def libtpu() -> tuple[str, dict]:
    """The Python of benchmarks/.venv-tpu and an environment in which libtpu
    compiles for a TPU v4 slice with no TPU attached; exits if it is missing."""
    python = Path(__file__).resolve().parent / ".venv-tpu" / "bin" / "python"
    if not python.exists():
        sys.exit("no benchmarks/.venv-tpu: run `python benchmarks/table1.py --setup-tpu` once")
    return str(python), dict(os.environ, TPU_ACCELERATOR_TYPE="v4-16", TPU_WORKER_HOSTNAMES="localhost",
                             TPU_SKIP_MDS_QUERY="1")


def run_worker(python: str, script: str, args: list[str], env: dict):
    """Run ``script args`` under ``python`` and return the JSON of its last line."""
    proc = subprocess.run([python, script, *args], env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise RuntimeError(f"{Path(script).name} {' '.join(args)} failed (exit {proc.returncode}); its output is above")
    return json.loads(proc.stdout.strip().splitlines()[-1])
