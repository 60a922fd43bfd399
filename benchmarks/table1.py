"""redco's Table 1, reproduced by the planner: does each model train (fp32
weights, AdamW) in the stated device memory, and what would fsdp + remat +
bf16 compute buy?

    python -m benchmarks.table1 --extrapolate 2 4 --cache benchmarks/results/table1_probes.json  # RESULTS.md's run
    python -m benchmarks.table1 --rows gpt2-large --quick # 2 layers of the same widths, no searches (the test's run)
    python -m benchmarks.table1 --setup-tpu               # once: benchmarks/.venv-tpu with libtpu (~140 MB)
    python -m benchmarks.table1 --compiler tpu-v4 --cache benchmarks/results/table1_probes.json  # the TPU rows

Each probe is one `redeqx.plan(..., explore=False)` in a fresh process with
that many simulated CPU devices (``--compiler tpu-v4``: libtpu's compiler for
redco's TPU v4 slice, ahead of time). Per row: the redco setting (every device
on ``model``, one sequence per data shard, fp32) against the stated memory;
then with fsdp + remat + bf16, (a) the fewest devices (powers of two) that fit
and (b) the longest sequence (multiples of 128) on redco's devices, or at a
learned position table's length the largest batch per data shard.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from benchmarks._common import (FAST_COMPILE, TPU_V4_SLICES, Probes, compile_devices, compiler, param_count, parser,
                                report, serve, setup_tpu, worker)

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    name: str
    server: str
    devices: int
    memory: str  # as the paper states it
    seq: int  # the maximum length in training, from Table 1
    n_model_shards: int
    kind: str  # "causal", "t5" or "bart"
    config: dict  # the Hugging Face config's sizes, as redeqx.models config fields
    max_len: int | None  # learned position table: no longer sequence exists
    why: str = ""  # why this n_model_shards
    extrapolate: tuple[int, int] | None = None  # too large to compile whole here: plan these layer counts

    @property
    def memory_bytes(self) -> float:
        return float(self.memory.rstrip("GB")) * GB


ROWS = {r.key: r for r in [
    Row("gpt2-large", "GPT2-Large", "2 x 1080Ti", 2, "10GB", 512, 2, "causal",
        dict(cls="GPT2", n_embd=1280, n_layer=36, n_head=20, vocab_size=50257, n_positions=1024), 1024),
    Row("bart-large", "BART-Large", "2 x 1080Ti", 2, "10GB", 1024, 2, "bart",
        dict(cls="Bart", d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
             decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=50265,
             max_position_embeddings=1024), 1024),
    Row("llama-7b", "LLaMA-7B", "4 x A100", 4, "40GB", 1024, 4, "causal",
        dict(cls="Llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
             num_attention_heads=32, max_position_embeddings=2048), None),
    Row("gpt-j-6b", "GPT-J-6B", "4 x A100", 4, "40GB", 1024, 4, "causal",
        dict(cls="GPTJ", vocab_size=50400, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, n_positions=2048), None),
    Row("t5-xxl", "T5-XXL-11B (v1.1)", "2 x TPU-v4 (2 hosts x 4 chips)", 8, "32GB", 512, 8, "t5",
        dict(cls="T5", d_model=4096, d_ff=10240, num_layers=24, num_decoder_layers=24, num_heads=64, d_kv=64,
             vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False), None),
    Row("opt-13b", "OPT-13B", "2 x TPU-v4 (2 hosts x 4 chips)", 8, "32GB", 1024, 8, "causal",
        dict(cls="OPT", hidden_size=5120, num_hidden_layers=40, ffn_dim=20480, num_attention_heads=40,
             vocab_size=50272, max_position_embeddings=2048), 2048),
    Row("opt-66b", "OPT-66B", "16 x TPU-v4 (16 hosts x 4 chips)", 64, "32GB", 512, 8, "causal",
        dict(cls="OPT", hidden_size=9216, num_hidden_layers=64, ffn_dim=36864, num_attention_heads=72,
             vocab_size=50272, max_position_embeddings=2048),
        2048, why="72 heads: 8 divides them, 16, 32 and 64 do not (redeqx splits attention on whole heads, so those "
            "would replicate Q/K/V/O); data parallel over the other 8",
        extrapolate=(2, 4)),
]}
SLOW = {"opt-66b"}
LAYER_FIELDS = ("n_layer", "num_hidden_layers", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")


def floor_bytes(params: float, n_devices: int) -> float:
    """fp32 weights 4 + gradients 4 + Adam 8 bytes per parameter over every
    device (fsdp); not strict: XLA frees each gradient once it is applied."""
    return 16 * params / n_devices


def resident_bytes(params: float, n_devices: int) -> float:
    """fp32 weights 4 + Adam 8 bytes per parameter over every device: alive
    through the whole step, so a count where they exceed the memory cannot fit."""
    return 12 * params / n_devices


def _model_and_loss(row: Row):
    """(model_maker(layers), loss_fn, batch_of(n_rows, seq)) of a row's model."""
    import jax
    import jax.numpy as jnp
    import optax
    from redeqx import models

    config = dict(row.config)
    cls = config.pop("cls")
    config_cls = getattr(models, f"{cls}Config")
    model_cls = {"GPT2": models.GPT2LMHeadModel, "Bart": models.BartForConditionalGeneration,
                 "Llama": models.LlamaForCausalLM, "GPTJ": models.GPTJForCausalLM,
                 "T5": models.T5ForConditionalGeneration, "OPT": models.OPTForCausalLM}[cls]

    def model_maker(layers=None):
        cfg = config_cls(**{**config, **({f: layers for f in LAYER_FIELDS if f in config} if layers else {})})
        return lambda key: model_cls(cfg, key=key)

    def xent(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()

    if row.kind == "causal":  # ids (B, T + 1): T tokens in, the next T out
        return (model_maker, lambda model, batch, key: xent(jax.vmap(model)(batch["ids"][:, :-1]), batch["ids"][:, 1:]),
                lambda n, seq: {"ids": jax.ShapeDtypeStruct((n, seq + 1), jnp.int32)})
    shift, cfg = models.shift_right, config_cls(**config)

    def loss_fn(model, batch, key):
        return xent(jax.vmap(lambda s, t: model(s, shift(t, cfg)))(batch["src"], batch["tgt"]), batch["tgt"])

    return model_maker, loss_fn, lambda n, seq: {k: jax.ShapeDtypeStruct((n, seq), jnp.int32) for k in ("src", "tgt")}


def _worker(task: dict) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import redeqx

    row = ROWS[task["row"]]
    model_maker, loss_fn, batch_of = _model_and_loss(row)
    opts = task.get("opts", {})
    tpu = task.get("compiler") == "tpu-v4"
    mesh = redeqx.make_mesh(task["n_model_shards"], devices=compile_devices(task["devices"], tpu))
    n_data = mesh.shape["data"]
    optimizer = optax.adamw(1e-5)
    full_layers = max(row.config.get(f, 0) for f in LAYER_FIELDS)
    fewer = task.get("extrapolate")  # (L1, L2): plan with L1 and L2 layers, extrapolate to all of them

    def one_plan(seq, per_shard, layers):
        t0, c0 = time.perf_counter(), time.process_time()
        p = redeqx.plan(model_maker(layers), loss_fn, optimizer, batch_of(per_shard * n_data, seq), mesh,
                        device_memory=row.memory, explore=False, fsdp=opts.get("fsdp", False),
                        remat=opts.get("remat", False),
                        compute_dtype=jnp.bfloat16 if opts.get("bf16") else None)
        return dict(seq=seq, per_shard=per_shard, peak=p.peak, parameters=p.parameters, optimizer=p.optimizer,
                    temporaries=p.temporaries, gradients=p.gradients, batch=p.batch, fits=bool(p.fits),
                    margin=p.margin, mesh=p.mesh, global_batch=p.global_batch, flops=p.flops,
                    collective_bytes=sum(v["bytes"] for v in p.collectives.values()), refused=p.refused,
                    compile_s=time.perf_counter() - t0, compile_cpu_s=time.process_time() - c0)

    def probe(seq, per_shard):
        if not fewer:
            out = one_plan(seq, per_shard, task.get("layers"))
        else:
            # This host cannot compile the whole model's step (XLA:CPU's fusion pass needs memory that grows
            # faster than the instruction count: OPT-66B's 64 layers passed 23 GB of RSS); plan L1 and L2 of
            # its identical layers and extend the line through them to all of them (peaks are linear in L).
            a, b = (one_plan(seq, per_shard, n) for n in fewer)
            t = (full_layers - fewer[1]) / (fewer[1] - fewer[0])
            out = dict(b)
            for f in ("peak", "parameters", "optimizer", "temporaries", "gradients", "flops", "collective_bytes"):
                out[f] = type(b[f])(b[f] + t * (b[f] - a[f]))
            out["margin"] = row.memory_bytes - out["peak"]
            out["fits"] = out["peak"] <= row.memory_bytes
            out["compile_s"], out["compile_cpu_s"] = (a[k] + b[k] for k in ("compile_s", "compile_cpu_s"))
            out["extrapolated_from"] = {str(n): {k: p[k] for k in ("peak", "temporaries", "parameters", "optimizer")}
                                        for n, p in zip(fewer, (a, b))}
        print(f"    [{row.key} {task['devices']} dev, mp {task['n_model_shards']}, {_opts_label(opts)}] "
              f"seq {seq} x {per_shard}/shard: peak {out['peak'] / GB:.2f} GB"
              f"{' (extrapolated from %s layers)' % list(fewer) if fewer else ''} -> "
              f"{'fits' if out['fits'] else 'does NOT fit'} "
              f"({out['compile_s']:.0f} s, {out['compile_cpu_s']:.0f} s CPU)", file=sys.stderr, flush=True)
        return out

    abstract = eqx.filter_eval_shape(model_maker(task.get("layers")), jax.random.key(0))
    params = param_count(abstract)
    result = dict(params=params)
    if task["task"] == "plan":
        result["plan"] = probe(task["seq"], task.get("per_shard", 1))
    elif task["task"] == "longest":
        result.update(_longest(probe, row, task["seq"], task.get("step", 128)))
    return result


def _largest(fits, start: int, step: int, memory: float, cap: int | None = None) -> tuple[int, bool]:
    """``(value, capped)``: the largest multiple of ``step`` (at most ``cap``;
    0 if none) for which ``fits(value) -> (fits, peak)`` holds. Bracketed by
    doubling (or a linear extrapolation of two fitting peaks, if further),
    narrowed by regula falsi, by bisection when one end moved twice in a row."""
    peaks = {}

    def probe(v):
        ok, peaks[v] = fits(v)
        return ok

    if probe(start):
        lo, hi = start, None
        while hi is None:
            if cap is not None and lo >= cap:
                return lo, True
            nxt = 2 * lo
            ok = sorted(v for v in peaks if v <= lo)
            if len(ok) >= 2 and peaks[ok[-1]] > peaks[ok[-2]]:
                a, b = ok[-2], ok[-1]
                guess = b + (memory - peaks[b]) * (b - a) / (peaks[b] - peaks[a])
                nxt = min(max(nxt, int(guess) // step * step), 8 * lo)
            if cap is not None:
                nxt = min(nxt, cap)
            if probe(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        lo, hi = 0, start
        peaks[0] = 0.0
    moved = []
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if len(moved) < 2 or moved[-1] != moved[-2]:
            if lo > 0 and peaks[hi] > peaks[lo]:
                guess = lo + (memory - peaks[lo]) * (hi - lo) / (peaks[hi] - peaks[lo])
                mid = int(guess) // step * step
        mid = min(max(mid, lo + step), hi - step)
        if probe(mid):
            lo = mid
            moved.append("lo")
        else:
            hi = mid
            moved.append("hi")
    return lo, False


def _longest(probe, row: Row, start: int, step: int) -> dict:
    """The longest sequence (multiples of ``step``) that fits; at the position
    table's length, the largest batch per data shard instead."""
    probes, seen = [], {}

    def fits(seq, per_shard=1):
        if (seq, per_shard) not in seen:
            probes.append(probe(seq, per_shard))
            seen[seq, per_shard] = probes[-1]
        return seen[seq, per_shard]["fits"], seen[seq, per_shard]["peak"]

    memory = row.memory_bytes
    longest, capped = _largest(fits, start, step, memory, cap=row.max_len)
    out = dict(longest=longest, capped=capped, probes=probes)
    if capped:
        out["largest_batch"], _ = _largest(lambda b: fits(longest, b), 1, 1, memory)
    out["best"] = max((p for p in probes if p["fits"]), key=lambda p: (p["seq"], p["per_shard"]), default=None)
    return out


def _opts_label(opts: dict) -> str:
    parts = [k for k in ("fsdp", "remat") if opts.get(k)] + (["bf16 compute"] if opts.get("bf16") else [])
    return " + ".join(parts) or "fp32, no fsdp, no remat"


class Runner(Probes):
    """One worker per task, with its device count (libtpu's for redco's TPU v4
    slice), the results kept in ``cache`` when given; the compiles it ran or read."""

    def __init__(self, cache: Path | None, xla_flags: str):
        super().__init__(self._start, cache)
        self.xla_flags, self.compiles = xla_flags, []

    def _start(self, task: dict) -> dict:
        t0 = time.perf_counter()
        python, env = compiler(task.get("compiler") == "tpu-v4", task["devices"], self.xla_flags)
        env["PYTHONWARNINGS"] = "ignore::UserWarning"
        return dict(worker(__file__, "_worker", python=python, env=env, task=task), wall_s=time.perf_counter() - t0)

    def __call__(self, task: dict) -> dict:
        result = super().__call__(**task)
        self.compiles += [(task["row"], p["compile_s"], p["compile_cpu_s"])
                          for p in [result.get("plan")] + result.get("probes", []) if p]
        return result


FSDP_REMAT_BF16 = {"fsdp": True, "remat": True, "bf16": True}


def fewest_devices(run: Runner, row: Row, params: float, upper: int, extra: dict) -> dict:
    """The fewest devices (a power of two up to ``upper``) that fit with fsdp +
    remat + bf16: counts where parameters + Adam alone exceed the memory are
    ruled out; then the smallest left, redco's own count, and bisection."""
    counts = [2 ** i for i in range(0, int(math.log2(upper)) + 1)]
    ruled_out = [n for n in counts if resident_bytes(params, n) >= row.memory_bytes]
    candidates = [n for n in counts if n not in ruled_out]
    probes = {}

    def fits(i):
        n = candidates[i]
        task = dict(task="plan", row=row.key, devices=n, n_model_shards=min(n, row.n_model_shards), seq=row.seq,
                    opts=FSDP_REMAT_BF16, **extra)
        print(f"  (a) {row.name} on {n} devices (16 B/param: {floor_bytes(params, n) / GB:.1f} GB)", flush=True)
        probes[n] = run(task)["plan"]
        return probes[n]["fits"]

    best = None
    if candidates and fits(0):
        best = 0
    elif len(candidates) > 1:
        lo = 0  # does not fit
        hi = candidates.index(row.devices) if row.devices in candidates[1:] else 1
        while hi < len(candidates) and not fits(hi):
            lo, hi = hi, hi + 1
        if hi < len(candidates):
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits(mid):
                    hi = mid
                else:
                    lo = mid
            best = hi
    n = candidates[best] if best is not None else None
    return dict(devices=n, plan=probes.get(n), ruled_out=ruled_out, probed=sorted(probes))


def main():
    if serve(globals()):
        return
    p = parser(__doc__)
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--skip-slow", action="store_true", help="skip OPT-66B and the searches over device counts")
    p.add_argument("--quick", action="store_true", help="each model cut to 2 layers, no searches, no RESULTS.md")
    p.add_argument("--no-search", action="store_true", help="only the redco setting of each row")
    p.add_argument("--layers", type=int, default=None, help="cut every model to this many layers (to try it out)")
    p.add_argument("--extrapolate", type=int, nargs=2, metavar=("L1", "L2"), default=None,
                   help="plan the searches' probes at L1 and L2 layers and extend the line to all of them")
    p.add_argument("--cache", type=Path, default=None, help="JSON file keeping each probe's result")
    p.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    p.add_argument("--compiler", choices=("cpu", "tpu-v4"), default="cpu",
                   help="tpu-v4: the TPU rows by libtpu's compiler for redco's TPU v4 slice, ahead of time")
    p.add_argument("--setup-tpu", action="store_true", help="create benchmarks/.venv-tpu (libtpu) and exit")
    args = p.parse_args()
    if args.setup_tpu:
        return setup_tpu()
    (tpu_main if args.compiler == "tpu-v4" else cpu_main)(args)


def cpu_main(args) -> None:
    run = Runner(args.cache, FAST_COMPILE)
    layers = 2 if args.quick else args.layers
    results = []
    for row in (ROWS[k] for k in args.rows if not (args.skip_slow and k in SLOW)):
        print(f"== {row.name}: {row.devices} x {row.memory}, n_model_shards={row.n_model_shards}, seq {row.seq}",
              flush=True)
        # the redco setting is compiled whole (but for OPT-66B); --extrapolate speeds up the searches only
        extra = {"layers": layers} if layers else {"extrapolate": list(row.extrapolate)} if row.extrapolate else {}
        fewer = args.extrapolate or row.extrapolate
        search_extra = {"layers": layers} if layers else {"extrapolate": list(fewer)} if fewer else {}
        base = dict(task="plan", row=row.key, devices=row.devices, n_model_shards=row.n_model_shards, seq=row.seq,
                    **extra)
        r = run(base)
        out = dict(row=row.key, name=row.name, params=r["params"], redco=r["plan"])
        if row.key == "opt-66b":  # the closest to redco's 64-way split of the state: mp 8 x fsdp over data 8
            out["fsdp"] = run(dict(base, opts={"fsdp": True}))["plan"]
        if not (args.quick or args.no_search):
            if not args.skip_slow:
                out["fewest"] = fewest_devices(run, row, r["params"], upper=4 * row.devices, extra=search_extra)
            out["longest"] = run(dict(task="longest", row=row.key, devices=row.devices,
                                      n_model_shards=row.n_model_shards, seq=row.seq, step=128,
                                      opts=FSDP_REMAT_BF16, **search_extra))
        results.append(out)
    report_out(args, results, render(results, run, quick=args.quick), CPU_SECTION)


CPU_SECTION = "redco Table 1 by the planner (benchmarks/table1.py)"


def report_out(args, results: list[dict], text: str, section: str) -> None:
    """Print the report; write the JSON and the RESULTS.md section when asked."""
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    args.no_write = args.no_write or args.quick
    report(args, section, text)


def tpu_main(args) -> None:
    """Table 1's TPU v4 rows planned by the TPU compiler on redco's own
    slice: the redco setting, fsdp (where there is a data axis to split
    over), and fsdp + remat + bf16 compute; then, with those three, half the
    chips (where parameters + Adam alone leave room) and the position table's
    length, which stand in for the CPU section's searches (see the section's notes)."""
    rows = [ROWS[k] for k in args.rows if "TPU" in ROWS[k].server and not (args.skip_slow and k in SLOW)]
    run = Runner(args.cache, "")
    layers = 2 if args.quick else args.layers
    # Whole models by default: libtpu's peaks are not always linear in the layer count, so a line through
    # 2 and 4 layers can miss (it did on T5-XXL's longer sequences: 20.2, 20.0, 15.2, 24.7, 19.8 GB at
    # 512 ... 8192 tokens); see the section's notes.
    extra = {"compiler": "tpu-v4", **({"layers": layers} if layers else
                                      {"extrapolate": list(args.extrapolate)} if args.extrapolate else {})}
    results = []
    for row in rows:
        print(f"== {row.name} on the TPU v4 compiler: {row.devices} chips, n_model_shards={row.n_model_shards}, "
              f"seq {row.seq}", flush=True)
        base = dict(task="plan", row=row.key, devices=row.devices, n_model_shards=row.n_model_shards, seq=row.seq,
                    **extra)
        r = run(base)
        out = dict(row=row.key, name=row.name, params=r["params"], redco=r["plan"])
        if row.devices > row.n_model_shards:  # fsdp splits over data: nothing to split on a data axis of 1
            out["fsdp"] = run(dict(base, opts={"fsdp": True}))["plan"]
        out["all"] = run(dict(base, opts=FSDP_REMAT_BF16))["plan"]
        out["cpu"] = {key: _cpu_twin(run, base, opts)
                      for key, opts in (("redco", None), ("fsdp", {"fsdp": True}), ("all", FSDP_REMAT_BF16))}
        if not (args.quick or args.no_search):
            # (a) half the chips, unless parameters + Adam alone rule it out; (b) the position table's length
            half = row.devices // 2
            if half in TPU_V4_SLICES and resident_bytes(r["params"], half) < row.memory_bytes:
                out["half"] = run(dict(base, devices=half, n_model_shards=min(half, row.n_model_shards),
                                       opts=FSDP_REMAT_BF16))["plan"]
            if row.max_len and row.max_len > row.seq:
                out["table"] = run(dict(base, seq=row.max_len, opts=FSDP_REMAT_BF16))["plan"]
        results.append(out)
    report_out(args, results, render_tpu(results, run, quick=args.quick), TPU_SECTION)


def _cpu_twin(run: Runner, task: dict, opts: dict | None) -> dict | None:
    """The XLA:CPU plan of the same step in the cache (the section above's
    runs), compiled whole if there is one, else extrapolated."""
    same = {k: v for k, v in task.items() if k not in ("compiler", "extrapolate", "layers")}
    found = {}
    for key, result in run.cache.items():
        t = json.loads(key)
        if t.get("compiler") or t.get("layers") or "plan" not in result:
            continue
        if {k: v for k, v in t.items() if k not in ("extrapolate", "opts")} == same and t.get("opts") == opts:
            found["extrapolate" in t] = result["plan"]
    return found.get(False) or found.get(True)


TPU_SECTION = "redco Table 1's TPU rows by the TPU v4 compiler (benchmarks/table1.py --compiler tpu-v4)"


def _gb(x) -> str:
    return f"{x / GB:.2f} GB"


def _fits(p: dict) -> str:
    return "yes" if p["fits"] else "**no**"


def _refused(p: dict) -> str:
    return " (refused)" if p.get("refused") else ""


QUICK = "**Quick mode: every model cut to 2 layers (same widths); not Table 1's figures.**\n"


def render(results: list[dict], run: Runner, *, quick: bool) -> str:
    lines = [QUICK] if quick else []
    lines += ["| model | params | server: devices x memory | n_model_shards x data | seq | peak / device | fits? "
              "| margin | compile |", "|---|---|---|---|---|---|---|---|---|"]
    for out in results:
        row = ROWS[out["row"]]
        for key, name, server in (("redco", row.name, f"{row.server}: {row.devices} x {row.memory}"),
                                  ("fsdp", f"{row.name}, fsdp=True", "")):
            if key in out:
                p, params = out[key], f"{out['params'] / 1e9:.3f} B"
                lines.append(f"| {name} | {params if key == 'redco' else ''} | {server} | {p['mesh']['model']} x "
                             f"{p['mesh']['data']}{' (fsdp)' if key == 'fsdp' else ''} | {row.seq} | {_gb(p['peak'])} "
                             f"| {_fits(p)} | {_gb(p['margin'])} | {p['compile_s']:.0f} s |")
    searched = [o for o in results if "fewest" in o or "longest" in o]
    if searched:
        lines += ["", "With `fsdp=True`, remat (`redeqx.remat`) and bf16 compute (fp32 master weights and Adam "
                  "state), n_model_shards as in the row (at most the device count), one sequence per data shard:", "",
                  "| model | 16 B/param floor on redco's devices | fewest devices that fit | its peak | floor there "
                  "| longest seq on redco's devices | its peak |", "|---|---|---|---|---|---|---|"]
        lines += [_search_row(out) for out in searched] + [""] + [_arithmetic(o) for o in searched if o.get("fewest")]
    lines += [f"\n{ROWS[o['row']].name}: n_model_shards={ROWS[o['row']].n_model_shards} because {ROWS[o['row']].why}."
              for o in results if ROWS[o["row"]].why]
    if run.compiles:
        by_row = {}
        for k, w, c in run.compiles:
            by_row.setdefault(k, []).append((w, c))
        per = ", ".join(f"{ROWS[k].name} {len(v)} x {sum(w for w, _ in v) / len(v):.0f} s "
                        f"({sum(c for _, c in v) / len(v):.0f} s CPU)" for k, v in by_row.items())
        lines += ["", f"Compile times (wall, with the machine shared; CPU seconds in brackets): {len(run.compiles)} "
                  f"probes, {sum(c[1] for c in run.compiles) / 60:.1f} min wall, "
                  f"{sum(c[2] for c in run.compiles) / 60:.1f} min CPU; per probe: {per}."]
    return "\n".join(lines)


def _search_row(out: dict) -> str:
    row, fewest, lg = ROWS[out["row"]], out.get("fewest"), out.get("longest")
    few = (("skipped",) if fewest is None else (f"none up to {4 * row.devices}",) if fewest["devices"] is None else
           (f"{fewest['devices']} x {row.memory}", _gb(fewest["plan"]["peak"]),
            _gb(floor_bytes(out["params"], fewest["devices"]))))
    few += ("",) * (3 - len(few))
    best = lg and lg["best"]
    longest = ("", "") if lg is None else ("none fits", "") if best is None else (
        f"{lg['longest']}" + (f" (the position table) x {lg['largest_batch']} per data shard" if lg["capped"] else ""),
        _gb(best["peak"]))
    return (f"| {row.name} | {_gb(floor_bytes(out['params'], row.devices))} | {few[0]} | {few[1]} | {few[2]} "
            f"| {longest[0]} | {longest[1]} |")


def _arithmetic(out: dict) -> str:
    row, fewest, n, P_ = ROWS[out["row"]], out["fewest"], out["fewest"]["devices"], out["params"]
    text = f"- {row.name}: 16 B x {P_ / 1e9:.3f} B = {16 * P_ / GB:.1f} GB"
    if fewest["ruled_out"]:
        m = max(fewest["ruled_out"])
        text += (f"; on {m} devices 12 B x {P_ / 1e9:.3f} B / {m} = {resident_bytes(P_, m) / GB:.1f} GB "
                 f">= {row.memory}: ruled out")
    if n:
        p = fewest["plan"]
        text += (f"; on {n} devices 16 B x {P_ / 1e9:.3f} B / {n} = {floor_bytes(P_, n) / GB:.2f} GB, planned "
                 f"peak {_gb(p['peak'])} = params {_gb(p['parameters'])} + Adam {_gb(p['optimizer'])} + batch "
                 f"{_gb(p['batch'])} + temporaries {_gb(p['temporaries'])} (all gradients would be "
                 f"{_gb(p['gradients'])})")
    return text + f"; compiled for {fewest['probed']} devices."


def render_tpu(results: list[dict], run: Runner, *, quick: bool) -> str:
    lines = [QUICK] if quick else []
    lines += ["| model | slice | n_model_shards x data | seq | setting | peak / chip (TPU compiler) | fits 32 GB? "
              "| margin | of which params + Adam | temporaries | XLA:CPU's peak, same step | compile |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for out in results:
        row = ROWS[out["row"]]
        for key, label in (("redco", "fp32, no fsdp"), ("fsdp", "fsdp=True"), ("all", "fsdp + remat + bf16")):
            if key in out:
                p, cpu = out[key], out.get("cpu", {}).get(key)
                lines.append(
                    f"| {row.name} | {row.devices} x v4 ({TPU_V4_SLICES[row.devices]}) | {p['mesh']['model']} x "
                    f"{p['mesh']['data']} | {row.seq} | {label} | {_gb(p['peak'])}{_refused(p)} "
                    f"| {_fits(p)} | {_gb(p['margin'])} | {_gb(p['parameters'] + p['optimizer'])} "
                    f"| {_gb(p['temporaries'])} | {_gb(cpu['peak']) if cpu else ''} | {p['compile_s']:.0f} s |")
    searched = [(o, key) for o in results for key in ("half", "table") if key in o]
    if searched:
        lines += ["", "With fsdp + remat + bf16 compute, on half the chips (where parameters + Adam alone leave room) "
                  "and at the position table's length on redco's slice:", "",
                  "| model | chips | n_model_shards x data | seq | peak / chip | fits 32 GB? | 16 B/param there |",
                  "|---|---|---|---|---|---|---|"]
        for out, key in searched:
            p = out[key]
            n = p["mesh"]["model"] * p["mesh"]["data"]
            lines.append(f"| {ROWS[out['row']].name} | {n} | {p['mesh']['model']} x {p['mesh']['data']} | {p['seq']} "
                         f"| {_gb(p['peak'])}{_refused(p)} | {_fits(p)} "
                         f"| {_gb(floor_bytes(out['params'], n))} |")
    if run.compiles:
        lines += ["", f"Compile times: {len(run.compiles)} compiles, {sum(c[1] for c in run.compiles) / 60:.1f} min "
                  f"wall, {sum(c[2] for c in run.compiles) / 60:.1f} min CPU, on this 2-core machine."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
