"""Shared by the benchmarks: the small transformer's size flags, timing a
call, and writing one benchmark's section of benchmarks/RESULTS.md while
keeping the others."""

import datetime
import platform
import re
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
