"""What a decoding program costs to compile, the zoo LLaMA stacked against
listed, by XLA:CPU and by libtpu for one TPU v4 chip (ahead of time; ``python
-m benchmarks.table1 --setup-tpu`` once), on abstract bf16 weights.

    python -m benchmarks.decode_compile                       # 1B LLaMA, both compilers
    python -m benchmarks.decode_compile --compilers cpu --size tiny --no-write
    python -m benchmarks.decode_compile --compilers tpu,cpu --batch 8 --slots 4096 --repeats 1   # long, batched

For each layout, in a fresh process (nothing cached from the other): the
prompt's pass alone (``prefill``) and the whole generation (``generate``:
the prompt, then the loop over tokens), each traced and compiled; the
generation's temporaries; and how many of its fused computations are
distinct. A compiler compiles each distinct fused computation once, so
listed layers, whose kernels are identical, share them; a stack read layer
by layer at static offsets has each layer's offsets in its kernels. Best of
``--repeats`` rounds, the layouts taking turns. Each layout's token loop: the copy kernels one
token's step runs and the MiB they read and write (`benchmarks._profile.loop_copies`; with
``--batch`` and ``--slots`` where the KV cache's copies would show).
"""

from __future__ import annotations

import re
import sys
import time

from benchmarks._common import compile_devices, compiler, gpu_compiler, parser, report, serve, worker

PROMPT, NEW = 64, 64
COMPILERS = {"cpu": "XLA:CPU", "tpu": "libtpu (v4)", "gpu": "XLA:GPU (H100, no GPU attached)"}


def distinct_fusions(hlo_text: str) -> tuple[int, int]:
    """(fused computations, distinct ones) of a compiled module's text: bodies compared with the
    instructions' names and metadata left out."""
    bodies, current = {}, None
    for line in hlo_text.splitlines():
        if (m := re.match(r"^%(\S*fus\S*) ", line)) and line.rstrip().endswith("{"):
            current = m.group(1)
            bodies[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            bodies[current].append(re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", line)))
    return len(bodies), len({"\n".join(b) for b in bodies.values()})


def compile_worker(platform: str, size: str, stacked: bool, batch: int = 1, new: int = NEW, gpu: str = "H100") -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import redeqx
    from benchmarks.throughput import make_config, model_class
    from redeqx.models import generate
    from redeqx.steps._loss import cast_floats

    from benchmarks._common import gpu_devices
    from benchmarks._profile import loop_bytes, loop_copies

    device = gpu_devices(1, gpu)[0] if platform == "gpu" else compile_devices(1, platform == "tpu")[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    config = make_config(size, scan_layers=stacked, max_position_embeddings=PROMPT + new)
    model = eqx.filter_eval_shape(lambda: cast_floats(model_class(config)(config, key=jax.random.key(0)), jnp.bfloat16))
    model = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
                         if isinstance(a, jax.ShapeDtypeStruct) else a, model)
    prompt = jax.ShapeDtypeStruct((batch, PROMPT), jnp.int32, sharding=sharding)
    programs = {"prefill": lambda m, p: jax.vmap(lambda i: m.prefill(i, jnp.ones(i.shape, bool), new))(p),
                "generate": lambda m, p: generate(m, p, max_new_tokens=new)}
    out = {}
    for name, fn in programs.items():
        t = time.perf_counter()
        with jax.set_mesh(redeqx.make_mesh(1, devices=[device])):  # traced as for that device (`traced_platform`)
            lowered = jax.jit(fn).trace(model, prompt).lower(lowering_platforms=("cuda" if platform == "gpu" else platform,))
        compiled = lowered.compile()
        out[f"{name}_s"] = time.perf_counter() - t
    text = compiled.as_text()
    out["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
    out["fusions"], out["distinct_fusions"] = distinct_fusions(text)
    out.update(loop_copies(text))  # the loop over tokens: what one token's step copies
    if platform == "gpu":  # the static reader reads XLA:GPU's kernels (not libtpu's nested fusions)
        out["bytes_per_token"] = loop_bytes(text)
    return out


def measure(platform: str, size: str, repeats: int, batch: int = 1, slots: int = PROMPT + NEW) -> dict:
    python, env = gpu_compiler() if platform == "gpu" else compiler(platform == "tpu", 4 if platform == "tpu" else 1)
    runs = {"stacked": [], "listed": []}
    for r in range(repeats):
        for layout in (("stacked", "listed") if r % 2 == 0 else ("listed", "stacked")):
            runs[layout].append(worker(__file__, "compile_worker", python=python, env=env, platform=platform,
                                       size=size, stacked=layout == "stacked", batch=batch, new=slots - PROMPT))
    return {layout: {**got[0], "prefill_s": min(g["prefill_s"] for g in got),
                     "generate_s": min(g["generate_s"] for g in got)} for layout, got in runs.items()}


def table(results: dict, size: str, repeats: int, batch: int = 1, slots: int = PROMPT + NEW) -> str:
    seqs = "one sequence" if batch == 1 else f"{batch} sequences"
    rows = [f"The zoo LLaMA {size}, bf16 weights, {seqs}: a {PROMPT}-token prompt and {slots - PROMPT} new tokens, "
            f"traced and compiled on abstract shapes for one device, each layout in a fresh process (best of "
            f"{repeats}, taking turns):", "",
            "| compiler | layout | prompt's pass | whole generation | temporaries | fused computations (distinct) "
            "| copies a token (MiB) |", "|---|---|---|---|---|---|---|"]
    for platform, by_layout in results.items():
        for layout, v in by_layout.items():
            rows.append(f"| {COMPILERS[platform]} | {layout} | {v['prefill_s']:.1f} s "
                        f"| {v['generate_s']:.1f} s | {v['temp_bytes'] / 2**20:.1f} MiB | {v['fusions']} "
                        f"({v['distinct_fusions']}) | {v.get('copies_per_token', '?')} "
                        f"({v.get('copied_bytes_per_token', 0) / 2**20:.1f}) |")
    return "\n".join(rows)


def main():
    p = parser(__doc__, repeats=2)
    p.add_argument("--size", default="1b")
    p.add_argument("--compilers", default="cpu,tpu",
                   help="cpu (XLA:CPU), tpu (libtpu) and/or gpu (XLA:GPU for an H100: `python -m benchmarks.gpu_compile --setup`)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--slots", type=int, default=PROMPT + NEW, help=f"each sequence's cache slots (a {PROMPT}-token prompt)")
    args = p.parse_args()
    results = {platform: measure(platform, args.size, args.repeats, args.batch, args.slots)
               for platform in args.compilers.split(",")}
    shape = "" if (args.batch, args.slots) == (1, PROMPT + NEW) else f", {args.batch} sequences of {args.slots} slots"
    report(args, f"Decoding's compile, stacked against listed{shape} (benchmarks/decode_compile.py)",
           table(results, args.size, args.repeats, args.batch, args.slots))


if __name__ == "__main__":
    if not serve(globals()):
        sys.exit(main())
