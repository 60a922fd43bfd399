"""XLA:GPU's own programs for NVIDIA H100s, compiled here with no GPU attached (issue 51).

    python -m benchmarks.gpu_compile --setup             # once: benchmarks/.venv-gpu, JAX's CUDA plugin (3.7 GB)
    python -m benchmarks.gpu_compile                     # every section; writes RESULTS.md
    python -m benchmarks.gpu_compile --sections fp8 --no-write

JAX's CUDA plugin compiles for a GPU it is only described (`benchmarks._common.gpu_devices`: an
H100's target config), as libtpu compiles for a TPU slice here. Nothing runs. Without a card XLA
cannot autotune, so each GEMM gets its default kernel (a Triton GEMM; on a GPU the autotuner also
tries cuBLAS's) and everything else is the program a GPU gets. Each figure is read off the compiled
program (`benchmarks._profile`):

- ``train``: the 1B LLaMA step of `benchmarks.throughput` (batch 8 x 2048 tokens, AdamW, bf16
  compute): stacked, listed, stacked with fp8 products, stacked with the loss a user writes with
  optax on fp32 logits, stacked with each projection its own product (gate and up, Q, K and V: before
  `redeqx.models._layers.joined_linears`), and hand-written (``jax.jit`` + optax, the stacked
  model). For each: its kernels and the gigabytes they read and write by kind (`static_tally`),
  and what those bytes take at the H200's bandwidth: the floor of the time that is neither
  matmul nor attention (the H200's profile put 40.5 ms of its 221.5 ms step there); then the
  stacked and hand-written steps' bytes outside matmuls and attention by the function their
  kernels' code came from (`benchmarks._profile.source_of`);
- ``fp8``: `benchmarks.gpu`'s MLP block (`mlp_block`): its GEMMs and those with fp8 operands
  (6 expected), with Triton's GEMMs (the default) and with cuBLAS's (``--xla_gpu_enable_triton_gemm=false``);
- ``heads``: one 8B layer's attention (32 query, 8 KV heads) at 32k tokens over 4 context shards of
  4 H100s, forward and backward, for each ``impl``: cuDNN flash-attention calls, bytes per collective,
  temporaries, and the bytes its kernels read and write;
- ``context``: the zoo's 1B LLaMA step at 32k tokens over 8 context shards of 8 H100s (fsdp,
  remat, bf16), each ``context_attention``: `redeqx.plan`'s peak and bytes per collective
  (`benchmarks.long_context`'s case, by libtpu and XLA:CPU there);
- ``decode``: `benchmarks.decode_compile`'s 1B generation, stacked and listed: compile time here
  (2 cores; the first call's main cost on a GPU), and what the token loop copies per token;
- ``long_decode``: the same generation batched and long (8 sequences, 4,096 slots), where the KV
  cache is a third of the bytes a token reads: what one token's step reads and writes, by kind;
- ``moe_decode``: the 1B-active Mixtral-style model's generation (``moe1b``, one sequence), for an
  A100 (off the Hopper kernels: the grouped matmuls `redeqx.models._grouped` picks there) and an
  H100 (the Hopper kernels): what one token's step reads and writes, by kind.
"""

from __future__ import annotations

import re
import sys
import time

from benchmarks._common import HBM_BYTES_PER_S, gpu_compiler, parser, report, serve, setup_gpu, worker

SECTIONS = ("train", "fp8", "heads", "context", "decode", "long_decode", "moe_decode")
TRAIN = ("stacked", "listed", "stacked+fp8", "stacked, optax loss", "stacked, projections apart", "hand-written")
BATCH, SEQ = 8, 2048
GB = 1e9


def _cudnn_calls(text: str) -> int:
    return len(re.findall(r'custom_call_target="__cudnn\$fmha', text))


def optax_loss(model, batch, key):
    """The next-token loss as users write it with optax: the logits copied to fp32 first."""
    import jax
    import jax.numpy as jnp
    import optax

    logits = jax.vmap(model)(batch["ids"][:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


def _hand_written(model, optimizer, mesh, batch):
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from benchmarks.throughput import hand_written

    on = jax.sharding.NamedSharding(mesh, jax.P())
    trained = lambda x: isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
    params, static = eqx.partition(model, trained)
    placed = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on), tree)  # noqa: E731
    with jax.set_mesh(mesh):
        return hand_written(optimizer, static).lower(
            placed(params), placed(jax.eval_shape(optimizer.init, params)), placed(batch)).compile()


def train_worker(variant: str) -> dict:
    """One variant of the 1B step compiled for an H100: its kernels and bytes by kind."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import redeqx
    from benchmarks._common import gpu_devices, next_token_loss
    from benchmarks._profile import static_tally
    from benchmarks.throughput import make_config, model_class, products_apart

    mesh = redeqx.make_mesh(1, devices=gpu_devices(1))
    config = make_config("1b", max_position_embeddings=SEQ, scan_layers=not variant.startswith("listed"))
    optimizer = optax.adamw(1e-4, weight_decay=0.1)
    model = eqx.filter_eval_shape(lambda k: model_class(config)(config, key=k), jax.random.key(0))
    batch = {"ids": jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)}
    t = time.perf_counter()
    if variant == "hand-written":
        compiled = _hand_written(model, optimizer, mesh, batch)
    else:
        specs = redeqx.sharding_rules(model, mesh)
        state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
        loss = optax_loss if "optax" in variant else next_token_loss
        loss = products_apart(loss) if "apart" in variant else loss  # as before `joined_linears`
        step = redeqx.make_train_step(loss, optimizer, mesh, specs, compute_dtype=jnp.bfloat16, fp8="fp8" in variant)
        compiled = step.lower(state, batch).compile()
    text = compiled.as_text()
    return dict(compile_s=time.perf_counter() - t, temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                cudnn=_cudnn_calls(text), **static_tally(text, HBM_BYTES_PER_S["H200"], top=12))


def fp8_worker() -> dict:
    """`benchmarks.gpu.mlp_block`'s programs compiled for an H100: GEMMs, and those on fp8 operands."""
    import jax

    from benchmarks._common import gpu_devices
    from benchmarks._profile import gemms
    from benchmarks.gpu import mlp_block

    device = gpu_devices(1)[0]
    programs, args, _ = mlp_block(False, sharding=jax.sharding.SingleDeviceSharding(device))
    return {name: gemms(program.lower(*args).compile().as_text()) for name, program in programs.items()}


def heads_worker(impl: str, tokens: int = 32768, shards: int = 4) -> dict:
    """One 8B layer's attention over ``shards`` context shards of H100s, value and gradients of a
    weighted sum (the output's gradient an input, as in a step)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import redeqx
    from benchmarks._common import gpu_devices
    from benchmarks._profile import static_tally

    mesh = redeqx.make_mesh(1, n_context_shards=shards, devices=gpu_devices(shards))
    q, kv = (jax.ShapeDtypeStruct((1, tokens, h, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "context")))
             for h in (32, 8))

    def loss(q, k, v, w):
        return jnp.sum((redeqx.attention(q, k, v, causal=True, impl=impl) * w).astype(jnp.float32))

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, q).compile()
    text = compiled.as_text()
    return dict(cudnn=_cudnn_calls(text), temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                collectives={k: v["bytes"] for k, v in redeqx.collective_summary(text).items()},
                gb=static_tally(text, HBM_BYTES_PER_S["H200"])["gb"])


def context_worker(impl: str, tokens: int = 32768, shards: int = 8) -> dict:
    """The 1B step split over ``shards`` context shards of H100s, planned (`redeqx.plan`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, Mesh

    import redeqx
    from benchmarks._common import gpu_devices
    from benchmarks.throughput import make_config
    from redeqx import models

    grid = np.asarray(gpu_devices(shards), dtype=object).reshape(1, shards, 1)
    mesh = Mesh(grid, ("data", "context", "model"), axis_types=(AxisType.Auto,) * 3)
    config = make_config("1b", max_position_embeddings=tokens, context_attention=impl)

    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["input_ids"])
        return models.cross_entropy(logits, batch["labels"], ignore_index=None)

    batch = {k: jax.ShapeDtypeStruct((1, tokens), jnp.int32) for k in ("input_ids", "labels")}
    p = redeqx.plan(lambda key: models.LlamaForCausalLM(config, key=key), loss_fn, optax.adamw(1e-5), batch, mesh,
                    fsdp=True, remat=True, compute_dtype=jnp.bfloat16, device_memory="80GB", explore=False,
                    seq_keys=("input_ids", "labels"))
    return dict(peak=p.peak, temporaries=p.temporaries, collectives={k: v["bytes"] for k, v in p.collectives.items()})


# ----------------------------------------------------------------------------- the driver (no JAX)

def _run(fn: str, flags: str = "", **kwargs) -> dict:
    python, env = gpu_compiler()
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {flags}".strip()
    got = worker(__file__, fn, python=python, env=env, **kwargs)
    print(fn, kwargs, flags, str(got)[:300], file=sys.stderr, flush=True)
    return got


def train_section() -> str:
    runs = {v: _run("train_worker", variant=v) for v in TRAIN}
    kinds = [k for k in ("norms and elementwise", "loss", "optimizer update", "copies", "collectives")
             if any(k in r["gb"] for r in runs.values())]
    rows = [f"The 1B LLaMA step (`benchmarks.throughput`'s, batch {BATCH} x {SEQ} tokens, AdamW, bf16 compute), "
            "compiled by XLA:GPU for one H100 with no GPU attached (no autotuning: Triton's default GEMMs). "
            "Gigabytes each kind of kernel reads and writes per step (kernels in brackets); the last column is "
            "what all kinds but matmuls and attention move, in milliseconds at the H200's 4.8 TB/s (a floor: "
            "the H200's profile measured 40.5 ms there):", "",
            "| variant | compile | temporaries | cuDNN attention | matmuls | " + " | ".join(kinds) + " | floor |",
            "|---" * (6 + len(kinds)) + "|"]
    for v, r in runs.items():
        rest = sum(r["gb"].get(k, 0) for k in kinds)
        rows.append(f"| {v} | {r['compile_s']:.1f} s | {r['temp_bytes'] / 2**30:.1f} GiB | {r['cudnn']} | "
                    f"{r['gb'].get('matmuls', 0):.1f} ({r['kernels'].get('matmuls', 0)}) | "
                    + " | ".join(f"{r['gb'].get(k, 0):.1f} ({r['kernels'].get(k, 0)})" for k in kinds)
                    + f" | {rest * GB / HBM_BYTES_PER_S['H200'] * 1e3:.1f} ms |")
    rows += _by_source_table(runs["stacked"], runs["hand-written"])
    rows += ["", "The stacked step's largest kernels outside matmuls and attention (GB per step, the functions "
             "their code came from):", "", "| kernel | kind | GB | from |", "|---|---|---|---|"]
    rows += [f"| `{t['op']}` | {t['kind']} | {t['gb']:.2f} | {' < '.join(t['frames'][:2])} |"
             for t in runs["stacked"]["top"] if t["kind"] not in ("matmuls", "attention")][:8]
    return "\n".join(rows)


def _by_source_table(ours: dict, hand: dict, top: int = 12) -> list[str]:
    """The stacked step's bytes outside matmuls and attention by the function its kernels came from
    (`benchmarks._profile.source_of`), beside the hand-written step's; then the hand-written step's
    own functions (its optimizer update, which its step's frame names)."""
    theirs = {(r["kind"], r["function"]): r for r in hand["by_source"]}
    rows = ["", "Where those bytes come from: the stacked step's kernels outside matmuls and attention by the "
            "function their code came from (a fusion is named after its root's), GB per step (kernels), beside "
            "the hand-written step's:", "", "| function | kind | stacked | hand-written |", "|---|---|---|---|"]
    cell = lambda r: f"{r['gb']:.2f} ({r['kernels']})" if r else ""  # noqa: E731
    shown = ours["by_source"][:top]
    for r in shown:
        rows.append(f"| `{r['function']}` | {r['kind']} | {cell(r)} | {cell(theirs.get((r['kind'], r['function'])))} |")
    seen = {(r["kind"], r["function"]) for r in shown}
    rows += [f"| `{r['function']}` | {r['kind']} | | {cell(r)} |" for r in hand["by_source"]
             if (r["kind"], r["function"]) not in seen and r["gb"] >= 0.1]
    return rows


def fp8_section() -> str:
    runs = {"Triton (default)": _run("fp8_worker"), "cuBLAS": _run("fp8_worker", "--xla_gpu_enable_triton_gemm=false")}
    rows = ["`benchmarks.gpu`'s fp8 MLP block (4096 -> 14336 -> 4096, 16,384 tokens, value and gradients), compiled "
            "for one H100: GEMMs, those with fp8 operands in brackets (expected: 6 with `fp8_dot`, 3 a linear):", "",
            "| GEMM kernels | bf16 products | fp8 products |", "|---|---|---|"]
    rows += [f"| {k} | {r['bf16']['gemms']} ({r['bf16']['fp8_gemms']}) | {r['fp8']['gemms']} ({r['fp8']['fp8_gemms']}) |"
             for k, r in runs.items()]
    return "\n".join(rows)


def _moved(collectives: dict, unit: int, digits: int) -> str:
    """``all-gather 5.06, ... (total 9.84)``: bytes by collective in ``unit``s, those under 1 % of a unit left out."""
    parts = ", ".join(f"{k} {v / unit:.{digits}f}" for k, v in sorted(collectives.items()) if v >= unit / 100)
    return f"{parts} (total {sum(collectives.values()) / unit:.{digits}f})"


def _per_impl(fn: str, intro: str, columns: tuple[str, ...], cells) -> str:
    """A table of ``fn``'s figures for each context ``impl``: ``cells(figures)`` fills a row's columns."""
    rows = [intro, "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    rows += [f"| {impl} | {cells(_run(fn, impl=impl))} |" for impl in ("heads", "gather", "ring")]
    return "\n".join(rows)


def heads_section() -> str:
    return _per_impl(
        "heads_worker", "One 8B layer's attention (32 query, 8 KV heads of 128) at 32,768 tokens over 4 context "
        "shards of 4 H100s, value and gradients, compiled by XLA:GPU:",
        ("impl", "cuDNN attention calls", "collectives, MiB a device", "temporaries",
         "GB its kernels read and write (copies)"),
        lambda r: f"{r['cudnn']} | {_moved(r['collectives'], 2**20, 0)} | {r['temp_bytes'] / 2**20:.0f} MiB | "
                  f"{sum(r['gb'].values()):,.1f} ({r['gb'].get('copies', 0):,.1f})")


def context_section() -> str:
    return _per_impl(
        "context_worker", "The zoo's 1B LLaMA step (TinyLlama's shapes: 32 query, 4 KV heads) at 32,768 tokens over "
        "8 context shards of 8 H100s, fsdp, remat, bf16 compute, planned by `redeqx.plan` on XLA:GPU's program:",
        ("context_attention", "peak a device", "collectives, GiB a device"),
        lambda r: f"{r['peak'] / 2**30:.1f} GiB | {_moved(r['collectives'], 2**30, 2)}")


DECODE_OPTIONS = {"Triton GEMMs (default)": "", "cuBLAS GEMMs": "--xla_gpu_enable_triton_gemm=false",
                  "cuBLAS, no dot merger": "--xla_gpu_enable_triton_gemm=false --xla_gpu_dot_merger_threshold_mb=0"}


def decode_section() -> str:
    from benchmarks import decode_compile

    rows = [f"`benchmarks.decode_compile`'s 1B generation (bf16 weights, a {decode_compile.PROMPT}-token prompt, "
            f"{decode_compile.NEW} new tokens) compiled for one H100: the compile here (2 cores), and the copy "
            "kernels one token's step runs and the MiB they read and write (the weights are 2,100 MiB):", "",
            "| GEMM kernels | layout | whole generation's compile | temporaries | copies a token (MiB) |",
            "|---|---|---|---|---|"]
    for label, flags in DECODE_OPTIONS.items():
        python, env = gpu_compiler()
        env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {flags}".strip()
        for layout in ("stacked", "listed"):
            r = worker(decode_compile.__file__, "compile_worker", python=python, env=env, platform="gpu",
                       size="1b", stacked=layout == "stacked")
            rows.append(f"| {label} | {layout} | {r['generate_s']:.1f} s | {r['temp_bytes'] / 2**20:.0f} MiB | "
                        f"{r['copies_per_token']} ({r['copied_bytes_per_token'] / 2**20:.1f}) |")
    return "\n".join(rows)


LONG_BATCH, LONG_SLOTS = 8, 4096


def _token_table(intro: str, cases: dict[tuple[str, ...], dict]) -> str:
    """A table of what one token's step of `benchmarks.decode_compile`'s generation reads and writes,
    by kind: one row per case, its label cells and ``compile_worker``'s arguments (platform "gpu")."""
    from benchmarks import decode_compile

    python, env = gpu_compiler()
    kinds = ("matmuls", "norms and elementwise", "copies")
    labels = len(next(iter(cases)))
    rows = [intro, "", "| " + " | ".join(("GPU", "layout")[-labels:]) + " | compile | temporaries | "
            + " | ".join(kinds) + " | total |", "|---" * (labels + 3 + len(kinds)) + "|"]
    for label, kwargs in cases.items():
        r = worker(decode_compile.__file__, "compile_worker", python=python, env=env, platform="gpu", **kwargs)
        moved = r["bytes_per_token"]
        rows.append("| " + " | ".join(label) + f" | {r['generate_s']:.1f} s | {r['temp_bytes'] / 2**20:,.0f} MiB | "
                    + " | ".join(f"{moved.get(k, 0) / 2**20:,.1f}" for k in kinds)
                    + f" | {sum(moved.values()) / 2**20:,.1f} |")
    return "\n".join(rows)


def long_decode_section() -> str:
    from benchmarks.decode_compile import PROMPT

    # layers x sequences x slots x (K, V) x heads x dim x bf16
    cache = 22 * LONG_BATCH * LONG_SLOTS * 2 * 4 * 64 * 2 / 2**20
    return _token_table(
        f"The same 1B generation for {LONG_BATCH} sequences with {LONG_SLOTS:,} slots each (a {PROMPT}-token "
        "prompt), compiled for one H100 (Triton's GEMMs): MiB one token's step reads and writes, by kind (the "
        f"weights are 2,100 MiB, the KV cache {cache:,.0f} MiB):",
        {(layout,): dict(size="1b", stacked=layout == "stacked", batch=LONG_BATCH, new=LONG_SLOTS - PROMPT)
         for layout in ("stacked", "listed")})


def moe_decode_section() -> str:
    from benchmarks.decode_compile import NEW, PROMPT

    return _token_table(
        f"`moe1b`'s generation (22 layers of 8 experts, top-2; 3.4 B parameters, 1.1 B active; bf16, a {PROMPT}-token "
        f"prompt, {NEW} new tokens), compiled for one GPU of each kind: MiB one token's step reads and writes, by "
        "kind (the weights are 6,455 MiB, a token's active ones about 2,100; a Hopper kernel's call is counted as "
        "reading all its operands, every expert, which the kernel does not):",
        {(gpu, layout): dict(size="moe1b", stacked=layout == "stacked", gpu=gpu)
         for gpu, layout in (("A100", "stacked"), ("A100", "listed"), ("H100", "stacked"))})


def main():
    p = parser(__doc__)
    p.add_argument("--setup", action="store_true", help="create benchmarks/.venv-gpu (JAX's CUDA plugin) and exit")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    args = p.parse_args()
    if args.setup:
        return setup_gpu()
    names = args.sections.split(",")
    if set(names) != set(SECTIONS) and not args.no_write:  # the section is written whole: a part would drop the rest
        print("only some sections: printed, not written to RESULTS.md", file=sys.stderr)
        args.no_write = True
    parts = {name: globals()[f"{name}_section"]() for name in names}
    report(args, "XLA:GPU's programs for H100s, compiled here (benchmarks/gpu_compile.py)", "\n\n".join(parts.values()))


if __name__ == "__main__":
    if not serve(globals()):
        sys.exit(main())
