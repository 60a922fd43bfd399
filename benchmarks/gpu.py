"""Everything RESULTS reports for one NVIDIA H100/H200, in one prepared command (issue 41).

    python -m benchmarks.gpu --json gpu.json            # on the GPU machine: at most 9 minutes
    python -m benchmarks.gpu --from-json gpu.json       # here: RESULTS.md's "On one GPU" section
    python -m benchmarks.gpu --smoke --no-write         # tiny sizes on any platform: check the script first

Each section runs in a process of its own (a crash or a hang costs that
section alone; its device memory is freed for the next), in this order, and
is skipped when what is left of ``--budget`` seconds is under its estimate.
With no ``--sections``, the first six run (issue 51's figures first, the
MoE step, met before, last); the other three when named:

- ``hardware``: the measured HBM bandwidth (a device-to-device pass, bytes
  read + written) and bf16 matmul rate, the ceilings every figure below is read against;
- ``fp8``: an 8B-shaped MLP block (4096 -> 14336 -> 4096, 16k tokens) forward and backward with
  `redeqx.steps._fp8.fp8_dot` against bf16 (`mlp_block`), and the GEMMs with fp8 operands its
  compiled program calls, cuBLAS's or Triton's (6 expected: 3 per linear);
- ``heads``: one context shard's attention at 32k tokens and C = 4 in the heads split, against a
  quarter of the unsplit attention and the blockwise code's share (`benchmarks.heads_gpu`);
- ``train``: the 1B LLaMA step stacked, listed, stacked with fp8 products, stacked with the MLP's
  each projection its own product (``+apart``: the joins' A/B) and hand-written (MFU, first
  compile), and a profile of the stacked step's device time by kind (`benchmarks._profile`);
- ``decode``: greedy decoding of the 1B LLaMA at batch 1 and 8, stacked and
  listed, against the HBM roofline, and each layout's first call (`benchmarks.decode_gpu`);
- ``moe``: ``moe1b`` (8 experts, top-2) against its dense twin ``1b``, one train step each;
- ``gmm``: the MoE FFN's grouped matmuls, JAX's Hopper kernels against XLA's
  ``ragged_dot`` and the dense matmul of the same FLOPs (`benchmarks.moe_gpu`);
- ``checkpoint``: a 1 GiB leaf's save and restore, redeqx's (with its content hash) beside plain
  orbax's, and the hash's own pass (issue 49's time target, on an accelerator);
- ``sweep``: block configs of each grouped-matmul kernel product (`benchmarks.moe_gpu.block_sweep`).

The JSON holds every section's raw figures (a section that failed holds its
error); ``--from-json`` renders them, so a table can be re-read without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks._common import ROOT, report, worker_env

TITLE = "On one GPU (benchmarks/gpu.py)"
# seconds each section needs on an H200 (estimates from earlier runs: start-up, compiles, timing)
# (decode: six 1B decoders, each compiled for generate and for the prefill; it ran past 361 s on an H200
# before a stacked prompt ran as one scan, which cut its compile to a seventh on libtpu)
ESTIMATE = {"hardware": 20, "fp8": 40, "heads": 60, "train": 170, "decode": 180, "moe": 140, "gmm": 60,
            "checkpoint": 60, "sweep": 90}
SECTIONS = tuple(ESTIMATE)
DEFAULT_SECTIONS = SECTIONS[:6]


# ----------------------------------------------------------------------------- sections (each in a worker)

def hardware(smoke: bool) -> dict:
    """The copy bandwidth and the bf16 matmul rate, medians of timed repeats."""
    import jax
    import jax.numpy as jnp

    from benchmarks._common import timed

    device = jax.devices()[0]
    n = 2**20 if smoke else 2**30  # elements of bf16: 2 GiB, many times any L2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    scale = jax.jit(lambda a: a * jnp.bfloat16(1.5))  # a pass over memory: n read, n written
    t = min(timed(lambda: scale(x), 10))
    side = 512 if smoke else 8192
    a, b = (jax.random.normal(k, (side, side), jnp.bfloat16) for k in jax.random.split(jax.random.key(1)))
    mm = jax.jit(lambda a, b: a @ b)
    tm = sorted(timed(lambda: mm(a, b), 10))[5]
    return {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "sm_count": getattr(device, "core_count", None),
            "bandwidth_bytes_per_s": 2 * n * 2 / t, "matmul_flops_per_s": 2 * side**3 / tm}


def _stand_ins_on_cpu(smoke: bool) -> None:
    """A smoke run on a CPU: XLA's products stand in for the Hopper kernels."""
    import jax

    from redeqx.models import _grouped

    if smoke and jax.default_backend() == "cpu":
        _grouped._stand_ins = True


def gmm(smoke: bool) -> dict:
    from benchmarks import moe_gpu

    _stand_ins_on_cpu(smoke)
    shape = moe_gpu.SMOKE if smoke else dict(rows=32768, hidden=2048, width=2816, experts=8)
    return moe_gpu.grouped_matmul_bench(**shape, rounds=2 if smoke else 5)


def sweep(smoke: bool) -> dict:
    """Block configs per kernel product (the table `redeqx.models._grouped.BLOCKS` is filled from)."""
    from benchmarks import moe_gpu

    _stand_ins_on_cpu(smoke)
    shape = moe_gpu.SMOKE if smoke else dict(rows=32768, hidden=2048, width=2816, experts=8)
    return moe_gpu.block_sweep(**shape, configs=moe_gpu.CONFIGS[:2] if smoke else moe_gpu.CONFIGS[:4],
                               rounds=2, steps=3)


def moe(smoke: bool) -> dict:
    from benchmarks import throughput

    out = {}
    for size in (("moe-tiny", "moe-tiny-dense") if smoke else ("moe1b", "1b")):
        args = argparse.Namespace(size=size, seq=64 if smoke else 2048, batch=2 if smoke else 8,
                                  variants="stacked+remat", hand=False, steps=1 if smoke else 3, rounds=1,
                                  plan=False, profile=None)
        out[size] = _quietly(throughput.run, args)
    return out


def decode(smoke: bool) -> dict:
    """Both layouts at batch 1 and 8 first, XLA:GPU's options last; the figures so
    far are printed after each group, so a section cut short by its time keeps them."""
    from benchmarks import decode_gpu

    groups = (("batch 1", 1, ("stacked", "listed")), ("batch 8", 8, ("stacked", "listed")),
              ("batch 1, XLA:GPU options", 1, ("stacked+nomerge", "listed+nomerge", "stacked+cmdbuf")))
    out = {}
    for label, batch, layouts in groups:
        out[label] = decode_gpu.decode_bench(size="tiny" if smoke else "1b", batch=batch, layouts=layouts,
                                             new_tokens=8 if smoke else 128, reps=2 if smoke else 5,
                                             bandwidth_bytes=2**24 if smoke else 2**31)
        print(json.dumps(out), flush=True)
    return out


def mlp_block(smoke: bool, sharding=None):
    """The fp8 section's programs: ``{"bf16": fn, "fp8": fn}``, each the value and the gradients of
    ``sum(mlp(x) * w)`` (two products, SiLU between), and its arguments (arrays, or abstract ones on
    ``sharding``). The weighted sum's value is taken so that no product is dead code: a plain sum's
    constant output gradient let XLA drop the second product's forward and turn its input gradient
    into a row sum (5 GEMMs, not 6)."""
    import jax
    import jax.numpy as jnp

    from redeqx.steps._fp8 import fp8_dot

    tokens, d, f = (256, 64, 224) if smoke else (16384, 4096, 14336)
    shapes = ((tokens, d), (d, f), (f, d), (tokens, d))
    if sharding is not None:
        args = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes)
    else:
        k = jax.random.split(jax.random.key(0), 4)
        args = tuple((jax.random.normal(key, s, jnp.float32) / (s[0] ** 0.5 if i in (1, 2) else 1)).astype(jnp.bfloat16)
                     for i, (key, s) in enumerate(zip(k, shapes)))
    dims = (((1,), (0,)), ((), ()))
    products = {"bf16": lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.bfloat16),
                "fp8": lambda a, b: fp8_dot(a, b, dims, jnp.bfloat16)}

    def program(prod):
        loss = lambda x, w1, w2, w: jnp.sum((prod(jax.nn.silu(prod(x, w1)), w2) * w).astype(jnp.float32))  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    return {name: program(prod) for name, prod in products.items()}, args, (tokens, d, f)


def fp8(smoke: bool) -> dict:
    """The MLP block's forward and backward in bf16 and with fp8 products, timed side by side, and
    the GEMMs XLA:GPU's compiled program calls, those with fp8 operands apart (cuBLAS's fp8 matmul
    or a Triton GEMM, whichever the autotuner picked)."""
    from benchmarks._common import alternate
    from benchmarks._profile import gemms

    programs, args, (tokens, d, f) = mlp_block(smoke)
    steps, out = {}, {}
    for name, program in programs.items():
        compiled = program.lower(*args).compile()
        counts = gemms(compiled.as_text())
        out[f"{name}_fp8_gemms"], out[f"{name}_gemms"] = counts["fp8_gemms"], counts["gemms"]
        steps[name] = lambda c=compiled: c(*args)
    times = alternate(steps, rounds=3, steps=3 if smoke else 10)
    flops = 3 * 2 * 2 * tokens * d * f  # two products, forward and two gradients each
    return {**out, "tokens": tokens, "d": d, "f": f, "expected_fp8_gemms": 6,
            **{f"{n}_s": t for n, t in times.items()}, "speedup": times["bf16"] / times["fp8"],
            **{f"{n}_flops_per_s": flops / t for n, t in times.items()}}


def heads(smoke: bool) -> dict:
    from benchmarks import heads_gpu

    return heads_gpu.heads_bench(smoke)


def train(smoke: bool, profile_dir: str) -> dict:
    from benchmarks import throughput

    args = argparse.Namespace(size="tiny" if smoke else "1b", seq=64 if smoke else 2048, batch=2 if smoke else 8,
                              variants="stacked,listed,stacked+fp8,stacked+apart", hand=True,
                              steps=2 if smoke else 5, rounds=2,
                              plan=False, profile=profile_dir)
    return _quietly(throughput.run, args)


def checkpoint(smoke: bool) -> dict:
    """A 1 GiB float32 leaf saved and restored by redeqx and by plain orbax (``StandardCheckpointer``),
    in one process after a first round (what a run's later saves cost), taking turns going first and
    each after ``os.sync`` as in `benchmarks.checkpoint_memory`, and the content hash's pass over it
    on the device."""
    import shutil
    import statistics
    import tempfile

    import jax
    import orbax.checkpoint as ocp

    import redeqx
    from benchmarks._common import timed
    from benchmarks.checkpoint_memory import variant_order
    from redeqx.checkpoints import _hashing

    mesh = redeqx.make_mesh(1)
    sharding = jax.NamedSharding(mesh, jax.P())
    shape = (2, 64, 64) if smoke else (8, 4096, 8192)
    tree = {"w": jax.jit(lambda k: jax.random.normal(k, shape), out_shardings=sharding)(jax.random.key(0))}
    root = Path(tempfile.mkdtemp())

    def orbax_save(path):
        with ocp.StandardCheckpointer() as c:
            c.save(path, tree)

    def orbax_restore(path):
        with ocp.StandardCheckpointer() as c:
            jax.block_until_ready(c.restore(path, tree))

    variants = {"orbax save": orbax_save, "redeqx save": lambda path: redeqx.save_checkpoint(path, tree),
                "orbax restore": orbax_restore,
                "redeqx restore": lambda path: jax.block_until_ready(redeqx.restore_checkpoint(path, tree, mesh))}
    times = {v: [] for v in variants}
    for r in range(3 if smoke else 5):  # the first warms up; then each goes first twice
        for v in variant_order(r):
            path = root / f"{v.split()[0]}{r}"
            os.sync()  # the variant before wrote its checkpoint: its write-back is not charged to this one
            t = time.perf_counter()
            variants[v](path)
            times[v].append(time.perf_counter() - t)
        for child in root.iterdir():
            shutil.rmtree(child)
    hash_s = min(timed(lambda: _hashing.fingerprints([tree["w"]], finite=False), 5))
    shutil.rmtree(root, ignore_errors=True)
    return {"bytes": 4 * shape[0] * shape[1] * shape[2], "hash_s": hash_s,
            **{v: statistics.median(ts[1:]) for v, ts in times.items()}}  # the first round warms up


def _quietly(fn, *args):
    """``fn(*args)``, its prints sent to stderr (a worker's stdout carries only its JSON)."""
    stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        return fn(*args)
    finally:
        sys.stdout = stdout


def _section(name: str, smoke: bool, profile_dir: str) -> dict:
    """One section in this process; failures are recorded, not raised."""
    t = time.perf_counter()
    try:
        fn = globals()[name]
        out = fn(smoke, profile_dir) if name == "train" else fn(smoke)
    except Exception as e:  # noqa: BLE001 (a GPU lease is short: report and go on)
        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    out["section_s"] = time.perf_counter() - t
    return out


# ----------------------------------------------------------------------------- the driver

def run_all(sections, budget: float, smoke: bool, workdir: Path, save=None) -> dict:
    """Each section in a fresh process, while the budget lasts; the results as
    one dict, handed to ``save`` after each section (a killed run keeps what it finished)."""
    start, results = time.perf_counter(), {"date": time.strftime("%Y-%m-%d")}
    env = worker_env(xla_flags="")  # the machine's own devices
    if smoke and "cpu" in os.environ.get("JAX_PLATFORMS", "cpu"):
        env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    for name in sections:
        left = budget - (time.perf_counter() - start)
        if not smoke and left < ESTIMATE[name]:
            results[name] = {"skipped": f"{left:.0f} s of the budget left, {ESTIMATE[name]} s estimated"}
            continue
        print(f"[gpu] {name}: {left:.0f} s left", file=sys.stderr, flush=True)
        task = json.dumps({"name": name, "smoke": smoke, "profile_dir": str(workdir / "profile")})
        try:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--section", task], env=env, cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True, timeout=max(left, 30))
            lines = proc.stdout.strip().splitlines()
            results[name] = (json.loads(lines[-1]) if proc.returncode == 0 and lines
                             else {"error": f"exit {proc.returncode}; its output is above"})
        except subprocess.TimeoutExpired as e:
            results[name] = _last_json(e.stdout) or {"error": f"timed out after {left:.0f} s"}
            results[name]["timed_out_s"] = round(left)
        results[name].setdefault("wall_s", time.perf_counter() - start)
        if save:
            save(results)
    return results


def _last_json(stdout) -> dict | None:
    """The last whole JSON line a killed section printed (its figures so far), if any."""
    text = stdout.decode(errors="replace") if isinstance(stdout, bytes) else (stdout or "")
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


# ----------------------------------------------------------------------------- rendering

def _gib(b):
    return f"{b / 2**30:.1f} GiB" if b else "n/a"


def render(out: dict) -> str:
    hw = out.get("hardware", {})
    lines = [f"_{out.get('date', '')}, {hw.get('device', '?')} ({hw.get('platform', '?')}), jax {hw.get('jax', '?')}_",
             ""]
    if "bandwidth_bytes_per_s" in hw:
        lines += [f"Measured in the same run: HBM {hw['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (bytes read + "
                  f"written by an elementwise pass over 2 GiB), bf16 matmul {hw['matmul_flops_per_s'] / 1e12:.0f} "
                  "TFLOP/s (8192^3).", ""]
    for name in SECTIONS[1:]:  # in the order they run
        sec, fn = out.get(name, {}), globals()[f"_render_{name}"]
        if "error" in sec or "skipped" in sec:
            lines += [f"**{name}**: {sec.get('error') or sec.get('skipped')}", ""]
        elif sec:
            lines += fn(sec, hw) + [""]
            if "timed_out_s" in sec:
                lines += [f"_({name} ran past its {sec['timed_out_s']} s: the rows above are what it finished.)_", ""]
    return "\n".join(lines).rstrip()


def _render_gmm(sec, hw):
    from benchmarks import moe_gpu

    return moe_gpu.render(sec)


def _render_sweep(sec, hw):
    from benchmarks import moe_gpu

    return moe_gpu.render_sweep(sec)


def _render_decode(sec, hw):
    from benchmarks import decode_gpu

    return decode_gpu.render(sec)


def _render_heads(sec, hw):
    from benchmarks import heads_gpu

    return heads_gpu.render(sec)


def _render_fp8(sec, hw):
    return [f"**fp8 products** (an MLP block {sec['d']} -> {sec['f']} -> {sec['d']}, {sec['tokens']} tokens, "
            "forward and backward; target: fp8 >= 1.2x bf16):", "",
            "| products | time | TFLOP/s | GEMMs | with fp8 operands (expected) |", "|---|---|---|---|---|",
            f"| bf16 | {sec['bf16_s'] * 1e3:.2f} ms | {sec['bf16_flops_per_s'] / 1e12:.0f} | "
            f"{sec.get('bf16_gemms', '?')} | {sec['bf16_fp8_gemms']} (0) |",
            f"| fp8 (`fp8_dot`) | {sec['fp8_s'] * 1e3:.2f} ms | {sec['fp8_flops_per_s'] / 1e12:.0f} | "
            f"{sec.get('fp8_gemms', '?')} | {sec['fp8_fp8_gemms']} ({sec['expected_fp8_gemms']}) |", "",
            f"fp8 is {sec['speedup']:.2f}x bf16's speed."]


def _render_checkpoint(sec, hw):
    rows = [f"**Checkpoints** (a {sec['bytes'] / 2**30:.2f} GiB float32 leaf, median of the rounds after the first; "
            "each variant going first in turn; target: redeqx <= 1.5x plain orbax):", "",
            "| what | redeqx | plain orbax | ratio |", "|---|---|---|---|"]
    for what in ("save", "restore"):
        ours, theirs = sec[f"redeqx {what}"], sec[f"orbax {what}"]
        rows.append(f"| {what} | {ours:.2f} s | {theirs:.2f} s | {ours / theirs:.2f}x |")
    rate = sec["bytes"] / sec["hash_s"] / 1e9
    return rows + ["", f"The content hash's pass on the device: {sec['hash_s'] * 1e3:.2f} ms ({rate:.0f} GB/s)."]


def _render_moe(sec, hw):
    rows = ["**MoE against its dense twin** (one train step each, stacked layers, remat, bf16 compute, AdamW):", "",
            "| model | parameters (active) | step | tokens/s | MFU (active) | first compile | temporaries |",
            "|---|---|---|---|---|---|---|"]
    speed = {}
    for size, res in sec.items():
        if not isinstance(res, dict) or "variants" not in res:
            continue
        for name, v in res["variants"].items():
            if "error" in v:
                rows.append(f"| {size} | failed: {v['error'][:200]} | | | | | |")
                continue
            speed[size] = v["tokens_per_s"]
            mfu = f"{v['mfu']:.1%}" if "mfu" in v else "n/a"
            rows.append(f"| {size} | {res['parameters'] / 1e9:.2f} B ({res['active_parameters'] / 1e9:.2f} B) "
                        f"| {v['step_s'] * 1e3:.1f} ms | {v['tokens_per_s']:,.0f} | {mfu} | {v['compile_s']:.1f} s "
                        f"| {_gib(v.get('temp_bytes'))} |")
    moe_size = next((s for s in speed if s.startswith("moe") and not s.endswith("dense")), None)
    dense = next((s for s in speed if s != moe_size), None)
    if moe_size and dense:
        rows += ["", f"MoE tokens/s over the dense twin's: **{speed[moe_size] / speed[dense]:.2f}x** (target 0.6x)."]
    return rows


def _by_source_rows(prof: dict, bandwidth: float | None, top: int = 12) -> list[str]:
    """The profile's time outside matmuls and attention by the function its kernels came from
    (`benchmarks._profile.source_of`), beside the bytes the program's text says they move: which
    code runs below the measured bandwidth (issue 51, item 4)."""
    if not prof.get("by_source"):
        return []
    gb = {(r["kind"], r["function"]): r["gb"] for r in prof.get("static", {}).get("by_source", [])}
    rows = ["", "The same time outside matmuls and attention, by the function its kernels came from:", "",
            "| function | kind | ms per step | kernels | GB moved | of the measured bandwidth |", "|---|---|---|---|---|---|"]
    for r in prof["by_source"][:top]:
        moved = gb.get((r["kind"], r["function"]))
        achieved = f"{moved * 1e9 / bandwidth * 1e3 / r['ms']:.0%}" if moved and bandwidth and r["ms"] else ""
        rows.append(f"| `{r['function']}` | {r['kind']} | {r['ms']:.2f} | {r['kernels']} | "
                    f"{'' if moved is None else f'{moved:.2f}'} | {achieved} |")
    return rows


def _render_train(sec, hw):
    from benchmarks import throughput

    rows = [throughput.table(sec)]
    v = sec.get("variants", {})
    bf16, fp8 = v.get("redeqx bf16, stacked", {}), v.get("redeqx bf16, stacked+fp8", {})
    if "tokens_per_s" in bf16 and "tokens_per_s" in fp8:
        rows += ["", f"The stacked step with fp8 products (`fp8=True`) runs at "
                     f"{fp8['tokens_per_s'] / bf16['tokens_per_s']:.2f}x its tokens/s in bf16."]
    prof = sec.get("profile")
    if prof and "ms_per_step" in prof:
        total = sum(prof["ms_per_step"].values())
        rows += ["", f"Device time of the {prof['variant']} step by kind, from a profile of "
                     f"{prof['steps']} steps (ms per step; the step took {prof['step_ms']:.1f} ms, the device "
                     f"was busy {prof['busy_ms_per_step']:.1f} ms of it):", "",
                 "| kind | ms per step | share of kernel time | GB moved (the program's text) | at the measured "
                 "bandwidth | of which achieved |", "|---|---|---|---|---|---|"]
        gb, bw = prof.get("static", {}).get("gb", {}), hw.get("bandwidth_bytes_per_s")
        for k, ms in prof["ms_per_step"].items():
            floor = gb[k] * 1e9 / bw * 1e3 if k in gb and bw else None
            if ms or floor:
                rows.append(f"| {k} | {ms:.1f} | {ms / total if total else 0:.1%} | {gb.get(k, 0):.1f} | "
                            + (f"{floor:.1f} ms | {floor / ms:.0%} |" if floor and ms else "| |"))
        rows += _by_source_rows(prof, bw)
        rows += ["", "Largest instructions:", "", "| instruction | kind | ms per step | launches | kernel |",
                 "|---|---|---|---|---|"]
        rows += [f"| {t['op']} | {t['kind']} | {t['ms']:.2f} | {t['launches']} | `{t['kernel'][:60]}` |"
                 for t in prof["top"][:12]]
    elif prof:
        rows += ["", f"Profile: {prof.get('error', prof)}"]
    return rows


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--section":
        task = json.loads(sys.argv[2])
        print(json.dumps(_section(task["name"], task["smoke"], task["profile_dir"])), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--budget", type=float, default=540, help="seconds for all sections (start-ups included)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, any platform: checks the script")
    p.add_argument("--json", help="write the results here (each section as it ends)")
    p.add_argument("--workdir", default="/tmp/redeqx-gpu", help="where the profile is written")
    p.add_argument("--from-json", help="render a run's JSON into RESULTS.md")
    args = p.parse_args()
    if args.from_json:
        out = json.loads(Path(args.from_json).read_text())
    else:
        sections = [s.strip() for s in args.sections.split(",") if s.strip()]
        unknown = set(sections) - set(SECTIONS)
        if unknown:
            raise SystemExit(f"--sections: {sorted(unknown)} are not among {SECTIONS}")
        save = (lambda out: Path(args.json).write_text(json.dumps(out, indent=1))) if args.json else None
        out = run_all(sections, args.budget, args.smoke, Path(args.workdir), save)
    report(argparse.Namespace(no_write=args.no_write or args.smoke), TITLE, render(out))


if __name__ == "__main__":
    main()
