"""Pipeline stages: what GPipe costs in FLOPs (the bubble), what it sends
across the stages' boundary against FSDP over the same chips, what the issue's
8 hosts of 8 make of both, and what the pipeline costs a user who asks for no
stages. Planned on abstract shapes (nothing allocated, no TPU needed).

    python -m benchmarks.pipeline                  # TPU v4 via libtpu (benchmarks/.venv-tpu), else XLA:CPU
    python -m benchmarks.pipeline --sizes 7b       # the 7B table only (and the no-stages row)
    python -m benchmarks.pipeline --cached-only    # compile nothing: the section from the cached probes

Each plan is one `redeqx.plan(..., explore=False)` of a zoo LLaMA (LLaMA-2-7B
or LLaMA-3-70B shapes, stacked layers; bf16 compute, fp32 weights + AdamW,
remat) in a worker: libtpu for a TPU v4 slice (32 GiB a chip) when
benchmarks/.venv-tpu exists, else XLA:CPU against the same 32 GiB (slow at 64
devices). For each model: S = 2, 4, 8 stages of 4 S microbatches,
`make_mesh(model, n_pipeline_stages=S)`; against them, on the same chips
without stages, FSDP (`make_mesh(model)`, fsdp: its collectives whose groups
span two runs of N / S consecutive chips are what it sends across the stages'
boundary) and the unpipelined step with the batch split over data (no fsdp:
the FLOPs the bubble is measured against; at 8 and 16 layers too, for a line
a + b L where the whole model's is refused). The issue's comparison (70B, 64
chips as 8 hosts of 8, a stage a host against FSDP over the hosts) is
`redeqx.compare_plans` on two of those plans, rebuilt from the cache. The
no-stages row compiles a small LLaMA's train step by XLA:CPU with the redeqx
of HEAD and of ``--before`` (git worktrees at /tmp/redeqx-COMMIT), alternated
in fresh processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import subprocess
from pathlib import Path

from benchmarks._common import (HERE, ROOT, Probes, compile_devices, compiler, parser, probe_options, probes_for,
                                report, serve, worker, worker_env)

MEMORY = 32 * 2**30  # a TPU v4 chip
SIZES = {
    "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,  # LLaMA-2-7B
               num_attention_heads=32),
    "70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,  # LLaMA-3-70B
                num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0),
}
# per size: chips, model shards (within a stage), rows and tokens a row a step, whether the weights are also split
# over data (fsdp) at each S (the 70B's do not fit S <= 4 stages otherwise), extra (S, fsdp) rows, and the layers
# of a bubble check without fsdp against an unpipelined step compiled whole (the 70B's is refused at 80 layers)
CASES = {"7b": dict(chips=32, model=4, rows=32, seq=2048, fsdp={2: False, 4: False, 8: False}, extra=[(4, True)]),
         "70b": dict(chips=64, model=8, rows=32, seq=1024, fsdp={2: True, 4: True, 8: False}, extra=[(4, False)],
                     check_layers=16)}
STAGES = (2, 4, 8)
HOSTS = dict(flops_per_second="275TFLOP/s", devices_per_host=8, within_host="450GB/s", between_hosts="25GB/s")
ROUNDS = 5  # fresh processes a side for the no-stages row, alternated


# ----------------------------------------------------------------------------- worker (imports JAX)

def probe(task: dict) -> dict:
    """A plan's figures (kind "plan") or a small LLaMA's compiled train step (kind "hlo")."""
    if task["kind"] == "hlo":
        return _hlo(task)
    import time

    import jax
    import jax.numpy as jnp
    import optax

    import redeqx
    from redeqx import models
    from redeqx.planner._plan import crosses, wire_bytes

    n, s = task["chips"], task["stages"]
    devices = compile_devices(n, task["tpu"])
    sizes = dict(SIZES[task["size"]], num_hidden_layers=task.get("layers", SIZES[task["size"]]["num_hidden_layers"]))
    config = models.LlamaConfig(max_position_embeddings=task["seq"], **sizes)
    mesh = redeqx.make_mesh(task["model"], n_pipeline_stages=s, devices=devices)

    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["input_ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"]).mean()

    batch = {k: jax.ShapeDtypeStruct((task["rows"], task["seq"]), jnp.int32) for k in ("input_ids", "labels")}
    start = time.perf_counter()
    p = redeqx.plan(lambda key: models.LlamaForCausalLM(config, key=key), loss_fn, optax.adamw(1e-5), batch, mesh,
                    fsdp=task["fsdp"], remat=task["remat"], compute_dtype=jnp.bfloat16, device_memory=MEMORY,
                    explore=False, microbatches=task["microbatches"])
    seconds = time.perf_counter() - start
    groups: dict = {}  # each distinct collective (kind, bytes, groups) and how often a step runs it
    shaped: dict = {}  # by kind and result shapes: how often, the bytes on the wire, and a group's size
    for c in p.found:
        k = (c.kind, c.bytes, c.groups)
        groups[k] = groups.get(k, 0) + 1
        shapes = " ".join(f"{dtype}{list(dims)}" for dtype, dims in c.shapes)
        kind_shapes = (c.kind, shapes, len(c.groups[0]) if c.groups else n)
        count, sent = shaped.get(kind_shapes, (0, 0.0))
        shaped[kind_shapes] = (count + 1, sent + wire_bytes(c))
    largest = sorted(shaped.items(), key=lambda kv: -kv[1][1])[:5]
    return dict(fits=bool(p.fits), refused=p.refused, peak=p.peak, temporaries=p.temporaries,
                parameters=p.parameters, optimizer=p.optimizer, flops=p.flops, collectives=p.collectives,
                stage_bytes=p.stage_bytes, mesh=p.mesh, global_batch=p.global_batch, batch=p.batch,
                gradients=p.gradients,
                crossing={str(run): sum(wire_bytes(c) for c in p.found if crosses(c, run))
                          for run in sorted({n // k for k in (*STAGES, n // HOSTS["devices_per_host"])})},
                found=[[kind, nbytes, g, count] for (kind, nbytes, g), count in groups.items()],
                largest=[[kind, shapes, size, count, sent] for (kind, shapes, size), (count, sent) in largest],
                timing=p.timing(**HOSTS) if not p.refused else None, warnings=list(p.warnings),
                compile_s=seconds)


def _hlo(task: dict) -> dict:
    """A small LLaMA's train step on 8 CPU devices (data 4 x model 2, remat, bf16, no stages), by
    the redeqx on this worker's path: the seconds from the abstract model to the compiled program
    (specs, state, trace, lower, compile), and the program's hash (its metadata and the tables of source
    locations, which name files and lines, left out)."""
    import time

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import redeqx
    from redeqx import models

    config = models.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                num_attention_heads=8, max_position_embeddings=256)

    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["input_ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"]).mean()

    start = time.perf_counter()
    mesh, optimizer = redeqx.make_mesh(2), optax.adamw(1e-4)
    batch = {k: jax.ShapeDtypeStruct((8, 256), jnp.int32, sharding=NamedSharding(mesh, P("data")))
             for k in ("input_ids", "labels")}
    model = eqx.filter_eval_shape(lambda: models.LlamaForCausalLM(config, key=jax.random.key(0)))
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)  # no fsdp: its pins changed after
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(0))
    step = redeqx.make_train_step(redeqx.remat(loss_fn), optimizer, mesh, specs, compute_dtype=jnp.bfloat16)
    with jax.set_mesh(mesh):
        compiled = step.trace(state, batch).lower().compile()
    seconds = time.perf_counter() - start
    text = re.sub(r",\s*metadata=\{[^}]*\}", "", compiled.as_text())
    text = re.sub(r"\n(?:FileNames|FunctionNames|FileLocations|StackFrames)\n(?:\d+ .*\n)*", "\n", text)
    return dict(seconds=seconds, hash=hashlib.sha256(text.encode()).hexdigest()[:16], chars=len(text),
                redeqx=str(Path(redeqx.__file__).parent))


# ----------------------------------------------------------------------------- driver (JAX only to rebuild plans)

def _worker(tpu: bool):
    def run(task):
        if task["kind"] == "hlo":  # XLA:CPU, 8 devices, the redeqx of a worktree at that commit first on the path
            env = worker_env(8)
            env["PYTHONPATH"] = f"{_tree(task['commit'])}/src{os.pathsep}{env['PYTHONPATH']}"
            return worker(__file__, "probe", env=env, task=task)
        python, env = compiler(tpu, task["chips"])
        out = worker(__file__, "probe", python=python, env=dict(env, PYTHONWARNINGS="ignore::UserWarning"), task=task)
        return dict(out, src=_commit("HEAD") + ("+changes" if _dirty() else ""))  # the library compiled
    return run


def _tree(commit: str) -> Path:
    """A git worktree of this repository at ``commit`` (added under /tmp once)."""
    path = Path(f"/tmp/redeqx-{commit}")
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
    return path


def _commit(ref: str) -> str:
    """The short hash of the last commit at or before ``ref`` that changed src/ (the library itself)."""
    return subprocess.run(["git", "log", "-1", "--format=%h", ref, "--", "src"], cwd=ROOT, check=True,
                          stdout=subprocess.PIPE, text=True).stdout.strip()


def _dirty() -> bool:
    """Whether src/ has changes not committed."""
    return bool(subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT, check=True,
                               stdout=subprocess.PIPE, text=True).stdout.strip())


def _plan_task(size: str, stages: int, fsdp: bool, layers: int | None = None) -> dict:
    c = CASES[size]
    task = dict(kind="plan", size=size, chips=c["chips"], stages=stages, model=c["model"], rows=c["rows"],
                seq=c["seq"], microbatches=4 * stages if stages > 1 else None, remat=True, fsdp=fsdp)
    return task if layers is None else dict(task, layers=layers)


def parameters(size: str) -> int:
    """The model's parameters: embedding and head (untied), each layer's attention, MLP and norms."""
    c = SIZES[size]
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, d = c.get("num_key_value_heads", heads), h // heads
    layer = 2 * h * heads * d + 2 * h * kv * d + 3 * h * c["intermediate_size"] + 2 * h
    return 2 * c["vocab_size"] * h + c["num_hidden_layers"] * layer + h


def zero3_bytes(size: str) -> float:
    """What each device sends over the data axis a step under ZeRO-3's layout (weights split over data x
    model): every weight gathered twice in bf16 (forward, backward) and its gradient reduce-scattered in
    fp32, each over a ring of the data axis's devices, all of whose groups span every stage."""
    c = CASES[size]
    n = c["chips"] // c["model"]
    return (n - 1) / n * (2 + 2 + 4) * parameters(size) / c["model"]


def gb(n) -> str:
    return f"{n / 1e9:.2f}"


def gib(n) -> str:
    return f"{n / 2**30:.1f}"


def _mesh(p: dict) -> str:
    return " x ".join(f"{k} {v}" for k, v in p["mesh"].items())


def _reference(run: Probes, size: str) -> tuple[dict | None, dict]:
    """The unpipelined step's FLOPs per device on the same chips, the batch split over data (no fsdp, as the
    stages' data-manual path splits it): ``(direct plan, {"flops", "a", "b", "how"})``. FLOPs taken as linear
    in the layers (``a + b L``, from plans of 8 and 16 layers) where the whole model's is refused for memory."""
    layers = SIZES[size]["num_hidden_layers"]
    direct = run.get(**_plan_task(size, 1, False))
    short = [run.get(**_plan_task(size, 1, False, layers=n)) for n in (8, 16)]
    out: dict = {}
    if all(p and not p["refused"] for p in short):
        b = (short[1]["flops"] - short[0]["flops"]) / 8
        out = dict(a=short[0]["flops"] - 8 * b, b=b, extrapolated=short[0]["flops"] + (layers - 8) * b)
    if direct and not direct["refused"]:
        out.update(flops=direct["flops"], how="compiled")
    elif "extrapolated" in out:
        out.update(flops=out["extrapolated"], how=f"from the 8- and 16-layer plans (a + b L at L = {layers})")
    return direct, out


def _size_table(run: Probes, size: str) -> tuple[str, dict]:
    """One model's table: each S against the plans without stages on the same chips; and the probes by
    (S, fsdp) (S = 1: without stages)."""
    c = CASES[size]
    n, layers = c["chips"], SIZES[size]["num_hidden_layers"]
    base = run.get(**_plan_task(size, 1, True))
    direct, ref = _reference(run, size)
    zero3 = zero3_bytes(size)
    found = {(1, True): base, (1, False): direct}
    lines = [f"{size.upper()} ({parameters(size) / 1e9:.2f} B parameters, {layers} layers, hidden "
             f"{SIZES[size]['hidden_size']}) on {n} chips, {c['rows']} rows of {c['seq']} tokens a step "
             f"({c['rows'] * c['seq']} tokens), {c['model']} model shards in every stage:", "",
             "| S | M | mesh | weights over data | FLOPs / unpipelined | stack (M+S-1)/M | step, analytic | "
             "stage bytes GB (permutes + other) "
             "| FSDP compiled, across GB | stage / FSDP | ZeRO-3 analytic, across GB | stage / ZeRO-3 | peak GiB | "
             "fits 32 GiB | compile s |", "|" + "---|" * 15]

    def row(label, m, p, fsdp, s):
        if p is None:
            return f"| {label} | {m} | not probed |" + " |" * 12
        over = "yes (fsdp)" if fsdp and p["mesh"]["data"] > 1 else "no"
        stack = f"{(m + s - 1) / m:.3f}" if s > 1 else "1"
        step = (f"{(ref['a'] + ref['b'] * layers * (m + s - 1) / m) / (ref['a'] + ref['b'] * layers):.3f}"
                if s > 1 and "a" in ref else "-")
        if p["refused"]:
            return (f"| {label} | {m} | {_mesh(p)} | {over} | refused | {stack} | {step} | | | | | | "
                    f"≥ {gib(p['peak'])} | no: libtpu refused it (temporaries {gib(p['temporaries'])} GiB) | "
                    f"{p['compile_s']:.0f} |")
        ratio = f"{p['flops'] / ref['flops']:.3f}" if "flops" in ref else "-"
        bytes_ = "- | - | - | - | -"
        if s > 1:
            sent = p["stage_bytes"]
            across = base["crossing"][str(n // s)] if base and not base["refused"] else None
            permuted = _permuted(p, n // s)
            bytes_ = " | ".join([f"{gb(sent)} ({gb(permuted)} + {gb(sent - permuted)})",
                                 gb(across) if across is not None else "-",
                                 f"1/{across / sent:.0f}" if across and sent else "-", gb(zero3),
                                 f"1/{zero3 / sent:.1f}" if sent else "-"])
        return (f"| {label} | {m} | {_mesh(p)} | {over} | {ratio} | {stack} | {step} | {bytes_} | {gib(p['peak'])} | "
                f"{'yes' if p['fits'] else 'no'} | {p['compile_s']:.0f} |")

    for s, fsdp in [(s, c["fsdp"][s]) for s in STAGES] + list(c["extra"]):
        found[s, fsdp] = run.get(**_plan_task(size, s, fsdp))
        lines.append(row(s, 4 * s, found[s, fsdp], fsdp, s))
    lines.append(row("no stages", "-", base, True, 1))
    lines.append(row("no stages", "-", direct, False, 1))
    if "a" in ref:
        check = ""
        if direct and not direct["refused"]:
            check = (f"; compiled at {layers} layers {direct['flops']:.4e}, which the line extrapolates to "
                     f"{ref['extrapolated'] / direct['flops']:.4f}x")
        lines += ["", "The unpipelined FLOPs per device (the reference of `FLOPs / unpipelined`: no stages, no fsdp, "
                  f"the batch split over data as the stages split it): {ref['flops']:.4e}, {ref['how']}. Plans of 8 "
                  f"and 16 layers give a = {ref['a']:.3e} FLOPs outside the stack and b = {ref['b']:.3e} a "
                  f"layer{check}; `step, analytic` is (a + b L (M+S-1)/M) / (a + b L), the bubble on the stack alone."]
    found["ref"] = ref
    if "check_layers" in c:
        table, found["check"] = _bubble_check(run, size, c["check_layers"], ref)
        lines.append(table)
    return "\n".join(lines), found


def _permuted(p: dict, per_stage: int) -> float:
    """The stage bytes that collective permutes send (the activations handed on, stage 0's inputs collected,
    the results dealt out, and their gradients back); the rest are reductions and gathers across stages."""
    from redeqx.planner._hlo import Collective
    from redeqx.planner._plan import crosses, wire_bytes

    return sum(count * wire_bytes(c) for kind, nbytes, groups, count in p["found"] if kind == "collective-permute"
               for c in [Collective(kind, (), nbytes, tuple(map(tuple, groups)) if groups else None)]
               if crosses(c, per_stage))


def _bubble_check(run: Probes, size: str, layers: int, ref: dict) -> tuple[str, float | None]:
    """The bubble as compiled at ``layers`` layers, no fsdp: each S against the unpipelined step compiled whole."""
    base = run.get(**_plan_task(size, 1, False, layers=layers))
    at_4 = None
    lines = ["", f"{size.upper()} cut to {layers} layers (everything else as above, no fsdp, so that the unpipelined "
             "step compiles whole and the batch is split over data on both sides): the bubble as compiled against "
             "it directly:", "",
             "| S | M | mesh | FLOPs / unpipelined | stack (M+S-1)/M | step, analytic | compile s |",
             "|---|---|---|---|---|---|---|"]
    for s in STAGES:
        m, p = 4 * s, run.get(**_plan_task(size, s, False, layers=layers))
        step = (ref["a"] + ref["b"] * layers * (m + s - 1) / m) / (ref["a"] + ref["b"] * layers) if "a" in ref else None
        if p is None or base is None or p["refused"] or base["refused"]:
            lines.append(f"| {s} | {m} | {'refused' if p and p['refused'] else 'not probed'} | | | | |")
            continue
        lines.append(f"| {s} | {m} | {_mesh(p)} | {p['flops'] / base['flops']:.3f} | {(m + s - 1) / m:.3f} | "
                     f"{f'{step:.3f}' if step else '-'} | {p['compile_s']:.0f} |")
        at_4 = p["flops"] / base["flops"] if s == 4 else at_4
    return "\n".join(lines), at_4


def _largest(p: dict | None) -> str:
    if not p or not p.get("largest"):
        return "-"
    kind, shapes, size, count, sent = p["largest"][0]
    return f"{kind} of {shapes} over groups of {size}, {count} a step, {gb(sent)} GB on the wire"


def _findings(found: dict) -> str:
    """What the tables say, in words, from the same probes."""
    out = []
    for size, probes in found.items():
        c = CASES[size]
        staged, base = probes.get((4, c["fsdp"][4])), probes.get((1, True))
        if not staged or staged["refused"]:
            continue
        ref = probes.get("ref", {})
        if "flops" in ref:
            ratio = staged["flops"] / ref["flops"]
            how = "compiled whole" if ref["how"] == "compiled" else "extrapolated from 8 and 16 layers, see below"
            out.append(f"- {size.upper()}, S=4, M=16 ({'fsdp within the stages' if c['fsdp'][4] else 'no fsdp'}): the "
                       f"step's FLOPs are {ratio:.3f}x the unpipelined step's (the reference {how}; analytic for the "
                       f"stack 1.188): the target of ≤ 1.19x is {'met' if ratio <= 1.19 else 'missed'}.")
        check = probes.get("check")
        if check:
            out.append(f"- {size.upper()} at {c['check_layers']} layers without fsdp, S=4, M=16: {check:.3f}x the "
                       f"unpipelined step compiled whole: ≤ 1.19x {'met' if check <= 1.19 else 'missed'} with no "
                       "extrapolation (the head is a larger share at 16 layers, so the analytic step is lower too).")
        n, zero3, sent = c["chips"], zero3_bytes(size), staged["stage_bytes"]
        if base and not base["refused"] and sent:
            across, tokens = base["crossing"][str(n // 4)], c["rows"] * c["seq"]
            out.append(f"- {size.upper()}, S=4 x {n // 4}: each device sends {gb(sent)} GB a step to other stages, "
                       f"1/{across / sent:.0f} of the {gb(across)} GB FSDP's compiled step sends across the same "
                       f"boundary and 1/{zero3 / sent:.1f} of ZeRO-3's analytic {gb(zero3)} GB: ≤ 1/10 "
                       f"{'met' if sent * 10 <= across else 'missed'} against the compiled FSDP, "
                       f"{'met' if sent * 10 <= zero3 else 'missed'} against ZeRO-3's count. The stage bytes grow with "
                       f"the tokens of a step ({sent / tokens / 1e3:.0f} kB a token here), FSDP's do not: at "
                       f"{tokens * zero3 / 10 / sent / 1e3:.0f}k tokens a step (now {tokens / 1e3:.0f}k) they would "
                       "reach 1/10 of ZeRO-3's; a larger batch runs as accumulated steps of this one, each of which "
                       "gathers the weights again.")
        if base and not base["refused"] and "flops" in ref:
            whole = base.get("largest") and base["largest"][0][1].split("[")[1].startswith(f"{c['rows']},")
            why = (f": the partitioner (Shardy) keeps every activation for the whole batch ({c['rows']} rows) on "
                   "each device and splits the fsdp weights' contraction over data, all-reducing the products, "
                   "instead of splitting the batch over data and gathering the weights" if whole else
                   ", the batch split over data (the steps pin it at the model's layout pins with fsdp)")
            out.append(f"- {size.upper()}, FSDP as compiled (no stages, fsdp): its largest collective is "
                       f"{_largest(base)}{why}; its FLOPs are {base['flops'] / ref['flops']:.2f}x the batch-split "
                       "step's without fsdp.")
    return "\n".join(["", "What the tables say:", "", *[line for line in out if line]])


def _rebuilt(p: dict, microbatches: int | None):
    """A `redeqx.Plan` of a cached probe's figures: what `Plan.timing` and `compare_plans` read (the FLOPs
    and every collective with its groups), checked against the timing the worker took of the plan itself."""
    from redeqx import Plan
    from redeqx.planner._hlo import Collective

    found = tuple(c for kind, nbytes, groups, count in p["found"]
                  for c in [Collective(kind, (), nbytes, tuple(map(tuple, groups)) if groups else None)] * count)
    plan = Plan(mesh=p["mesh"], settings=dict(microbatches=microbatches), global_batch=p["global_batch"],
                parameters=p["parameters"], optimizer=p["optimizer"], batch=p["batch"], gradients=p["gradients"],
                temporaries=p["temporaries"], peak=p["peak"], collectives=p["collectives"], flops=p["flops"],
                device_memory=MEMORY, found=found)
    again = plan.timing(**HOSTS)
    if any(abs(again[k] - v) > 1e-9 * max(v, 1) for k, v in p["timing"].items()):
        raise RuntimeError(f"the rebuilt plan's timing {again} is not the worker's {p['timing']}")
    return plan


def _compare(run: Probes, found: dict) -> str:
    """The 70B on 64 chips in 8 hosts of 8: S=8 (a stage a host) against FSDP over the hosts."""
    from redeqx import compare_plans

    staged, fsdp = found.get((8, CASES["70b"]["fsdp"][8])), found.get((1, True))
    if not staged or not fsdp or staged["refused"] or fsdp["refused"]:
        return "\nThe comparison over hosts needs both 70B plans compiled (S=8, no stages); one is missing or refused."
    plans = {"stages over hosts (S=8, M=32)": _rebuilt(staged, 32), "fsdp over hosts (data 8)": _rebuilt(fsdp, None)}
    table = compare_plans(plans, **HOSTS)
    times = {k: v.timing(**HOSTS) for k, v in plans.items()}
    (a, ta), (b, tb) = times.items()
    words = []
    for how, said in (("serial", "with nothing overlapped"), ("overlapped", "with everything overlapped")):
        fast, slow = (a, b) if ta[how] <= tb[how] else (b, a)
        words.append(f"{said[0].upper()}{said[1:]}, {fast} takes {times[fast][how] * 1e3:.0f} ms a step against "
                     f"{times[slow][how] * 1e3:.0f} ms, {times[slow][how] / times[fast][how]:.2f}x faster")
    far = {k: t["between"] * 25e9 for k, t in times.items()}
    _, ref = _reference(run, "70b")
    stages_t = times[a]
    zero3_between, zero3_compute = zero3_bytes("70b") / 25e9, ref.get("flops", 0.0) / 275e12
    zero3 = (f" FSDP as ZeRO-3 would lay it out (weights gathered, the batch split over data) sends "
             f"{gb(zero3_bytes('70b'))} GB between hosts a device ({zero3_between:.2f} s at 25 GB/s) and computes the "
             f"unpipelined reference's FLOPs ({zero3_compute:.2f} s): at least {zero3_compute + zero3_between:.2f} s "
             f"serial and {max(zero3_compute, zero3_between):.2f} s overlapped, with the traffic within hosts free; "
             f"the stages are still {(zero3_compute + zero3_between) / stages_t['serial']:.2f}x and "
             f"{max(zero3_compute, zero3_between) / stages_t['overlapped']:.2f}x faster.") if ref else ""
    return "\n".join([
        "", "70B on 64 chips as 8 hosts of 8 (the issue's comparison): a stage a host (stage 8 x model 8, 32 "
        "microbatches of one row) against FSDP over the hosts (data 8 x model 8, weights split over data), the same "
        "batch; `redeqx.compare_plans` with a v4 chip's bf16 peak, 450 GB/s within a host, 25 GB/s between:", "",
        "```", table, "```", "",
        f"Bytes each device sends between hosts a step: {', '.join(f'{k} {gb(v)} GB' for k, v in far.items())}. "
        + ". ".join(words) + "." + zero3])


def _no_stages(run: Probes, before: str) -> str:
    """A small LLaMA's train step without stages, compiled by the redeqx of HEAD and of ``before``."""
    before = subprocess.run(["git", "rev-parse", "--short", before], cwd=ROOT, check=True, stdout=subprocess.PIPE,
                            text=True).stdout.strip()
    head = _commit("HEAD")
    if run.cached_only:  # the HEAD measured, which later commits to src/ do not move
        measured = [t["commit"] for t in map(json.loads, run.cache) if t["kind"] == "hlo" and t["commit"] != before]
        head = measured[-1] if measured else head
    commits = {"HEAD": head, "before": before}
    got = {name: [] for name in commits}
    for r in range(ROUNDS):
        order = list(commits) if r % 2 == 0 else list(commits)[::-1]
        for name in order:
            p = run.get(kind="hlo", commit=commits[name], round=r, chips=8)
            if p is not None:
                got[name].append(p)
    if not all(got.values()):
        return "\nThe no-stages row is not probed."
    hashes = {name: {p["hash"] for p in ps} for name, ps in got.items()}
    same = len(hashes["HEAD"] | hashes["before"]) == 1
    med = {name: statistics.median(p["seconds"] for p in ps) for name, ps in got.items()}
    low = {name: min(p["seconds"] for p in ps) for name, ps in got.items()}
    return "\n".join([
        "", "Cost to users who do not ask for stages: a small LLaMA (4 stacked layers, hidden 256, vocab 1024; data 4 "
        "x model 2 on 8 XLA:CPU devices, remat, bf16, AdamW, 8 rows of 256 tokens) built, traced, lowered and "
        f"compiled by `make_train_step` at HEAD ({commits['HEAD']}) and before the pipeline ({commits['before']}), "
        f"each in {ROUNDS} fresh processes, the two alternated:", "",
        "| redeqx | compiled HLO (sha256, metadata and source locations left out) | seconds, median | fastest | "
        "each run's seconds |", "|---|---|---|---|---|",
        *(f"| {name} ({commits[name]}) | {', '.join(sorted(hashes[name]))} | {med[name]:.2f} | {low[name]:.2f} | "
          f"{', '.join(format(p['seconds'], '.2f') for p in got[name])} |" for name in commits),
        "", f"The compiled programs are {'identical' if same else 'DIFFERENT'}. From the abstract model to the "
        f"compiled step (specs, state, trace, lower, compile) HEAD takes {med['HEAD'] / med['before']:.2f}x the "
        f"median time of {commits['before']} and {low['HEAD'] / low['before']:.2f}x its fastest (this machine is "
        "shared: runs vary)."])


def main():
    if serve(globals()):
        return
    p = parser(__doc__)
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=sorted(SIZES))
    p.add_argument("--before", default="c36b1ad", help="the commit before the pipeline, for the no-stages row")
    probe_options(p, HERE / "results" / "pipeline_probes.json")
    args = p.parse_args()
    run, tpu = probes_for(args, _worker)
    compiled_by = "libtpu for a TPU v4 slice (32 GiB a chip)" if tpu else "XLA:CPU, against 32 GiB a device"
    lines = [f"Planned on abstract shapes by {compiled_by}: LLaMA-2-7B and LLaMA-3-70B shapes (the zoo's stacked "
             "layers), bf16 compute, fp32 weights + AdamW, remat, `redeqx.plan(..., microbatches=4 S, explore=False)`. "
             "Each S puts the stages outermost (`make_mesh(model, n_pipeline_stages=S)`: consecutive chips share a "
             "stage). Two plans without stages on the same chips: with fsdp (FSDP, data spanning the chips the stages "
             "did: the bytes it sends across the stages' boundary) and without (the batch split over data as the "
             "stages split it: the unpipelined FLOPs). FLOPs are per device with loops counted per iteration, so "
             "`FLOPs / unpipelined` is the bubble as compiled, beside the stack's analytic (M+S-1)/M and the step's "
             "(the embedding, head, loss and update are not bubbled). Stage bytes: what each device sends a step to "
             "chips of other stages (`plan.stage_bytes`, on the wire by ring), split into collective permutes (the "
             "activations handed on, stage 0's inputs collected from every stage, the results dealt back, and their "
             "gradients) and the rest (the embedding's and head's gradients summed over the stages, gathers); FSDP's "
             "bytes across the same boundary: the FSDP plan's collectives whose groups span two runs of N/S "
             "consecutive chips, counted the same way (`wire_bytes`, `crosses`); ZeRO-3's: every weight gathered "
             "twice in bf16 and its gradient reduce-scattered in fp32 over data, analytic. GB are 10^9 bytes, "
             "GiB 2^30."]
    srcs = sorted({v["src"] for v in run.cache.values() if "src" in v})
    cache = args.cache.resolve()
    lines[0] += (f" Probes are cached in `{cache.relative_to(ROOT) if cache.is_relative_to(ROOT) else cache}`; the "
                 f"plans were compiled with redeqx's src/ at {', '.join(srcs) or 'a commit not recorded'}.")
    found = {}
    for size in [s for s in CASES if s in args.sizes]:
        table, found[size] = _size_table(run, size)
        lines += ["", table]
    lines.append(_findings(found))
    if "70b" in args.sizes:
        lines.append(_compare(run, found["70b"]))
    lines.append(_no_stages(run, args.before))
    report(args, "Pipeline stages (benchmarks/pipeline.py)", "\n".join(lines))


if __name__ == "__main__":
    main()
