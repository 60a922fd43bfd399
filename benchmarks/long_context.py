"""Long context: how long a training sequence fits with and without context
parallelism, planned on abstract shapes (nothing allocated, no TPU needed).

    python -m benchmarks.long_context              # TPU v4 via libtpu (benchmarks/.venv-tpu), else XLA:CPU
    python -m benchmarks.long_context --sizes 8b   # the 8B searches only
    python -m benchmarks.long_context --cached-only   # compile nothing: the section from the cached probes

Each probe is one `redeqx.plan(..., explore=False)` of a LLaMA-3-shaped model
(bf16 compute, fp32 master weights, AdamW, remat, fsdp over data x context),
one sequence a step, in a worker: libtpu for a TPU v4 slice (32 GiB a chip)
when benchmarks/.venv-tpu exists, else XLA:CPU against the same 32 GiB.
Probes are cached in ``--cache``; the longest sequence is found by doubling.
`redeqx.attention`'s collectives are compared with the analytic count.
"""

from __future__ import annotations

import json

from benchmarks._common import (HERE, NotProbed, Probes, compile_devices, compiled_figures, compiler, parser,
                                probe_options, probes_for, report, serve, worker)

MEMORY = 32 * 2**30  # a TPU v4 chip
SIZES = {  # LLaMA-3 shapes (vocab 128256, GQA with 8 KV heads)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32),  # 3.2-1B
}
# per size: chips, then (context, model, the search's first length); context 0 = no context axis
CASES = {"8b": (8, [(8, 1, 32768), (0, 8, 8192), (1, 8, 16384)]), "70b": (64, [(8, 8, 65536), (0, 8, 8192), (1, 8, 8192)])}


# ----------------------------------------------------------------------------- worker (imports JAX)

def probe(task: dict) -> dict:
    """A plan's figures (kind "plan") or redeqx.attention's collectives (kind "attention")."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

    import redeqx
    from redeqx import models
    from redeqx.planner._hlo import loop_factor

    devices, c, t = compile_devices(task["chips"], task["tpu"]), task["context"], task["seq"]
    if task.get("kernel") is False:  # the TPU's splash kernel left out (this worker's process only)
        from redeqx.context import _tpu

        _tpu.kernel_runs = lambda *a: False
    if task["kind"] == "attention":  # value and grads on one 8B layer's shapes
        mesh = redeqx.make_mesh(1, n_context_shards=c, devices=devices)
        q, kv = (jax.ShapeDtypeStruct((1, t, h, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "context")))
                 for h in (32, 8))
        window = task.get("window")
        # weighted: the output's gradient an input (a real step's), not the constant of a plain sum, which
        # the compiler folds, with the heads split's trades of the output and of its gradient (the value
        # taken too, so the output's trade is not dead code)
        def attend(q, k, v):
            return redeqx.attention(q, k, v, causal=task.get("causal", True), window=window, impl=task["impl"])

        if task.get("weighted"):  # the value too: the output's trade is live
            args, grad = (q, kv, kv, q), jax.value_and_grad
            loss = lambda q, k, v, w: jnp.sum((attend(q, k, v) * w).astype(jnp.float32))  # noqa: E731
        else:
            args, grad = (q, kv, kv), jax.grad
            loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))  # noqa: E731
        with jax.set_mesh(mesh):
            compiled = jax.jit(grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
        text = compiled.as_text()  # FLOPs with every loop counted per iteration, as plan counts them
        figures = compiled_figures(compiled)
        out = dict(collectives=redeqx.collective_summary(text), flops=figures["flops"] * loop_factor(text),
                   temporaries=figures["temporaries"], kernel="tpu_custom_call" in text)
        if window is not None:  # the blocks each shard computes, and the table entries its loops walk
            out.update(_window_blocks(t, c, window, task["impl"]))
        return out
    config = models.LlamaConfig(vocab_size=128256, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=t,
                                context_attention=task["impl"], **SIZES[task["size"]])
    if c == 0:  # today's path: no context axis at all
        mesh, seq_keys = redeqx.make_mesh(task["model"], devices=devices), ()
    else:  # a context axis, of size 1 included (the blocked attention, no split)
        grid = np.asarray(devices, dtype=object).reshape(-1, c, task["model"])
        mesh, seq_keys = Mesh(grid, ("data", "context", "model"), axis_types=(AxisType.Auto,) * 3), ("input_ids", "labels")

    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["input_ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"]).mean()

    batch = {k: jax.ShapeDtypeStruct((mesh.shape["data"], t), jnp.int32) for k in ("input_ids", "labels")}
    start = time.perf_counter()
    p = redeqx.plan(lambda key: models.LlamaForCausalLM(config, key=key), loss_fn, optax.adamw(1e-5), batch, mesh,
                    fsdp=True, remat=True, compute_dtype=jnp.bfloat16, device_memory=MEMORY, explore=False,
                    seq_keys=seq_keys)
    return dict(fits=bool(p.fits), peak=p.peak, temporaries=p.temporaries, flops=p.flops, collectives=p.collectives,
                refused=getattr(p, "refused", None), compile_s=time.perf_counter() - start)


def _window_blocks(t: int, c: int, window: int, impl: str) -> dict:
    """Per context shard: the (query block, key block) pairs a sliding window
    leaves to compute (fewest, most), and the table entries the loops walk
    (the padding skipped)."""
    from redeqx.context._blockwise import Span, _pairs
    from redeqx.context._context import block_layout

    b, layout = block_layout(t, c)
    span = Span(True, window)
    if impl == "gather":
        everyone = [blk for row in layout for blk in row]
        real = [len(_pairs(mine, everyone, span, b)) for mine in layout]
        return dict(real=(min(real), max(real)), walked=max(real))
    hops = [[len(_pairs(layout[i], layout[(i - h) % c], span, b)) for i in range(c)] for h in range(c)]
    real = [sum(hop[i] for hop in hops) for i in range(c)]
    return dict(real=(min(real), max(real)), walked=max(hops[0]) + (c - 1) * max(max(h) for h in hops[1:]))


# ----------------------------------------------------------------------------- driver (no JAX)

def _worker(tpu: bool):
    def run(task):
        python, env = compiler(tpu, task["chips"])
        return worker(__file__, "probe", python=python, env=dict(env, PYTHONWARNINGS="ignore::UserWarning"), task=task)
    return run


def longest(run: Probes, size: str, context: int, model: int, start: int):
    """The longest power-of-two multiple of 1024 tokens that fits (searched from ``start``, up or down), and its
    plan; with probes missing (--cached-only), the longest that fits among those made, and None."""
    probe = lambda seq: run(kind="plan", size=size, chips=CASES[size][0], context=context, model=model, seq=seq,  # noqa: E731
                            impl="gather")
    try:
        seq, p = start, probe(start)
        step = 2 if p["fits"] else 0.5
        while (nxt := int(seq * step)) >= 1024:
            q = probe(nxt)
            if q["fits"] != p["fits"]:
                return (seq, p) if step == 2 else (nxt, q)
            seq, p = nxt, q
        return 0, None
    except NotProbed:
        tasks = [(json.loads(k), v) for k, v in run.cache.items()]
        fit = [t["seq"] for t, v in tasks if v.get("fits") and t["kind"] == "plan"
               and (t["size"], t["context"], t["model"]) == (size, context, model)]
        return max(fit, default=0), None


def gib(n) -> str:
    return f"{n / 2**30:.1f}"


def main():
    if serve(globals()):
        return
    p = parser(__doc__)
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=sorted(SIZES),
                   help="8b: the 8-chip searches, the C table and attention's bytes; 70b: the 64-chip searches")
    probe_options(p, HERE / "results" / "long_context_probes.json")
    args = p.parse_args()
    run, tpu = probes_for(args, _worker)
    compiler = "libtpu, TPU v4 (32 GiB a chip)" if tpu else "XLA:CPU's buffer assignment, against 32 GiB a device"
    lines = [f"Planned on abstract shapes by {compiler}: LLaMA-3-shaped models (vocab 128256, 8 KV heads), bf16 "
             "compute, fp32 weights + AdamW, remat, fsdp over data x context, one sequence per data row "
             "(the 70B without context parallelism: data 8 x model 8, 8 sequences a step, each on its own 8 chips). "
             "`today` is a mesh without a context axis (the zoo's unsplit attention, which forms the (T, T) "
             "scores off a GPU); `C=1` a context axis of one device (the blocked attention, nothing split).", "",
             "| model | chips | mesh (context x model) | longest sequence | peak GiB | temporaries GiB |",
             "|---|---|---|---|---|---|"]
    found, summary, sizes = {}, [], [s for s in CASES if s in args.sizes]
    for size in sizes:
        for c, m, start in CASES[size][1]:
            found[c, m], p = longest(run, size, c, m, start)
            lines.append(f"| {size} | {CASES[size][0]} | {'today, model 8' if c == 0 else f'{c} x {m}'} | "
                         f"{found[c, m] if p else f'≥ {found[c, m]} (search unfinished)'} | "
                         f"{gib(p['peak']) if p else '-'} | {gib(p['temporaries']) if p else '-'} |")
        best, blocked, today = found[8, CASES[size][1][0][1]], found[1, 8], found[0, 8]
        summary.append(f"\n{size}: context parallelism fits {best} tokens: {best / max(blocked, 1):.0f}x the {blocked} "
                       f"of the same blocked attention unsplit, {best / max(today, 1):.0f}x the {today} of today's "
                       "unsplit path.")
    lines += summary
    if "8b" in sizes:
        lines += _attention_bytes(run), _causal_flops(run), _window_flops(run), _per_c(run), _ring_step(run)
    if "1b" in args.sizes:
        lines.append(_impls_1b(run))
    if tpu and "1b" in args.sizes:
        lines.append(_tpu_kernel(run))
    report(args, "Long context (benchmarks/long_context.py)", "\n".join(lines))


def _probe(run: Probes, task):
    """``run.get(**task)`` (a list of them for a list)."""
    return [run.get(**t) for t in task] if isinstance(task, list) else run.get(**task)


def _rows(run: Probes, head: list[str], cases, row) -> str:
    """A table: ``row(case, probe)`` for each case."""
    return "\n".join(line for line in [*head, *(row(case, _probe(run, task)) for case, task in cases)] if line is not None)


def _per_c(run: Probes) -> str:
    """Activation memory and FLOPs per token of the 8B at 32k tokens, for C = 1, 2, 4, 8 (model = 8 / C)."""
    first = []

    def row(c, p):
        if p is None:
            return f"| {c} | not probed | | |"
        first.append(per_token := p["flops"] * 8 / 32768)
        return f"| {c} | {gib(p['temporaries'])} | {per_token:.3e} | {per_token / first[0]:.3f} |"
    cases = [(c, dict(kind="plan", size="8b", chips=8, context=c, model=8 // c, seq=32768, impl="gather"))
             for c in (1, 2, 4, 8)]
    return _rows(run, ["", "8B at 32768 tokens on 8 chips, C context shards x 8/C model shards:", "",
                       "| C | temporaries GiB / device | FLOPs per token (all devices) | vs C=1 |", "|---|---|---|---|"],
                 cases, row) + (
        "\n\nTemporaries hold the layers' saved inputs (split by C) and also what C does not split: the fp32 "
        "gradients (fsdp: 1/8 of them on every mesh) and the vocabulary-wide logits (split 8 ways either "
        "way). FLOPs per token are XLA's count with loops counted per iteration.")


def _causal_flops(run: Probes) -> str:
    """redeqx.attention's FLOPs per device, causal against unmasked: the skipped blocks."""
    t = 32768

    def row(c, p):
        m = t // (2 * c) // min(t // (2 * c), 1024)  # blocks to a chunk
        return p[0] and p[1] and (f"| {c} | {p[0]['flops']:.3e} | {p[1]['flops']:.3e} | "
                                  f"{p[0]['flops'] / p[1]['flops']:.3f} | {(2 * c * m * m + m) / (4 * c * m * m):.3f} |")
    base = dict(kind="attention", seq=t, impl="gather")
    cases = [(c, [dict(base, chips=c, context=c, causal=causal) for causal in (True, False)]) for c in (2, 8)]
    return _rows(run, ["", f"redeqx.attention's FLOPs per device (value and grads, {t} tokens, as above), causal "
                       "against unmasked:", "", "| C | causal | unmasked | ratio | blocks computed (2C m² + m) / 4C m² |",
                       "|---|---|---|---|---|"], cases, row)


def _window_flops(run: Probes) -> str:
    """redeqx.attention with a sliding window against the causal one: blocks computed and FLOPs."""
    t, c, w = 32768, 8, 4096
    blocks = 2 * c * (t // (2 * c) // 1024) ** 2 + t // (2 * c) // 1024  # causal: (2C m² + m) a shard

    def row(case, p):
        impl, window = case
        if p is None:
            return None
        real, walked = (f"{p['real'][0]}-{p['real'][1]}", p["walked"]) if window else (blocks, blocks)
        return f"| {impl} | {window or 'none (causal)'} | {real} | {walked} | {p['flops']:.3e} |"
    cases = [((impl, window), dict(kind="attention", chips=c, context=c, seq=t, impl=impl, causal=True,
                                   **({"window": window} if window else {})))
             for impl in ("gather", "ring") for window in (None, w)]
    return _rows(run, ["", f"redeqx.attention with a sliding window of {w} tokens ({t} tokens, C={c}, value and "
                       "grads, as above): blocks of 1024 x 1024 computed by a shard, table entries its loops walk "
                       "(padding skipped by a conditional), and the FLOPs XLA counts, each walked entry as computed:",
                       "", "| impl | window | blocks computed a shard | entries walked | FLOPs counted |",
                       "|---|---|---|---|---|"], cases, row)


def _ring_step(run: Probes) -> str:
    """The 8B step at 65536 tokens on 8 context shards, K/V gathered or passed around the ring."""
    def row(impl, p):
        col = [gib(p["collectives"].get(k, {}).get("bytes", 0)) if p else ""
               for k in ("all-gather", "collective-permute", "all-reduce", "all-to-all")]
        return p and f"| {impl} | {gib(p['peak'])} | {gib(p['temporaries'])} | {' | '.join(col)} |"
    cases = [(impl, dict(kind="plan", size="8b", chips=8, context=8, model=1, seq=65536, impl=impl))
             for impl in ("gather", "ring", "heads")]
    return _rows(run, ["", "8B step at 65536 tokens, 8 context shards: gathered K/V, the ring, and the heads split:", "",
                       "| impl | peak GiB | temporaries GiB | all-gather GiB | collective-permute GiB | all-reduce GiB "
                       "| all-to-all GiB |", "|---|---|---|---|---|---|---|"], cases, row)


def _impls_1b(run: Probes) -> str:
    """The 1B step at 32768 tokens on 8 context shards by each impl: collective bytes and memory."""
    kinds = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")

    def row(impl, p):
        if not p:
            return None
        by = [p["collectives"].get(k, {}).get("bytes", 0) for k in kinds]
        return (f"| {impl} | {gib(sum(by))} | " + " | ".join(gib(b) for b in by)
                + f" | {gib(p['peak'])} | {gib(p['temporaries'])} |")
    cases = [(impl, dict(kind="plan", size="1b", chips=8, context=8, model=1, seq=32768, impl=impl))
             for impl in ("gather", "ring", "heads")]
    return _rows(run, ["", "LLaMA-3.2-1B-shaped step (16 layers, hidden 2048, 32 query / 8 KV heads of 64) at 32768 "
                       "tokens, 8 context shards, one sequence a step: GiB a device per step by kind of collective:",
                       "", "| impl | all | all-gather | all-reduce | reduce-scatter | collective-permute | all-to-all "
                       "| peak | temporaries |", "|---|---|---|---|---|---|---|---|---|"], cases, row)


def _tpu_kernel(run: Probes) -> str:
    """The TPU's splash kernel against the paths without it: the 1B step on one chip (the scores
    formed), and the heads split's attention alone on 8 chips (attended a block at a time)."""
    def row(case, p):
        what, kernel = case
        if not p:
            return None
        plan = (f"{'fits' if p['fits'] else 'does not fit'}, peak {gib(p['peak'])} GiB" if "fits" in p
                else f"kernel call in the program: {'yes' if p['kernel'] else 'no'}")
        return f"| {what} | {'splash kernel' if kernel else 'without it'} | {plan} | {p['temporaries'] / 2**20:,.0f} |"
    cases = [((f"1B step, one chip, {t} tokens", kernel),
              dict(kind="plan", size="1b", chips=1, context=0, model=1, seq=t, impl="gather", kernel=kernel))
             for t in (4096, 8192) for kernel in (True, False)]
    cases += [(("heads split, one 8B layer's attention, 32768 tokens, C=8", kernel),
               dict(kind="attention", chips=8, context=8, seq=32768, impl="heads", weighted=True, kernel=kernel))
              for kernel in (True, False)]
    return _rows(run, ["", "The TPU's attention kernel (Pallas splash attention), where nothing is left to the "
                       "partitioner: one chip (the zoo's causal attention; without it the (T, T) scores are formed), "
                       "and the heads split on a mesh of context alone (without it, the gather's blockwise loop):",
                       "", "| case | attention | plan (a step) or program (attention) | temporaries MiB |", "|---|---|---|---|"],
                 cases, row)


def _attention_bytes(run: Probes) -> str:
    """Collective bytes of redeqx.attention (forward + backward, one 8B layer) against the analytic count."""
    t, c, kv, tok = 32768, 8, 8 * 128 * 2, 4  # bf16 K (or V) bytes per token; an int32 position or segment
    local = t // c
    analytic = {  # per device, bytes of each collective's result
        # all-gather K, V, positions (segments: a constant here); backward: dK, dV reduced back
        "gather": t * (2 * kv + tok) + local * 2 * kv,
        # forward C - 1 hops of K, V, positions, segments; backward C hops of those and dK, dV in f32
        "ring": (c - 1) * local * (2 * kv + 2 * tok) + c * local * (2 * kv + 2 * tok + 2 * 2 * kv),
        # libtpu writes every psum_scatter as an all-reduce of the whole array (a plain one too, on this slice)
        "gather, reduce as all-reduce": t * (2 * kv + tok) + t * 2 * kv,
        # all-to-all of q, k, v to heads and the output back (q's and the output's T / C x 32 heads x 128 x
        # 2 B, 4x K's), then the output's gradient to heads and dq, dk, dv back
        "heads": 2 * local * (4 * kv + kv + kv + 4 * kv),
    }

    def row(name, p):
        s = p and p["collectives"]
        total = s and sum(v["bytes"] for v in s.values())
        kinds = s and ", ".join(f"{k} x{v['count']}" for k, v in sorted(s.items()))
        v = analytic[name]
        return s and f"| {name} | {kinds} | {total / 2**20:.1f} | {v / 2**20:.1f} | {total / v:.2f} |"
    cases = [(name, dict(kind="attention", chips=c, context=c, seq=t, impl=name.split(",")[0], weighted=True))
             for name in analytic]
    return _rows(run, ["", f"redeqx.attention alone (value and grads of sum(attention x w), {t} tokens, 32 query / 8 KV heads of 128, bf16, "
                       f"C={c}): collective bytes per device against the analytic K/V count:", "",
                       "| impl | collectives | measured MiB | analytic MiB | ratio |", "|---|---|---|---|---|"],
                 cases, row) + (
        "\n\nThe gather's gradient reduce-scatter counts its result (T / C tokens); a compiler that writes it "
        "as an all-reduce of the gathered size (libtpu does so for every psum_scatter on this slice, a plain "
        "one included) shows the gathered size there instead.")


if __name__ == "__main__":
    main()
