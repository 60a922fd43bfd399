"""Language modeling: a LLaMA (redeqx.models) trained from scratch on the
Python standard library's own source code, with a byte-level BPE tokenizer
trained here; held-out perplexity falls, and samples come from cached decoding.

    python examples/language_modeling/main.py                          # 8 simulated CPU devices, ~4 min
    python examples/language_modeling/main.py --n_model_shards 4 --per_device_batch_size 16
    python examples/language_modeling/main.py --n_pipeline_stages 2   # layers in 2 stages x 2 model shards x 2 data
    python -m redeqx.launch -n 2 examples/language_modeling/main.py    # 2 processes x 4 devices, as on 2 hosts
    python examples/language_modeling/main.py --workdir runs/lm --export runs/lm/hf   # Transformers loads runs/lm/hf
    python examples/language_modeling/main.py --init_from runs/lm/hf   # fine-tune a Hugging Face checkpoint
    tensorboard --logdir runs/lm

The text is every top-level ``*.py`` file of the standard library (a few MB,
shipped with Python): one file in ten is held out. Documents are joined with
an end-of-text token and cut into blocks of ``--seq_len + 1`` tokens, as
Hugging Face's run_clm.py does.
"""

import argparse
import functools
import math
import os
import sysconfig
from pathlib import Path

# On a machine with no accelerator, pretend to have 8 devices (must precede `import jax`).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tokenizers import ByteLevelBPETokenizer, Tokenizer  # noqa: E402

import redeqx  # noqa: E402
from redeqx import models  # noqa: E402

EOT = "<|endoftext|>"
PROMPTS = ["import ", "def __init__(self", "class ", "    if not isinstance("]


def load_texts(train_chars, eval_chars):
    """The standard library's top-level modules in a fixed random order: every
    tenth held out, each side cut to about its number of characters."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    files = [files[i] for i in np.random.default_rng(0).permutation(len(files))]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]

    def upto(docs, n_chars):
        cut = np.searchsorted(np.cumsum([len(d) for d in docs]), n_chars) + 1
        return docs[:cut]

    return upto([t for i, t in enumerate(texts) if i % 10], train_chars), upto(texts[::10], eval_chars)


def train_tokenizer(texts, vocab_size):
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  show_progress=False)
    return Tokenizer.from_str(tokenizer.to_str())  # the plain Tokenizer that tokenizer.json files load as


def to_blocks(tokenizer, texts, seq_len):
    """Documents joined by the end-of-text token, cut into (n, seq_len + 1) blocks."""
    eot = tokenizer.token_to_id(EOT)
    ids = np.concatenate([e.ids + [eot] for e in tokenizer.encode_batch(texts)]).astype(np.int32)
    n = len(ids) // (seq_len + 1)
    return ids[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def collate_fn(examples):
    return {"input_ids": np.stack(examples)}  # (B, T + 1)


def loss_fn(model, batch, key):
    ids = batch["input_ids"]
    logits = jax.vmap(model)(ids[:, :-1])  # (B, T, V), split over the vocabulary
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids[:, 1:]).mean()


def pred_fn(model, batch, key, *, max_new_tokens, pad_token_id):
    return models.generate(model, batch["input_ids"], attention_mask=batch["attention_mask"],
                           max_new_tokens=max_new_tokens, sampler=models.sample(0.8, top_k=40), key=key,
                           pad_token_id=pad_token_id)


def collate_prompts(prompts, tokenizer):
    """Left-padded prompts: generation continues every row from its last column."""
    ids = [tokenizer.encode(p).ids for p in prompts]
    width = max(map(len, ids))
    pad = tokenizer.token_to_id(EOT)
    return {"input_ids": np.array([[pad] * (width - len(x)) + x for x in ids], np.int32),
            "attention_mask": np.array([[False] * (width - len(x)) + [True] * len(x) for x in ids])}


def log(*args):
    if jax.process_index() == 0:  # every process runs this script; one of them speaks
        print(*args, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--n_pipeline_stages", type=int, default=1,
                        help="split the stacked layers into this many pipeline stages (dividing --n_layers)")
    parser.add_argument("--microbatches", type=int, help="with stages: microbatches a step (default 4 x stages)")
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--n_epochs", type=int, default=3)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--train_chars", type=int, default=1_000_000, help="about 300k tokens")
    parser.add_argument("--eval_chars", type=int, default=100_000)
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=4)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--sample_tokens", type=int, default=48)
    parser.add_argument("--log_every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init_from", help="a Hugging Face checkpoint dir: config.json, *.safetensors, tokenizer.json")
    parser.add_argument("--export", help="write the trained model (and tokenizer.json) here for Transformers")
    parser.add_argument("--workdir", help="keep the last and the best checkpoint, and logs, here")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --workdir")
    args = parser.parse_args()
    if args.resume and not args.workdir:
        parser.error("--resume needs --workdir")

    key = jax.random.key(args.seed)
    model_key, state_key, data_key, sample_key = jax.random.split(key, 4)
    mesh = redeqx.make_mesh(args.n_model_shards, n_pipeline_stages=args.n_pipeline_stages)
    train_texts, eval_texts = load_texts(args.train_chars, args.eval_chars)
    if args.init_from:  # a checkpoint brings its own tokenizer and sizes
        tokenizer = Tokenizer.from_file(str(Path(args.init_from) / "tokenizer.json"))
        model = models.from_pretrained(args.init_from, mesh)
    else:
        tokenizer = train_tokenizer(train_texts, args.vocab_size)
        eot = tokenizer.token_to_id(EOT)
        config = models.LlamaConfig(
            vocab_size=tokenizer.get_vocab_size(), hidden_size=args.hidden_size,
            intermediate_size=64 * math.ceil(args.hidden_size * 8 / 3 / 64), num_hidden_layers=args.n_layers,
            num_attention_heads=args.n_heads, max_position_embeddings=args.seq_len + args.sample_tokens + 16,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=eot, pad_token_id=eot)
        model = models.LlamaForCausalLM(config, key=model_key)
    train = to_blocks(tokenizer, train_texts, args.seq_len)
    test = to_blocks(tokenizer, eval_texts, args.seq_len)
    batch = collate_fn(train[:args.per_device_batch_size * mesh.shape["data"]])  # one global batch: its shapes
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)  # each weight's role, from the program
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    log(f"{len(jax.devices())} devices in {jax.process_count()} process(es), mesh {dict(mesh.shape)}; "
        f"{len(train)} train / {len(test)} held-out blocks of {args.seq_len + 1} tokens; "
        f"{n_params / 1e6:.2f}M parameters")
    log(redeqx.explain(model, specs, mesh, loss_fn=loss_fn, batch=batch).splitlines()[-1])

    schedule = redeqx.lr_schedule(len(train), args.per_device_batch_size, args.n_epochs, args.learning_rate, mesh,
                                  schedule_type="cosine", warmup_ratio=0.05)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.1))
    state = redeqx.init_state(model, optimizer, mesh, specs, key=state_key)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs, microbatches=args.microbatches)
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs, microbatches=args.microbatches)
    pad = tokenizer.token_to_id(EOT)
    predict_step = redeqx.make_predict_step(
        functools.partial(pred_fn, max_new_tokens=args.sample_tokens, pad_token_id=pad), mesh, specs)

    start_epoch, manager, logger = 0, None, None
    if args.workdir:
        manager = redeqx.CheckpointManager(args.workdir, keep_last=1, unit="epoch", best={"eval_loss": "min"})
        logger = redeqx.Logger(args.workdir)  # TensorBoard event files + metrics.jsonl + log.txt
        if args.resume and (found := manager.restore(state, mesh, specs)) is not None:
            state, meta = found
            start_epoch = meta["epoch"]
            log(f"resumed from step {meta['step']}, epoch {start_epoch}")

    def held_out_loss():
        return redeqx.evaluate(eval_step, state.model, test, collate_fn, args.per_device_batch_size, mesh,
                               key=data_key)["loss"]

    loss = held_out_loss()
    log(f"step {int(state.step)}: held-out loss {loss:.4f}, perplexity {math.exp(loss):.1f}")
    tokens_per_step = args.per_device_batch_size * mesh.shape["data"] * args.seq_len
    logged = int(state.step)  # the Logger's throughput counts what was done since its last call
    for epoch in range(start_epoch, args.n_epochs):
        epoch_key = jax.random.fold_in(data_key, epoch)
        for batch in redeqx.batches(train, collate_fn, args.per_device_batch_size, mesh, shuffle=True,
                                    key=epoch_key):
            state, metrics = train_step(state, batch)
            step = int(state.step)
            if step % args.log_every == 0:
                log(f"step {step}: train loss {float(metrics['loss']):.4f}")
                if logger is not None:
                    logger.log({**metrics, "learning_rate": schedule(step - 1)}, step,
                               tokens=(step - logged) * tokens_per_step)
                    logged = step
        loss = held_out_loss()
        log(f"epoch {epoch}: step {int(state.step)}, held-out loss {loss:.4f}, perplexity {math.exp(loss):.1f}")
        if manager is not None:
            logger.log({"eval_loss": loss, "eval_perplexity": math.exp(loss)}, int(state.step))
            logged = int(state.step)
            manager.save(state, epoch=epoch + 1, metrics={"eval_loss": loss})  # at a SIGTERM: saves, exits 143
    if manager is not None:
        manager.close()
        logger.close()

    samples = redeqx.predict(predict_step, state.model, PROMPTS, lambda ps: collate_prompts(ps, tokenizer), 1, mesh,
                             key=sample_key, output_fn=lambda out: tokenizer.decode_batch(out.tolist()))
    for prompt, text in zip(PROMPTS, samples):
        log(f"--- sample\n{prompt}{text}")
    if args.export:  # every process takes part (gathers shards); process 0 writes
        models.save_pretrained(state.model, args.export)
        if jax.process_index() == 0:
            tokenizer.save(str(Path(args.export) / "tokenizer.json"))
        log(f"exported to {args.export} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
    log(f"final held-out loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    redeqx.initialize()  # joins the other hosts' processes (SLURM, env vars, launcher); no-op on one host
    main()
