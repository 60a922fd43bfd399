"""Mixture of experts: FLOPs, bytes and TPU v4 plans (issue 31).

    python benchmarks/moe.py              # the CPU part (8 simulated devices): FLOPs and bytes ratios
    python benchmarks/moe.py --tpu        # + Mixtral-8x7B and Qwen3-30B-A3B planned for TPU v4 (libtpu)

Each part runs its probes in subprocesses and caches their JSON in
benchmarks/results/moe_<part>.json (``--cached`` rewrites the section from
the caches); the section "Mixture of experts (benchmarks/moe.py)" of
benchmarks/RESULTS.md is rewritten from whatever is cached.

- FLOPs: the train step of a small Mixtral (8 experts, top-2) against the
  dense LLaMA with the same active parameters (intermediate 2 x the
  expert's) and against the same MoE written as users write it by hand (a
  one-hot ``einsum`` through every expert), each planned on one device: on
  XLA:CPU (`redeqx.plan` counts each grouped matmul by its rows, as the note
  it prints says) and on one TPU v4 chip (libtpu's own figure).
- Bytes: the collectives of an expert-parallel step (as a GPU or TPU moves
  them, tests/accelerator_count.py) against an all-to-all plan: 2 x tokens x
  k x hidden floats per MoE layer each way, plus the attention's Megatron
  bytes and the data-parallel gradient sum.
- TPU v4: the fewest chips (32 GiB each) on which the real model's step
  compiles and fits, fp32 AdamW and bf16 compute + remat (fp32 master
  weights and Adam state; fsdp and 8 model shards in both), and the plan's
  FLOPs per token against 6 x active parameters.
"""

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import cpu8_env, libtpu, run_worker, write_section  # noqa: E402

CACHE = HERE / "results"
SLICES = (4, 8, 16, 32, 64, 128, 256)  # TPU v4 chip counts benchmarks/table1.py describes
HBM = 32 * 2**30
TITLE = "Mixture of experts (benchmarks/moe.py)"
SMALL = dict(hidden=64, expert=256, experts=8, k=2, layers=2, vocab=128, seq=64, batch=8)


# ----------------------------------------------------------------------------- worker (imports JAX)

def _models(name, small=SMALL):
    """``(make_model(key), active parameters per token)`` of a model named in the tasks."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from redeqx import models
    from redeqx.models._layers import ACTIVATIONS
    from redeqx.models._moe import MoE, route, router_stats

    class OneHotMoE(MoE):  # what users write by hand: every token through every expert, weighted by a one-hot
        def __call__(self, x, *, valid=None):
            logits = x.astype(jnp.float32) @ self.gate.weight.T.astype(jnp.float32)
            weights, index = route(logits, self.k, normalize=self.normalize_top_k)
            combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(index, self.n_experts)).astype(x.dtype)
            g, u, d = self.experts.stacks()
            h = ACTIVATIONS[self.activation](jnp.einsum("th,eih->tei", x, g)) * jnp.einsum("th,eih->tei", x, u)
            return jnp.einsum("tei,ehi,te->th", h, d, combine), router_stats(logits, index, valid)

    s = small
    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                  num_attention_heads=4, num_key_value_heads=4, scan_layers=False)
    moe_cfg = dict(intermediate_size=s["expert"], num_local_experts=s["experts"], num_experts_per_tok=s["k"])
    if name == "dense":
        return lambda key: models.LlamaForCausalLM(models.LlamaConfig(intermediate_size=s["k"] * s["expert"],
                                                                      **common), key=key)
    if name in ("moe", "onehot"):
        def make(key):
            m = models.MixtralForCausalLM(models.MixtralConfig(**moe_cfg, **common), key=key)
            for i in range(s["layers"] if name == "onehot" else 0):
                m = eqx.tree_at(lambda m: m.model.layers[i].block_sparse_moe, m,
                                OneHotMoE(s["hidden"], s["expert"], s["experts"], s["k"], key=jax.random.key(i)))
            return m
        return make
    if name == "Mixtral-8x7B":
        return lambda key: models.MixtralForCausalLM(models.MixtralConfig(), key=key)
    if name == "Qwen3-30B-A3B":
        return lambda key: models.Qwen3MoeForCausalLM(models.Qwen3MoeConfig(), key=key)
    raise ValueError(name)


def _loss_fn(model, batch, key):
    import jax
    import jax.numpy as jnp
    import optax

    logits = jax.vmap(model)(batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["ids"][:, 1:]).mean()


def _active(name, abstract):
    """Parameters a token passes through: all but the experts not chosen (k of E) and the embedding table."""
    import jax

    total = experts = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        n = math.prod(leaf.shape)
        key = jax.tree_util.keystr(path)
        total += n
        experts += n if ".experts." in key else 0
        total -= n if "embed_tokens" in key else 0
    cfg = abstract.config
    e = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    return total - experts + experts * cfg.num_experts_per_tok // e


def _worker(task):
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import redeqx

    if task["kind"] == "flops":
        devices = jax.devices()[:1]
        if task.get("tpu"):
            sys.path.insert(0, str(HERE))
            from table1 import tpu_v4_devices
            devices = tpu_v4_devices(4)[:1]
        batch = {"ids": jax.ShapeDtypeStruct((SMALL["batch"], SMALL["seq"] + 1), jnp.int32)}
        p = redeqx.plan(_models(task["model"]), _loss_fn, optax.adamw(1e-3), batch,
                        redeqx.make_mesh(1, devices=devices), explore=False)
        return dict(flops=p.flops, note=p.note)
    if task["kind"] == "bytes":
        sys.path.insert(0, str(HERE.parent / "tests"))
        return _bytes_ratio(task["n_model"])
    # a TPU v4 plan of a real model
    sys.path.insert(0, str(HERE))
    from table1 import tpu_v4_devices
    make = _models(task["model"])
    abstract = eqx.filter_eval_shape(make, jax.random.key(0))
    mesh = redeqx.make_mesh(8, devices=tpu_v4_devices(task["chips"]))
    bf16 = task["setting"] == "bf16"
    seq = task["seq"]
    batch = {"ids": jax.ShapeDtypeStruct((mesh.shape["data"], seq + 1), jnp.int32)}
    p = redeqx.plan(make, _loss_fn, optax.adamw(1e-5), batch, mesh, fsdp=True, remat=bf16,
                    compute_dtype=jnp.bfloat16 if bf16 else None, device_memory=HBM, explore=False)
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
    return dict(fits=bool(p.fits), peak=p.peak, flops=p.flops, params=params, active=_active(task["model"], abstract),
                tokens=mesh.shape["data"] * seq, chips=task["chips"], refused=p.refused)


def _bytes_ratio(n_model):
    """Bytes moved / the all-to-all plan's, for the test model of tests/test_moe_sharding.py."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import redeqx
    from accelerator_count import accelerator_collectives
    from test_moe_sharding import BATCH, _model, loss_fn

    model, mesh = _model(8), redeqx.make_mesh(n_model)
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.sgd(0.5), mesh, specs, key=jax.random.key(1))
    batch = jax.device_put({k: jnp.asarray(v) for k, v in BATCH.items()}, NamedSharding(mesh, P("data")))
    moved = sum(v["bytes"] for v in accelerator_collectives(
        redeqx.make_train_step(loss_fn, optax.sgd(0.5), mesh, specs), state, batch).values())
    grad = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.model))
    b, t, h, layers, k = 16 // mesh.shape["data"], 8, 32, 2, 2
    act = b * t * h * 4
    attention = 2 * (1 + layers) * act + 3 * b * t * 4
    all_to_all = layers * 2 * (2 * b * t * k * h * 4)
    return dict(moved=moved, analytic=attention + all_to_all + grad, mesh=dict(mesh.shape))


# ----------------------------------------------------------------------------- driver (no JAX)

def _probe(task, tpu=False):
    python, env = libtpu() if tpu else (sys.executable, cpu8_env())
    env = dict(env, ALLOW_MULTIPLE_LIBTPU_LOAD="1")  # no TPU attached: other compiles may run beside this one
    print(f"  probe {task}", file=sys.stderr, flush=True)
    return run_worker(python, __file__, ["--worker", json.dumps(task)], env)


def cpu_part():
    flops = {m: _probe(dict(kind="flops", model=m)) for m in ("dense", "moe", "onehot")}
    bytes_ = {n: _probe(dict(kind="bytes", n_model=n)) for n in (2, 4, 8)}
    return dict(flops=flops, bytes=bytes_)


def tpu_part(seq):
    out = dict(flops={m: _probe(dict(kind="flops", model=m, tpu=True), tpu=True) for m in ("dense", "moe", "onehot")})
    for model in ("Mixtral-8x7B", "Qwen3-30B-A3B"):
        for setting in ("fp32", "bf16"):
            for chips in SLICES[1:]:  # 8 model shards: 8 chips at least
                r = _probe(dict(kind="tpu", model=model, setting=setting, chips=chips, seq=seq), tpu=True)
                out[f"{model} {setting}"] = r
                if r["fits"]:
                    break
    return out


def _section(cpu, tpu):
    lines = []
    if cpu or tpu:
        lines += [f"Train step FLOPs of a small Mixtral ({SMALL['experts']} experts of width {SMALL['expert']}, top-"
                  f"{SMALL['k']}, hidden {SMALL['hidden']}, {SMALL['layers']} layers, {SMALL['batch']} x "
                  f"{SMALL['seq']} tokens) against the dense LLaMA with the same active parameters (intermediate "
                  f"{SMALL['k'] * SMALL['expert']}) and against the same MoE by a hand-written one-hot dispatch, "
                  "one device, fp32 AdamW:", "",
                  "| compiler | dense LLaMA | MoE, grouped matmuls (ratio) | MoE, one-hot einsum (ratio) |",
                  "|---|---|---|---|"]
        for label, part in (("XLA:CPU, grouped matmuls by rows (`plan`)", cpu), ("libtpu, TPU v4 (its own figure)", tpu)):
            if part:
                f = {m: part["flops"][m]["flops"] for m in ("dense", "moe", "onehot")}
                lines.append(f"| {label} | {f['dense']:.3e} | {f['moe']:.3e} ({f['moe'] / f['dense']:.2f}x) | "
                             f"{f['onehot']:.3e} ({f['onehot'] / f['dense']:.2f}x) |")
        lines.append("")
    if cpu:
        lines += ["Collective bytes per device of an expert-parallel train step (tests/test_moe_sharding.py's "
                  "Mixtral: 8 experts, top-2, hidden 32, 2 layers, 16 x 8 tokens), as a GPU or TPU moves them, "
                  "against the all-to-all plan (2 x tokens x k x hidden floats per MoE layer each way + the "
                  "attention's Megatron bytes + the data-parallel gradient sum):", "",
                  "| mesh | moved | all-to-all plan | ratio |", "|---|---|---|---|"]
        for n, r in cpu["bytes"].items():
            lines.append(f"| data {r['mesh']['data']} x model {n} | {r['moved']} | {r['analytic']} | "
                         f"{r['moved'] / r['analytic']:.2f} |")
        lines.append("")
    rows = [(k, v) for k, v in (tpu or {}).items() if k != "flops"]
    if rows:
        lines += ["The real models on TPU v4 (32 GiB a chip), planned ahead of time by libtpu: 8 model shards, fsdp, "
                  "one 2048-token sequence per data shard; the fewest chips whose step fits, and the plan's FLOPs "
                  "per token against 6 x active parameters (embedding excluded, attention's own FLOPs not in it):",
                  "", "| model, setting | params | active | fewest chips | peak/chip | FLOPs/token | 6 x active | ratio |",
                  "|---|---|---|---|---|---|---|---|"]
        for key, r in rows:
            per_token = r["flops"] * r["chips"] / r["tokens"]
            chips = r["chips"] if r["fits"] else f"> {r['chips']}"
            lines.append(f"| {key.replace('fp32', 'fp32 AdamW').replace('bf16', 'bf16 + remat')} | "
                         f"{r['params'] / 1e9:.1f} B | {r['active'] / 1e9:.2f} B | {chips} | {r['peak'] / 2**30:.1f} GiB | "
                         f"{per_token:.3e} | {6 * r['active']:.3e} | {per_token / (6 * r['active']):.2f} |")
        lines += ["", "libtpu's FLOP count of XLA's grouped matmul is static: it counts a forward or input-gradient "
                  "`ragged_dot` by all the rows its operand can hold, and the weight gradient (ragged over the "
                  "contracted rows) over every expert the device holds (the small model above: 2.76x the dense "
                  "step by libtpu's count, 1.06x by rows). Under 8 model shards each device's grouped matmuls hold "
                  "all of its data shard's tokens x k assignments, only its own experts' groups filled. So the "
                  "ratios to 6 x active parameters above bound from above what the chips would compute; what a "
                  "TPU's kernel spends on the empty rows needs a TPU to measure."]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tpu", action="store_true", help="also plan for TPU v4 with libtpu (benchmarks/.venv-tpu)")
    parser.add_argument("--cached", action="store_true", help="rewrite the section from the cached results")
    parser.add_argument("--only-tpu", action="store_true", help="run the TPU part only (the CPU part from its cache)")
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    CACHE.mkdir(exist_ok=True)
    cpu_file, tpu_file = CACHE / "moe_cpu.json", CACHE / "moe_tpu.json"
    if not args.cached:
        if not args.only_tpu:
            cpu_file.write_text(json.dumps(cpu_part(), indent=1))
        if args.tpu or args.only_tpu:
            tpu_file.write_text(json.dumps(tpu_part(args.seq), indent=1))
    load = lambda f: json.loads(f.read_text()) if f.exists() else None  # noqa: E731
    body = _section(load(cpu_file), load(tpu_file))
    print(body)
    write_section(TITLE, body)


if __name__ == "__main__":
    main()
