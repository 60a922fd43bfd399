"""LoRA: adapt a LLaMA (redeqx.models) pre-trained on Python source code to
English documentation, the Python language reference that ships with Python
(``pydoc_data.topics``, the text behind ``help("topics")``), by training
low-rank adapters only.

    python examples/lora/main.py                     # pre-trains a small base on stdlib source, then LoRA; ~4 min
    python examples/language_modeling/main.py --export runs/lm/hf
    python examples/lora/main.py --init_from runs/lm/hf            # adapt that checkpoint instead
    python examples/lora/main.py --workdir runs/lora --export runs/lora/hf   # merged weights for Transformers
    python -m redeqx.launch -n 2 examples/lora/main.py             # 2 processes x 4 devices

One language-reference topic in five is held out. The base model sees only
code; the adapters (rank 8 on every projection and on the output head, whose
adapter lets the output distribution move to the words of prose) learn the
docs, and their held-out loss falls while the base weights stay bit-identical.
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
from pydoc_data.topics import topics  # noqa: E402
from tokenizers import ByteLevelBPETokenizer, Tokenizer  # noqa: E402

import redeqx  # noqa: E402
from redeqx import models  # noqa: E402

EOT = "<|endoftext|>"
PROMPTS = ["The \"for\" statement is used to", "A class definition"]


def load_texts(source_chars, docs_chars):
    """(source code, docs train, docs held out): the standard library's
    top-level modules, and the language reference's topics, one in five held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    source = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    docs = [topics[k] for k in sorted(topics)]

    def upto(texts, n_chars):
        return texts[: np.searchsorted(np.cumsum([len(t) for t in texts]), n_chars) + 1]

    return upto(source, source_chars), upto([d for i, d in enumerate(docs) if i % 5], docs_chars), \
        upto(docs[::5], docs_chars // 4)


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
    logits = jax.vmap(model)(ids[:, :-1])  # (B, T, V)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids[:, 1:]).mean()


def pred_fn(model, batch, key, *, max_new_tokens):
    return models.generate(model, batch["input_ids"], attention_mask=batch["attention_mask"],
                           max_new_tokens=max_new_tokens, sampler=models.sample(0.8, top_k=40), key=key)


def collate_prompts(prompts, tokenizer):
    """Left-padded prompts: generation continues every row from its last column."""
    ids = [tokenizer.encode(p).ids for p in prompts]
    width = max(map(len, ids))
    pad = tokenizer.token_to_id(EOT)
    return {"input_ids": np.array([[pad] * (width - len(x)) + x for x in ids], np.int32),
            "attention_mask": np.array([[False] * (width - len(x)) + [True] * len(x) for x in ids])}


def base_model(args, source, mesh, key):
    """A small LLaMA and a byte-level BPE tokenizer, both trained on source code only."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(source, vocab_size=args.vocab_size, min_frequency=2, special_tokens=[EOT],
                            show_progress=False)
    tokenizer = Tokenizer.from_str(bpe.to_str())
    eot = tokenizer.token_to_id(EOT)
    config = models.LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=args.hidden_size,
                                intermediate_size=64 * math.ceil(args.hidden_size * 8 / 3 / 64),
                                num_hidden_layers=args.n_layers, num_attention_heads=4,
                                max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
                                eos_token_id=eot, pad_token_id=eot)
    model_key, state_key, data_key = jax.random.split(key, 3)
    model = models.LlamaForCausalLM(config, key=model_key)
    blocks = to_blocks(tokenizer, source, args.seq_len)
    batch = collate_fn(blocks[:args.per_device_batch_size * mesh.shape["data"]])  # one global batch: its shapes
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)  # each weight's role, from the program
    schedule = redeqx.lr_schedule(len(blocks), args.per_device_batch_size, args.pretrain_epochs, 2e-3, mesh,
                                  schedule_type="cosine", warmup_ratio=0.05)
    optimizer = optax.adamw(schedule, b2=0.95, weight_decay=0.1)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=state_key)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    for epoch in range(args.pretrain_epochs):
        for batch in redeqx.batches(blocks, collate_fn, args.per_device_batch_size, mesh, shuffle=True,
                                    key=jax.random.fold_in(data_key, epoch), desc=f"pre-training epoch {epoch}"):
            state, metrics = train_step(state, batch)
    log(f"pre-trained on {len(blocks)} blocks of source for {int(state.step)} steps: "
        f"train loss {float(metrics['loss']):.4f}")
    return state.model, tokenizer


def log(*args):
    if jax.process_index() == 0:  # every process runs this script; one of them speaks
        print(*args, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--n_epochs", type=int, default=3)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--targets", default=r"(q|k|v|o|gate|up|down)_proj$|lm_head$", help="regex on layer paths")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--docs_chars", type=int, default=400_000, help="docs to train on (1/4 as much held out)")
    parser.add_argument("--source_chars", type=int, default=600_000, help="source code to pre-train the base on")
    parser.add_argument("--pretrain_epochs", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=4)
    parser.add_argument("--sample_tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init_from", help="a Hugging Face checkpoint dir: config.json, *.safetensors, tokenizer.json")
    parser.add_argument("--export", help="write the merged model (and tokenizer.json) here for Transformers")
    parser.add_argument("--workdir", help="keep the last and the best checkpoint, and logs, here")
    args = parser.parse_args()

    key = jax.random.key(args.seed)
    base_key, lora_key, state_key, data_key = jax.random.split(key, 4)
    mesh = redeqx.make_mesh(args.n_model_shards)
    source, docs_train, docs_test = load_texts(args.source_chars, args.docs_chars)
    if args.init_from:  # a checkpoint brings its own tokenizer and sizes
        base = models.from_pretrained(args.init_from, mesh)
        tokenizer = Tokenizer.from_file(str(Path(args.init_from) / "tokenizer.json"))
    else:
        base, tokenizer = base_model(args, source, mesh, base_key)
    train, test = to_blocks(tokenizer, docs_train, args.seq_len), to_blocks(tokenizer, docs_test, args.seq_len)

    model = models.lora(base, args.targets, rank=args.rank, alpha=args.alpha, key=lora_key)
    trainable = models.lora_trainable(model)  # True at every lora_a / lora_b
    batch = collate_fn(train[:args.per_device_batch_size * mesh.shape["data"]])
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)  # adapters split with their layer
    n_train = sum(x.size for x in jax.tree.leaves(eqx.filter(model, trainable)))
    n_total = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    log(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}; docs: {len(train)} train / {len(test)} held-out "
        f"blocks of {args.seq_len + 1} tokens; trainable parameters {n_train:,} of {n_total:,} "
        f"({100 * n_train / n_total:.2f}%)")

    schedule = redeqx.lr_schedule(len(train), args.per_device_batch_size, args.n_epochs, args.learning_rate, mesh,
                                  schedule_type="cosine", warmup_ratio=0.05)
    optimizer = optax.adamw(schedule, weight_decay=0.0)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=state_key, trainable=trainable)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs, trainable=trainable)
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)
    predict_step = redeqx.make_predict_step(functools.partial(pred_fn, max_new_tokens=args.sample_tokens), mesh, specs)

    def report(name):
        loss = redeqx.evaluate(eval_step, state.model, test, collate_fn, args.per_device_batch_size, mesh,
                               key=data_key)["loss"]
        log(f"{name}: step {int(state.step)}, held-out docs loss {loss:.4f}, perplexity {math.exp(loss):.1f}")
        return loss

    def samples():
        texts = redeqx.predict(predict_step, state.model, PROMPTS, lambda ps: collate_prompts(ps, tokenizer), 1, mesh,
                               key=data_key, output_fn=lambda out: tokenizer.decode_batch(out.tolist()))
        for prompt, text in zip(PROMPTS, texts):
            log(f"--- {prompt}{text}")

    manager, logger = None, None
    if args.workdir:
        manager = redeqx.CheckpointManager(args.workdir, keep_last=1, unit="epoch", best={"eval_loss": "min"})
        logger = redeqx.Logger(args.workdir)
    loss = report("base model")
    samples()
    for epoch in range(args.n_epochs):
        for batch in redeqx.batches(train, collate_fn, args.per_device_batch_size, mesh, shuffle=True,
                                    key=jax.random.fold_in(data_key, epoch), desc=f"epoch {epoch}"):
            state, metrics = train_step(state, batch)
            if logger is not None:
                logger.log({**metrics, "learning_rate": schedule(state.step - 1)}, int(state.step),
                           tokens=len(batch["input_ids"]) * args.seq_len)
        loss = report(f"epoch {epoch}")
        if manager is not None:
            logger.log({"eval_loss": loss}, int(state.step))
            manager.save(state, epoch=epoch + 1, metrics={"eval_loss": loss})  # at a SIGTERM: saves, exits 143
    if manager is not None:
        manager.close()
        logger.close()
    samples()

    if args.export:  # fold the adapters into the weights: a plain LLaMA checkpoint
        models.save_pretrained(models.merge_lora(state.model), args.export)
        if jax.process_index() == 0:
            tokenizer.save(str(Path(args.export) / "tokenizer.json"))
        log(f"exported the merged model to {args.export}")
    log(f"final held-out docs loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    redeqx.initialize()  # joins the other hosts' processes (SLURM, env vars, launcher); no-op on one host
    main()
