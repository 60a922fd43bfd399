"""Mixture of experts: a small Mixtral (redeqx.models) trained from scratch on
the Python standard library's source, bytes as tokens, its experts spread over
the model shards; the load-balancing loss keeps the routers using every expert.

    python examples/mixture_of_experts/main.py                         # 8 simulated CPU devices, ~2.5 min
    python examples/mixture_of_experts/main.py --family qwen3_moe      # Qwen3-MoE: q/k norms, 16 experts, top-4
    python examples/mixture_of_experts/main.py --aux_loss_coef 0       # no balancing: watch the load drift
    python examples/mixture_of_experts/main.py --export runs/moe/hf    # Transformers loads runs/moe/hf
    python examples/mixture_of_experts/main.py --family llama          # the dense LLaMA of the same active size
    python examples/mixture_of_experts/main.py --plot load.png         # each expert's share of tokens over training

Each MoE layer routes a token to its 2 best of 8 experts (4 of 16 for
Qwen3-MoE), dropless, by grouped matmuls; with ``--n_model_shards 4`` each
device holds 2 (4) whole experts and multiplies only their tokens.
"""

import argparse
import os
import sysconfig
from pathlib import Path

# On a machine with no accelerator, pretend to have 8 devices (must precede `import jax`).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import redeqx  # noqa: E402
from redeqx import models  # noqa: E402

PROMPTS = ["import ", "def __init__(self", "class ", "    return "]


def load_blocks(train_bytes, eval_bytes, seq_len):
    """Every top-level stdlib module as bytes, in a fixed random order, one in ten held out,
    cut into (n, seq_len + 1) blocks."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    files = [files[i] for i in np.random.default_rng(0).permutation(len(files))]
    data = [np.frombuffer(f.read_bytes(), np.uint8) for f in files]

    def blocks(docs, n_bytes):
        ids = np.concatenate(docs)[:n_bytes].astype(np.int32)
        n = len(ids) // (seq_len + 1)
        return ids[: n * (seq_len + 1)].reshape(n, seq_len + 1)

    return blocks([d for i, d in enumerate(data) if i % 10], train_bytes), blocks(data[::10], eval_bytes)


def collate_fn(examples):
    return {"input_ids": np.stack(examples)}  # (B, T + 1)


def make_loss_fn(aux_loss_coef, z_loss_coef, dense=False):
    def loss_fn(model, batch, key):
        ids = batch["input_ids"]
        if dense:  # the dense baseline: no routers, no auxiliary losses
            logits = jax.vmap(model)(ids[:, :-1])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids[:, 1:]).mean()
            return ce, {"ce": ce, "aux_loss": jnp.zeros(()), "z_loss": jnp.zeros(())}
        logits, stats = jax.vmap(model.with_aux)(ids[:, :-1])  # and the routers' statistics, summed over layers
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids[:, 1:]).mean()
        balance, z = stats.load_balancing_loss(), stats.z_loss()
        return ce + aux_loss_coef * balance + z_loss_coef * z, {"ce": ce, "aux_loss": balance, "z_loss": z}

    return loss_fn


def expert_load(model, blocks):
    """The share of top-k assignments each expert gets on ``blocks``, over every MoE layer."""
    _, stats = jax.jit(jax.vmap(model.with_aux))(jnp.asarray(blocks[:, :-1]))
    counts = np.asarray(stats.tokens_per_expert).sum(0)
    return counts / counts.sum()


def plot_load(history, path):
    """Each expert's share of the held-out assignments (all layers) against the training step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, shares = zip(*history)
    shares = np.stack(shares)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for e in range(shares.shape[1]):
        ax.plot(steps, 100 * shares[:, e], label=f"expert {e}")
    ax.axhline(100 / shares.shape[1], color="gray", ls=":", label="balanced")
    ax.set(xlabel="training step", ylabel="share of assignments (%)", title="expert load, held-out text")
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pred_fn(model, batch, key, *, max_new_tokens):
    return models.generate(model, batch["input_ids"], attention_mask=batch["attention_mask"],
                           max_new_tokens=max_new_tokens)


def collate_prompts(prompts):
    ids = [list(p.encode()) for p in prompts]
    width = max(map(len, ids))
    return {"input_ids": np.array([[32] * (width - len(x)) + x for x in ids], np.int32),  # left-padded
            "attention_mask": np.array([[False] * (width - len(x)) + [True] * len(x) for x in ids])}


def log(*args):
    if jax.process_index() == 0:
        print(*args, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["mixtral", "qwen3_moe", "llama"], default="mixtral")
    parser.add_argument("--n_model_shards", type=int, default=4)
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--n_epochs", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--train_bytes", type=int, default=150_000)
    parser.add_argument("--eval_bytes", type=int, default=20_000)
    parser.add_argument("--hidden_size", type=int, default=96)
    parser.add_argument("--n_layers", type=int, default=2)
    parser.add_argument("--aux_loss_coef", type=float, default=0.02)
    parser.add_argument("--z_loss_coef", type=float, default=1e-3)
    parser.add_argument("--sample_tokens", type=int, default=40)
    parser.add_argument("--log_every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--export", help="write the trained model here for Transformers")
    parser.add_argument("--plot", help="write a PNG of each expert's share of tokens over training here")
    args = parser.parse_args()

    model_key, state_key, data_key = jax.random.split(jax.random.key(args.seed), 3)
    mesh = redeqx.make_mesh(args.n_model_shards)
    train, test = load_blocks(args.train_bytes, args.eval_bytes, args.seq_len)
    h, common = args.hidden_size, dict(vocab_size=256, num_hidden_layers=args.n_layers, num_attention_heads=4,
                                       num_key_value_heads=4, max_position_embeddings=512, bos_token_id=None,
                                       eos_token_id=None, router_aux_loss_coef=args.aux_loss_coef)
    if args.family == "mixtral":  # 8 experts of width 2h, top-2
        model = models.MixtralForCausalLM(models.MixtralConfig(
            hidden_size=h, intermediate_size=2 * h, num_local_experts=8, num_experts_per_tok=2, **common),
            key=model_key)
    elif args.family == "llama":  # dense: one MLP of width 4h, the active size of Mixtral's top-2 of width 2h
        model = models.LlamaForCausalLM(models.LlamaConfig(
            hidden_size=h, intermediate_size=4 * h, **{k: v for k, v in common.items() if "router" not in k}),
            key=model_key)
    else:  # 16 finer experts of width h, top-4, renormalised
        model = models.Qwen3MoeForCausalLM(models.Qwen3MoeConfig(
            hidden_size=h, intermediate_size=4 * h, moe_intermediate_size=h, head_dim=h // 4, num_experts=16,
            num_experts_per_tok=4, **common), key=model_key)
    specs = redeqx.sharding_rules(model, mesh)
    table = redeqx.explain(model, specs, mesh, reasons="full").splitlines()
    log(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}; {len(train)} train / {len(test)} held-out blocks")
    log("\n".join(r for r in table if "experts." in r or r.startswith("path")) + "\n" + table[-1])

    dense = args.family == "llama"
    loss_fn = make_loss_fn(args.aux_loss_coef, args.z_loss_coef, dense)
    schedule = redeqx.lr_schedule(len(train), args.per_device_batch_size, args.n_epochs, args.learning_rate, mesh,
                                  schedule_type="cosine", warmup_ratio=0.05)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))
    state = redeqx.init_state(model, optimizer, mesh, specs, key=state_key)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)

    def held_out():
        m = redeqx.evaluate(eval_step, state.model, test, collate_fn, args.per_device_batch_size, mesh, key=data_key)
        return m["ce"], m["aux_loss"]

    def load():  # each expert's share of the held-out assignments (none for the dense model)
        return None if dense else expert_load(state.model, test[:32])

    ce, aux = held_out()
    log(f"step 0: held-out loss {ce:.4f}, load-balancing loss {aux:.3f}")
    history = [] if dense else [(0, load())]
    if not dense:
        log(f"expert load, layer-summed: {np.round(history[0][1], 3)}")
    for epoch in range(args.n_epochs):
        for batch in redeqx.batches(train, collate_fn, args.per_device_batch_size, mesh, shuffle=True,
                                    key=jax.random.fold_in(data_key, epoch)):
            state, metrics = train_step(state, batch)
            if int(state.step) % args.log_every == 0:
                log(f"step {int(state.step)}: loss {float(metrics['ce']):.4f}, "
                    f"aux {float(metrics['aux_loss']):.3f}, z {float(metrics['z_loss']):.3f}")
                if args.plot and not dense:
                    history.append((int(state.step), load()))
        ce, aux = held_out()
        log(f"epoch {epoch}: step {int(state.step)}, held-out loss {ce:.4f}, load-balancing loss {aux:.3f}")
    if not dense:
        history.append((int(state.step), load()))
        log(f"expert load, layer-summed: {np.round(history[-1][1], 3)}")
    if args.plot and not dense:
        plot_load(history, args.plot)
        log(f"expert load over training plotted to {args.plot}")

    predict_step = redeqx.make_predict_step(lambda m, b, k: pred_fn(m, b, k, max_new_tokens=args.sample_tokens),
                                            mesh, specs)
    samples = redeqx.predict(predict_step, state.model, PROMPTS, collate_prompts, 1, mesh, key=data_key,
                             output_fn=lambda out: [bytes(row).decode(errors="replace") for row in out.tolist()])
    for prompt, text in zip(PROMPTS, samples):
        log(f"--- sample (greedy)\n{prompt}{text}")
    if args.export:
        models.save_pretrained(state.model, args.export)
        log(f"exported to {args.export} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
    log(f"final held-out loss {ce:.4f} (perplexity {np.exp(ce):.2f} per byte), load-balancing loss {aux:.3f}")
    return ce


if __name__ == "__main__":
    redeqx.initialize()
    main()
