"""Grouped matmuls on an NVIDIA Hopper GPU: JAX's kernels against XLA's
``ragged_dot`` and a dense matmul of the same FLOPs (issue 41).

    python -m benchmarks.moe_gpu                 # on one H100/H200: MoE-1B's expert FFN, printed as JSON
    python -m benchmarks.moe_gpu --sweep         # + block configs per product, for models/_grouped.BLOCKS
    python -m benchmarks.moe_gpu --experts 128   # e.g. Qwen3-MoE's expert count (compile time grows with it)
    python -m benchmarks.moe_gpu --cpu-smoke     # tiny shapes on a CPU, XLA's products standing in for the kernels

`grouped_matmul_bench` times one SwiGLU expert FFN (gate, up, down: three
grouped matmuls over rows in uneven expert groups), forward and forward +
backward, with the Hopper kernels under redeqx's ``custom_vjp``
(`redeqx.models._grouped._hopper`), with ``jax.lax.ragged_dot`` (which XLA's
GPU backend expands over every expert) and as a dense FFN of the same FLOPs
(every row through one expert); medians of calls timed side by side, each
waited for, and the kernels' outputs and gradients checked against
``ragged_dot``'s. `block_sweep` times a few block configs of each kernel
product and returns the fastest, the table `redeqx.models._grouped.BLOCKS`
is filled from. Both return plain dicts (``benchmarks/gpu.py`` may call
them); nothing here writes RESULTS.md.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time

import jax
import jax.numpy as jnp

from benchmarks._common import alternate, parser
from redeqx.models import _grouped
from redeqx.models._grouped import HOPPER, Blocks

# Candidates for block_sweep: the measured default, a wider output walk, deeper pipelines, a deeper
# contraction block, a shorter row block (fewer rows wasted at group boundaries). Each within the
# 227 KiB of shared memory an SM has (a config over it is reported as failed, not fatal).
CONFIGS = (Blocks(), Blocks(grid_block_n=4), Blocks(max_concurrent_steps=6), Blocks(block_k=128, max_concurrent_steps=2),
           Blocks(block_k=128, max_concurrent_steps=3, grid_block_n=4), Blocks(block_m=64, grid_block_n=4))
SMOKE = dict(rows=512, hidden=128, width=256, experts=4)


def _sizes(rows: int, experts: int):
    """Uneven group sizes summing to ``rows`` (1 : 2 : 3 : 1 : 2 : 3 ...)."""
    share = [1 + e % 3 for e in range(experts)]
    sizes = [rows * s // sum(share) for s in share]
    sizes[-1] += rows - sum(sizes)
    return jnp.asarray(sizes, jnp.int32)


def _operands(rows, hidden, width, experts, dtype):
    ks = jax.random.split(jax.random.key(0), 5)
    normal = lambda k, shape, scale: (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    x = normal(ks[0], (rows, hidden), 1.0)
    gate, up = (normal(k, (experts, width, hidden), hidden ** -0.5) for k in ks[1:3])
    down = normal(ks[3], (experts, hidden, width), width ** -0.5)
    return x, gate, up, down, normal(ks[4], (rows, hidden), 1.0)


def _xla(rows, w, sizes):
    return jax.lax.ragged_dot_general(rows, w, sizes, _grouped._ROWS_BY_OUT_IN)


PRODUCTS = {  # rows (n, in) by w (E, out, in), each way: the grouped matmul to time
    "kernels": _grouped._hopper,
    "xla": _xla,
    "dense": lambda rows, w, sizes: rows @ w[0].T,  # every row through expert 0: the same FLOPs, one GEMM
}


def _ffn(mm, sizes):
    """The SwiGLU expert FFN with grouped matmul ``mm``, and its loss for the backward pass."""
    def ffn(x, gate, up, down):
        return mm(jax.nn.silu(mm(x, gate, sizes)) * mm(x, up, sizes), down, sizes)

    def loss(x, gate, up, down, ct):
        return jnp.sum(ffn(x, gate, up, down).astype(jnp.float32) * ct.astype(jnp.float32))

    return ffn, jax.grad(loss, argnums=(0, 1, 2, 3))


def _check_device(rows, w):
    """What `choose` picks on this device; an error unless it is the kernels (or their stand-ins)."""
    device = _grouped._device()
    path, reason = _grouped.choose(device, rows, w)
    if path != HOPPER:
        raise RuntimeError(f"benchmarks.moe_gpu needs the Hopper kernels, and on {device} they do not run: {reason}. "
                           "On a CPU, pass --cpu-smoke (XLA's products stand in for them).")
    return {"device": device.kind, "path": path, "reason": reason}


def _compiled(f, *args):
    """``f`` jitted and compiled for ``args``, and the seconds that took."""
    start = time.perf_counter()
    compiled = jax.jit(f).lower(*args).compile()
    return compiled, time.perf_counter() - start


def _rel_err(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def grouped_matmul_bench(rows: int = 32768, hidden: int = 2048, width: int = 2816, experts: int = 8,
                         dtype=jnp.bfloat16, *, rounds: int = 5, steps: int = 10) -> dict:
    """The expert FFN's forward and forward + backward in ms (median), its
    TFLOP/s (FLOPs by rows: 6 x rows x hidden x width forward, 3x that with
    the backward) and compile seconds, for the kernels, XLA's ``ragged_dot``
    and the dense FFN of the same FLOPs; the kernels' largest error against
    ``ragged_dot`` (relative to its largest value) and whether all are within
    the dtype's tolerance.

    >>> r = grouped_matmul_bench()            # on an H100/H200
    >>> r["forward_backward_ms"]["kernels"] / r["forward_backward_ms"]["dense"]   # issue 41's target: <= 1.8
    """
    x, gate, up, down, ct = _operands(rows, hidden, width, experts, dtype)
    sizes = _sizes(rows, experts)
    out = _check_device(x, gate)
    flops = 6 * rows * hidden * width
    results: dict = {"shape": dict(rows=rows, hidden=hidden, width=width, experts=experts, dtype=jnp.dtype(dtype).name,
                                   sizes=[int(s) for s in sizes]), **out}
    got: dict = {}
    runners: dict = {"forward": {}, "forward_backward": {}}
    compile_s: dict = {"forward": {}, "forward_backward": {}}
    for name, mm in PRODUCTS.items():
        ffn, grads = _ffn(mm, sizes)
        for part, f, args in (("forward", ffn, (x, gate, up, down)), ("forward_backward", grads, (x, gate, up, down, ct))):
            compiled, seconds = _compiled(f, *args)
            compile_s[part][name] = round(seconds, 2)
            runners[part][name] = functools.partial(compiled, *args)
            if name != "dense":
                got[name, part] = jax.block_until_ready(compiled(*args))
    for part in ("forward", "forward_backward"):
        ms = {k: 1e3 * v for k, v in alternate(runners[part], rounds, steps).items()}
        work = flops * (1 if part == "forward" else 3)
        results[f"{part}_ms"] = {k: round(v, 3) for k, v in ms.items()}
        results[f"{part}_tflops"] = {k: float(f"{work / (v / 1e3) / 1e12:.3g}") for k, v in ms.items()}
    results["compile_s"] = compile_s
    errors = {"out": _rel_err(got["kernels", "forward"], got["xla", "forward"])}
    for label, a, b in zip(("d x", "d gate", "d up", "d down"), got["kernels", "forward_backward"],
                           got["xla", "forward_backward"]):
        errors[label] = _rel_err(a, b)
    tol = 1e-4 if jnp.dtype(dtype) == jnp.float32 else 2e-2
    results["max_rel_err"] = {k: float(f"{v:.2e}") for k, v in errors.items()}
    results["equal"] = all(v <= tol for v in errors.values())
    fb = results["forward_backward_ms"]
    results["kernels_over_dense"] = round(fb["kernels"] / fb["dense"], 3)
    results["xla_over_kernels"] = round(fb["xla"] / fb["kernels"], 2)
    return results


@contextlib.contextmanager
def _blocks_set(key, blocks: Blocks):
    """`_grouped.BLOCKS[key]` = ``blocks`` within."""
    old = dict(_grouped.BLOCKS)
    _grouped.BLOCKS[key] = blocks
    try:
        yield
    finally:
        _grouped.BLOCKS.clear()
        _grouped.BLOCKS.update(old)


def block_sweep(rows: int = 32768, hidden: int = 2048, width: int = 2816, experts: int = 8, dtype=jnp.bfloat16,
                *, configs=CONFIGS, rounds: int = 3, steps: int = 5) -> dict:
    """For each kernel product of `_grouped.BLOCKS` (forward, input and
    weight gradient, of an "up" layer ``hidden -> width`` and a "down" layer
    ``width -> hidden``): each config's median ms (or why it failed), the
    fastest, its TFLOP/s and error against ``ragged_dot``'s; and ``table``,
    the `_grouped.BLOCKS` those give, as Python to paste.

    >>> block_sweep()["table"]                 # on an H100/H200
    """
    x, gate, _, down, ct = _operands(rows, hidden, width, experts, dtype)
    sizes = _sizes(rows, experts)
    out = _check_device(x, gate)
    h = jax.random.normal(jax.random.key(1), (rows, width), jnp.float32).astype(dtype)  # the down layer's rows
    layers = {"up": (x, gate, h), "down": (h, down, ct)}  # rows, weights, the output's cotangent
    results: dict = {"shape": dict(rows=rows, hidden=hidden, width=width, experts=experts,
                                   dtype=jnp.dtype(dtype).name), **out}
    lines = []
    for layer, (r, w, c) in layers.items():
        products = {
            "forward": (lambda r, w, c: _grouped._ragged_mgpu(r, w, sizes, transpose=True),
                        lambda r, w, c: _xla(r, w, sizes)),
            "input_grad": (lambda r, w, c: _grouped._ragged_mgpu(c, w, sizes, transpose=False),
                           lambda r, w, c: _xla(c, jnp.swapaxes(w, 1, 2), sizes)),
            "weight_grad": (lambda r, w, c: _grouped._transposed_mgpu(c, r, sizes),
                            lambda r, w, c: jax.grad(lambda w: jnp.sum(_xla(r, w, sizes).astype(jnp.float32)
                                                                       * c.astype(jnp.float32)))(w).astype(w.dtype)),
        }
        for product, (kernel, reference) in products.items():
            tried = []
            for blocks in configs:
                with _blocks_set((product, layer), blocks):
                    try:
                        compiled, _ = _compiled(kernel, r, w, c)
                        ms = 1e3 * alternate({"k": functools.partial(compiled, r, w, c)}, rounds, steps)["k"]
                        tried.append({"blocks": blocks._asdict(), "ms": round(ms, 3), "compiled": compiled})
                    except Exception as e:  # noqa: BLE001 (a config over shared memory fails to compile: report it)
                        tried.append({"blocks": blocks._asdict(), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            ok = [t for t in tried if "ms" in t]
            key = f"{product}/{layer}"
            if not ok:
                results[key] = {"tried": tried}
                continue
            best = min(ok, key=lambda t: t["ms"])
            err = _rel_err(best["compiled"](r, w, c), jax.jit(reference)(r, w, c))
            results[key] = {"best": best["blocks"], "ms": best["ms"],
                            "tflops": float(f"{2 * rows * hidden * width / (best['ms'] / 1e3) / 1e12:.3g}"),
                            "max_rel_err": float(f"{err:.2e}"),
                            "tried": [{k: v for k, v in t.items() if k != "compiled"} for t in tried]}
            lines.append(f"    ({product!r}, {layer!r}): Blocks({', '.join(f'{k}={v}' for k, v in best['blocks'].items())}),")
    results["table"] = "BLOCKS: dict[tuple[str, str], Blocks] = {\n" + "\n".join(lines) + "\n}"
    return results


def render(r: dict) -> list[str]:
    """RESULTS rows of a `grouped_matmul_bench` result (and a `block_sweep`'s, under ``"sweep"``)."""
    shape = r["shape"]
    rows = [f"**The MoE FFN's grouped matmuls** ({shape['rows']:,} rows in {shape['experts']} uneven groups, hidden "
            f"{shape['hidden']}, expert width {shape['width']}, {shape['dtype']}; path chosen: {r['path']}, "
            f"{r['reason']}):", "",
            "| product | forward ms | forward TFLOP/s | forward + backward ms | fwd + bwd TFLOP/s | compile (fwd + bwd) |",
            "|---|---|---|---|---|---|"]
    for name in r["forward_ms"]:
        rows.append(f"| {name} | {r['forward_ms'][name]:.2f} | {r['forward_tflops'][name]:.0f} | "
                    f"{r['forward_backward_ms'][name]:.2f} | {r['forward_backward_tflops'][name]:.0f} | "
                    f"{r['compile_s']['forward_backward'][name]:.1f} s |")
    rows += ["", f"Kernels' forward + backward over the dense FFN's: **{r['kernels_over_dense']:.2f}x** (target "
                 f"<= 1.8x); XLA's ragged_dot over the kernels: {r['xla_over_kernels']:.2f}x. Largest error against "
                 f"ragged_dot, relative to its largest value: "
                 f"{', '.join(f'{k} {v:.1e}' for k, v in r['max_rel_err'].items())} "
                 f"({'equal within tolerance' if r['equal'] else 'NOT EQUAL'})."]
    return rows


def render_sweep(sweep: dict) -> list[str]:
    """RESULTS rows of a `block_sweep` result."""
    rows = ["**Block configs of the kernels**, fastest of those tried per product (`block_sweep`):", "",
            "| product | best | ms | TFLOP/s | error vs ragged_dot |", "|---|---|---|---|---|"]
    rows += [f"| {k} | {v['best']} | {v['ms']:.3f} | {v['tflops']:.0f} | {v['max_rel_err']:.1e} |"
             for k, v in sweep.items() if isinstance(v, dict) and "best" in v]
    rows += [f"| {k} | every config failed: {v['tried'][0].get('error', '')[:120]} | | | |" for k, v in sweep.items()
             if isinstance(v, dict) and "tried" in v and "best" not in v]
    return rows


def main():
    p = parser(__doc__, experts=8, rows=32768)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on a CPU, XLA's products for the kernels")
    p.add_argument("--sweep", action="store_true", help="also time block configs per product (block_sweep)")
    args = p.parse_args()
    shape = dict(rows=args.rows, experts=args.experts)
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
        _grouped._stand_ins = True
        shape = dict(SMOKE)
    report = {"grouped_matmul_bench": grouped_matmul_bench(**shape, rounds=2 if args.cpu_smoke else 5)}
    if args.sweep or args.cpu_smoke:
        report["block_sweep"] = block_sweep(**shape, configs=CONFIGS[:2] if args.cpu_smoke else CONFIGS)
    print(json.dumps(report, indent=1))
    if not report["grouped_matmul_bench"]["equal"]:
        raise SystemExit("the kernels' results differ from ragged_dot's (max_rel_err above)")


if __name__ == "__main__":
    main()
