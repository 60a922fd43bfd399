"""What a checkpoint costs the host: peak memory and time of a save and a restore, redeqx's beside
plain orbax's, each in a fresh process.

    python -m benchmarks.checkpoint_memory                      # a 1 GiB stacked leaf; writes RESULTS.md
    python -m benchmarks.checkpoint_memory --gib 0.25 --no-write   # a quick try

One stacked leaf ``(8, 4096, gib * 8192)`` float32 split over ``model`` on its last dim, on 8
simulated CPU devices (``make_mesh(4)``), so the devices' buffers are host memory: "peak over
before" is the process's high-water mark (``VmHWM``, reset before the call) less its resident
memory just before, over the leaf's bytes. Plain orbax: ``StandardCheckpointer`` with the same
shardings (what redeqx writes under, without its content hash and metadata). Each figure is the
median of ``--repeats`` fresh processes, the variants alternated.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks._common import parser, report, serve, worker

VARIANTS = ("orbax save", "redeqx save", "orbax restore", "redeqx restore")


def _rss() -> tuple[int, int]:
    """(resident, high-water mark) of this process, bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark back to the resident size


def measure(variant: str, gib: float, directory: str) -> dict:
    """One variant in this (fresh) process: its seconds and its peak over the memory before."""
    import time

    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import redeqx

    mesh = redeqx.make_mesh(4)
    sharding = NamedSharding(mesh, P(None, None, "model"))
    shape = (8, 4096, int(gib * 8192))
    path = Path(directory) / variant.split()[0]
    if variant.endswith("save"):
        leaf = jax.jit(lambda: jnp.ones(shape, jnp.float32), out_shardings=sharding)()
        leaf.block_until_ready()
        tree = {"w": leaf}
    else:
        like = {"w": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)}
    before, _ = _rss()
    _reset_peak()
    t0 = time.perf_counter()
    if variant == "orbax save":
        with ocp.StandardCheckpointer() as c:
            c.save(path, tree)
    elif variant == "redeqx save":
        redeqx.save_checkpoint(path, tree)
    elif variant == "orbax restore":
        with ocp.StandardCheckpointer() as c:
            out = c.restore(path, like)
        jax.block_until_ready(out)
    else:
        out = redeqx.restore_checkpoint(path, like, mesh, {"w": P(None, None, "model")})
        jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    _, peak = _rss()
    return {"seconds": seconds, "over": peak - before, "leaf": 4 * shape[0] * shape[1] * shape[2]}


def main():
    p = parser(__doc__)
    p.add_argument("--gib", type=float, default=1.0, help="the leaf's size in GiB (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per variant (default 3)")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.repeats):
            for v in VARIANTS:  # each save writes the checkpoint its restore then reads
                runs[v].append(worker(__file__, "measure", variant=v, gib=args.gib, directory=d))
            for child in Path(d).iterdir():  # the next round saves anew
                shutil.rmtree(child, ignore_errors=True)
    leaf = runs[VARIANTS[0]][0]["leaf"]
    med = {v: (statistics.median(r["over"] for r in rs), statistics.median(r["seconds"] for r in rs))
           for v, rs in runs.items()}
    rows = ["| what | host peak over before (GiB) | x the leaf | seconds | vs plain orbax: memory | time |",
            "|---|---|---|---|---|---|"]
    for v in VARIANTS:
        over, secs = med[v]
        base = med[v.replace("redeqx", "orbax")]
        rows.append(f"| {v} | {over / 2**30:.2f} | {over / leaf:.2f} | {secs:.2f} | {over / base[0]:.2f}x | "
                    f"{secs / base[1]:.2f}x |")
    report(args, "What a checkpoint costs the host", f"""
One stacked leaf of {leaf / 2**30:.2f} GiB (float32, split over `model` on its last dim) on 8 simulated CPU
devices (`make_mesh(4)`), each variant in a fresh process, median of {args.repeats}, the variants alternated.
Targets (issue 49): redeqx's peak <= 1.25x plain orbax's, its time <= 1.5x.

""" + "\n".join(rows) + "\n")


if __name__ == "__main__" and not serve(globals()):
    main()
