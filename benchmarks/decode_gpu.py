"""Cached greedy decoding of the zoo LLaMA against the HBM roofline, in both
layouts, on whatever accelerator is present.

    python -m benchmarks.decode_gpu --cpu-smoke            # a tiny model on CPU: checks the script, seconds
    python -m benchmarks.decode_gpu --size 1b --batch 1 --json decode.json            # on a GPU
    python -m benchmarks.decode_gpu --size 1b --variants stacked,listed,stacked+cmdbuf,stacked+dsf

``decode_bench`` is what a GPU check calls. Each layout (``stacked``, the
default, or ``listed``) is compiled once for ``generate`` (its first call:
compile + one run, timed) and once for the prefill alone; ms/token is
(generate - prefill) / new tokens, the best of ``reps`` runs. The roofline
of one token is the bytes it must read (every weight once, plus the whole KV
cache, which attention reads over every slot) over the bandwidth of a large
device-to-device copy timed in the same run.

What else keeps batch-1 decoding from the roofline once no weight is copied
per token (``redeqx.models._layers.decode_stack``):

- kernel launches: a token runs some 10-15 kernels per layer (norms,
  projections, rotary, attention, the MLP), ~300 for the 1B model's 22
  layers, each a few microseconds to launch, as much as the 0.5 ms the
  weights take to read. XLA's command buffers (CUDA graphs) replay a
  sequence of kernels with one launch; by default XLA:GPU captures fusions
  and library calls but not the loop over tokens itself. Variant ``+cmdbuf``
  adds while loops and conditionals to the captured commands
  (``xla_gpu_enable_command_buffer``), so the whole token loop can be one
  graph.
- attention over the whole cache: each token's attention reads every slot of
  the cache (prompt + new tokens), filled or not; at batch 1 with 256 slots
  that is ~1 % of the weight bytes (counted in the roofline here), but it
  grows with batch and context. A decode-attention kernel over the filled
  slots only (a Pallas paged/ragged attention) would read just those; JAX
  ships none for GPUs that takes a per-row length without a paging layout,
  so it is named here, not wired.
- sampling: greedy is one argmax over the vocabulary per token (the logits
  are 32,000 x batch floats: negligible); top-k/top-p sort the vocabulary
  and cost more, but `generate`'s default does not.
- slices read in place: each layer's weights are static slices of the
  stack. Whether the GPU backend reads them in place (a Triton GEMM fusing
  the slice) or copies them per token shows in this benchmark as
  ``stacked`` against ``listed``, and ``temp_bytes`` shows a slice hoisted
  out of the loop (a second copy of the weights); variant ``+dsf`` turns on
  XLA's dynamic-slice fusion (``xla_gpu_enable_dynamic_slice_fusion``),
  which hands cuBLAS an offset into the stack instead of a copy (JAX 0.10.2's
  XLA:GPU refuses it for the stacked generation: "BufferAllocation::Slice not
  assigned", compiled here by `benchmarks.gpu_compile`). Each layout's
  compiled program also says what a token copies (``copies_per_token``,
  ``copied_bytes_per_token``: `benchmarks._profile.loop_copies`). Compiled
  here for an H100 with no autotuning (`benchmarks.gpu_compile`), the
  stacked 1B copied the MLP's gate and up slices every token (1.9 GiB with
  Triton's GEMMs; every slice, 2.9 GiB, with cuBLAS's) until `generate`
  sliced the stack once before its loop on a GPU
  (`redeqx.models._layers.sliced_for_decoding`); with cuBLAS both layouts
  still copy 1.9 GiB: XLA's dot merger joins gate and up into one GEMM
  over their concatenated weights. Variant ``+nomerge``
  (``xla_gpu_dot_merger_threshold_mb=0``) leaves them two GEMMs (8 MiB a
  token).

On XLA:CPU (``--cpu-smoke``, or a size of your own) the stacked layout runs
a bf16 token about 1.5-1.8x slower than listed (a 16-layer LLaMA of width
256: 3.7-4.6 ms against 2.4-2.6), and the copies are not the weights': XLA:CPU
widens the cache's masked write to float32, so each layer's write converts
the whole stacked cache to float32 and back (one layer's cache when listed).
In float32 the two layouts run a token in the same time (3.5 against 3.55
ms), and libtpu's program writes the stack in place (a dynamic-update-slice
of one slot) with no weight-shaped value in either loop's body.
"""

from __future__ import annotations

import json
import time
import traceback

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._profile import loop_copies
from benchmarks.throughput import make_config, model_class
from redeqx.models import generate
from redeqx.steps._loss import cast_floats

PROMPT = 16
# XLA:GPU options per variant suffix; the default command buffer types plus while loops and conditionals
VARIANT_OPTIONS = {
    "cmdbuf": {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"},
    "dsf": {"xla_gpu_enable_dynamic_slice_fusion": True},
    "nomerge": {"xla_gpu_dot_merger_threshold_mb": 0},
}


def best_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def copy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of a large device-to-device copy (read + write), the same chip's HBM as decoding reads."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)  # not zeros: real data
    copy = jax.jit(lambda a: a + 1)  # reads and writes every byte once
    jax.block_until_ready(copy(x))
    return 2 * x.nbytes / best_time(lambda: copy(x), reps)


def _variant(text: str) -> tuple[str, dict]:
    layout, *extras = text.split("+")
    if layout not in ("stacked", "listed") or any(e not in VARIANT_OPTIONS for e in extras):
        raise SystemExit(f"variant {text!r}: write stacked or listed, optionally +{'/+'.join(VARIANT_OPTIONS)}")
    options = {k: v for e in extras for k, v in VARIANT_OPTIONS[e].items()}
    return layout, options


def decode_bench(size: str = "1b", batch: int = 1, new_tokens: int = 128, layouts=("stacked", "listed"),
                 dtype=jnp.bfloat16, reps: int = 5, bandwidth_bytes: int = 2**31) -> dict:
    """ms/token, tokens/s, first-call time and % of the HBM roofline of cached greedy
    decoding for each of ``layouts`` (``"stacked"``, ``"listed"``, with ``+cmdbuf`` /
    ``+dsf`` for the XLA:GPU variants in the module docstring)."""
    bandwidth = copy_bandwidth(bandwidth_bytes)
    prompt = jax.random.randint(jax.random.key(1), (batch, PROMPT), 3, make_config(size).vocab_size)
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "size": size, "batch": batch,
           "prompt": PROMPT, "new_tokens": new_tokens, "dtype": jnp.dtype(dtype).name,
           "bandwidth_GBps": bandwidth / 1e9, "layouts": {}}
    first_tokens = None
    for name in layouts:
        layout, options = _variant(name)
        try:
            config = make_config(size, scan_layers=layout == "stacked", max_position_embeddings=PROMPT + new_tokens)
            model = eqx.filter_jit(lambda k: cast_floats(model_class(config)(config, key=k), dtype))(jax.random.key(0))
            weight_bytes = sum(a.nbytes for a in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
            cache = jax.eval_shape(lambda m: m.init_cache(PROMPT + new_tokens), model)
            cache_bytes = batch * sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache.layers))
            run = jax.jit(lambda m, p: generate(m, p, max_new_tokens=new_tokens), compiler_options=options or None)
            prefill = jax.jit(lambda m, p: jax.vmap(lambda i: m.prefill(i, jnp.ones(i.shape, bool), new_tokens))(p),
                              compiler_options=options or None)
            t = time.perf_counter()
            compiled = run.lower(model, prompt).compile()
            tokens = jax.block_until_ready(compiled(model, prompt))
            first = time.perf_counter() - t
            jax.block_until_ready(prefill(model, prompt))
            total, pre = best_time(lambda: compiled(model, prompt), reps), best_time(lambda: prefill(model, prompt), reps)
            per_token = max(total - pre, 1e-9) / new_tokens
            roofline = (weight_bytes + cache_bytes) / bandwidth
            first_tokens = np.asarray(tokens) if first_tokens is None else first_tokens
            memory = compiled.memory_analysis()
            out["layouts"][name] = {**loop_copies(compiled.as_text()),
                "first_call_s": first, "ms_per_token": per_token * 1e3, "tokens_per_s": batch / per_token,
                "prefill_ms": pre * 1e3, "weight_bytes": weight_bytes, "cache_bytes": cache_bytes,
                "roofline_ms_per_token": roofline * 1e3, "pct_of_roofline": 100 * roofline / per_token,
                "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
                "same_tokens_as_first_layout": bool(np.array_equal(np.asarray(tokens), first_tokens)),
                "compiler_options": options}
        except Exception as e:  # a variant's flag this XLA refuses: said, and the others still run
            out["layouts"][name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)}
    return out


def render(runs: dict) -> list[str]:
    """RESULTS rows of ``{"batch N": decode_bench(...), ...}``."""
    rows = []
    for label, out in runs.items():
        if not isinstance(out, dict) or "layouts" not in out:
            continue
        rows += [f"**Greedy decoding, {label}** ({out['size']} LLaMA, {out['dtype']}, prompt {out['prompt']}, "
                 f"{out['new_tokens']} new tokens; copy bandwidth {out['bandwidth_GBps'] / 1e3:.2f} TB/s in the "
                 "same run):", "",
                 "| layout | ms/token | tokens/s | roofline ms/token | % of roofline | first call | temporaries "
                 "| same tokens | copies a token |", "|---|---|---|---|---|---|---|---|---|"]
        for name, v in out["layouts"].items():
            if "error" in v:
                rows.append(f"| {name} | failed: {v['error'][:160]} | | | | | | | |")
                continue
            temps = f"{v['temp_bytes'] / 2**30:.2f} GiB" if v.get("temp_bytes") is not None else "n/a"
            rows.append(f"| {name} | {v['ms_per_token']:.3f} | {v['tokens_per_s']:,.0f} | "
                        f"{v['roofline_ms_per_token']:.3f} | {v['pct_of_roofline']:.0f} % | {v['first_call_s']:.1f} s "
                        f"| {temps} | {'yes' if v['same_tokens_as_first_layout'] else 'NO'} | "
                        f"{v.get('copies_per_token', '?')} ({v.get('copied_bytes_per_token', 0) / 2**20:.1f} MiB) |")
        rows.append("")
    return rows[:-1]


def main():
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new", type=int, default=128, help="new tokens per row")
    p.add_argument("--variants", default="stacked,listed")
    p.add_argument("--cpu-smoke", action="store_true", help="the tiny model, 8 tokens, a small copy: checks the script")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    kw = dict(size=args.size, batch=args.batch, new_tokens=args.new, layouts=tuple(args.variants.split(",")))
    if args.cpu_smoke:
        kw.update(size="tiny", new_tokens=8, reps=2, bandwidth_bytes=2**24)
    result = decode_bench(**kw)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    if any("error" in v for v in result["layouts"].values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
