"""Docstring -> function name with a T5 trained from scratch on Python's own
standard library: redco's appendix example (seq2seq, ROUGE, best checkpoint
by ROUGE-L) in redeqx, on data that ships with Python.

    python examples/text_to_text/main.py --workdir runs/t2t     # 8 simulated CPU devices, a few minutes
    python examples/text_to_text/main.py --n_model_shards 4 --per_device_batch_size 16
    python -m redeqx.launch -n 2 examples/text_to_text/main.py  # 2 processes x 4 devices, as on 2 hosts
    tensorboard --logdir runs/t2t

Every function with a docstring in the stdlib (tests left out) gives one
example: the docstring's first paragraph -> the function's name in snake
case (`getConfigVars` -> `get_config_vars`); one docstring in 10 is held out
for testing. A BPE tokenizer is trained on the training text; names are
decoded by beam search and scored with ROUGE-1/2/L over their words.
"""

import argparse
import ast
import os
import re
import sysconfig
import zlib
from functools import partial
from pathlib import Path

# On a machine with no accelerator, pretend to have 8 devices (must precede `import jax`).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from rouge_score import rouge_scorer  # noqa: E402
from tokenizers import Tokenizer, normalizers, pre_tokenizers, trainers  # noqa: E402
from tokenizers.models import BPE  # noqa: E402

import redeqx  # noqa: E402
from redeqx import models  # noqa: E402

PAD, EOS = 0, 1  # T5's conventions: decoding starts from PAD, ends with EOS


def snake_case(name):  # getConfigVars -> get_config_vars
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def load_examples():
    """(docstring, name) pairs from every stdlib module (tests left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, test, seen = [], [], set()
    for path in sorted(root.rglob("*.py")):
        if {"site-packages", "test", "tests", "idle_test"} & set(path.parts):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except SyntaxError:  # a few lib2to3 fixtures are Python 2
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__"):
                doc = " ".join((ast.get_docstring(node) or "").split("\n\n")[0].split())
                if len(doc) >= 10 and doc not in seen:
                    seen.add(doc)
                    split = test if zlib.crc32(doc.encode()) % 10 == 0 else train  # 1 in 10, at random
                    split.append({"src": doc, "tgt": snake_case(node.name)})
    return train, test


def train_tokenizer(examples, vocab_size):
    """Lower-case BPE within words, words split at spaces and punctuation (`_` too), so the
    `running` of a docstring and of `get_running_loop` are the same tokens. Every process
    trains the same one."""
    tokenizer = Tokenizer(BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=["<pad>", "</s>", "<unk>"])  # ids 0, 1, 2
    tokenizer.train_from_iterator([e["src"] for e in examples] + [e["tgt"] for e in examples], trainer)
    return tokenizer


def encode(tokenizer, texts, length):
    ids = np.full((len(texts), length), PAD, np.int32)
    for i, enc in enumerate(tokenizer.encode_batch(texts)):
        row = enc.ids[:length - 1] + [EOS]
        ids[i, :len(row)] = row
    return ids


def collate_fn(examples, tokenizer, src_len, tgt_len):
    input_ids = encode(tokenizer, [e["src"] for e in examples], src_len)  # (B, S)
    return {"input_ids": input_ids, "attention_mask": input_ids != PAD,
            "labels": encode(tokenizer, [e["tgt"] for e in examples], tgt_len)}  # (B, T)


def loss_fn(model, batch, key):
    decoder_input_ids = models.shift_right(batch["labels"], model.config)  # (B, T): PAD, then labels
    logits = jax.vmap(lambda i, d, m: model(i, d, attention_mask=m))(
        batch["input_ids"], decoder_input_ids, batch["attention_mask"])  # (B, T, vocab)
    weights = batch["labels"] != PAD
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return (loss * weights).sum() / weights.sum()


def pred_fn(model, batch, key, num_beams, max_new_tokens):
    return models.beam_search(model, batch["input_ids"], attention_mask=batch["attention_mask"],
                              num_beams=num_beams, max_new_tokens=max_new_tokens, eos_token_id=EOS,
                              pad_token_id=PAD)  # (B, max_new_tokens)


def rouge(names, examples):
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    scores = [scorer.score(e["tgt"].replace("_", " "), n.replace("_", " ")) for n, e in zip(names, examples)]
    return {k: float(np.mean([s[k].fmeasure for s in scores])) for k in ("rouge1", "rouge2", "rougeL")}


def log(*args):
    if jax.process_index() == 0:  # every process runs this script; one of them speaks
        print(*args, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--n_epochs", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=1024)
    parser.add_argument("--src_len", type=int, default=48)
    parser.add_argument("--tgt_len", type=int, default=10)
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--n_train", type=int, default=None, help="use only this many training examples")
    parser.add_argument("--n_eval", type=int, default=256, help="test examples scored after each epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep the last and the best (ROUGE-L) checkpoint, and logs, here")
    args = parser.parse_args()

    key = jax.random.key(args.seed)
    model_key, state_key, data_key = jax.random.split(key, 3)
    train, test = load_examples()
    train = train[:args.n_train]
    tokenizer = train_tokenizer(train, args.vocab_size)
    collate = partial(collate_fn, tokenizer=tokenizer, src_len=args.src_len, tgt_len=args.tgt_len)

    mesh = redeqx.make_mesh(args.n_model_shards)
    config = models.T5Config(vocab_size=tokenizer.get_vocab_size(), d_model=args.d_model, d_kv=32,
                             d_ff=4 * args.d_model, num_layers=args.n_layers, num_heads=args.d_model // 32,
                             feed_forward_proj="gated-gelu")
    model = models.T5ForConditionalGeneration(config, key=model_key)  # T5's own init, as Transformers draws it
    batch = collate(train[:args.per_device_batch_size * mesh.shape["data"]])  # one global batch: its shapes
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)  # each weight's role, from the program
    log(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}; {len(train)} train / {len(test)} test examples; "
        f"{sum(x.size for x in jax.tree.leaves(model))} parameters")

    schedule = redeqx.lr_schedule(len(train), args.per_device_batch_size, args.n_epochs, args.learning_rate, mesh,
                                  warmup_ratio=0.05)
    optimizer = optax.adamw(schedule, weight_decay=0.01)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=state_key)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)
    predict_step = redeqx.make_predict_step(
        partial(pred_fn, num_beams=args.num_beams, max_new_tokens=args.tgt_len), mesh, specs)
    output_fn = lambda preds: [s.replace(" ", "") for s in tokenizer.decode_batch(preds.tolist())]  # noqa: E731

    def generate_names(model, examples):
        return redeqx.predict(predict_step, model, examples, collate, 4 * args.per_device_batch_size, mesh,
                              key=data_key, output_fn=output_fn)

    manager = logger = None
    if args.workdir:
        manager = redeqx.CheckpointManager(args.workdir, keep_last=1, unit="epoch", best={"rougeL": "max"})
        logger = redeqx.Logger(args.workdir)

    for epoch in range(args.n_epochs):
        epoch_key = jax.random.fold_in(data_key, epoch)
        for batch in redeqx.batches(train, collate, args.per_device_batch_size, mesh, shuffle=True, key=epoch_key,
                                    desc=f"epoch {epoch}"):
            state, metrics = train_step(state, batch)
            if logger is not None:
                logger.log({**metrics, "learning_rate": schedule(state.step)}, int(state.step),
                           examples=len(batch["labels"]))
        results = redeqx.evaluate(eval_step, state.model, test, collate, 4 * args.per_device_batch_size, mesh,
                                  key=epoch_key)
        results |= rouge(generate_names(state.model, test[:args.n_eval]), test[:args.n_eval])
        log(f"epoch {epoch}: step {int(state.step)}, train loss {float(metrics['loss']):.4f}, "
            f"test loss {results['loss']:.4f}, " + ", ".join(f"{k} {v:.4f}" for k, v in results.items() if k != "loss"))
        if manager is not None:
            logger.log({f"test_{k}": v for k, v in results.items()}, int(state.step))
            manager.save(state, epoch=epoch + 1, metrics=results)  # at a SIGTERM: saves, exits 143

    model = state.model
    if manager is not None:  # the final predictions come from the best checkpoint by ROUGE-L
        model, meta = manager.restore(state.model, mesh, specs, best="rougeL")
        log(f"best checkpoint by ROUGE-L: step {meta['step']}")
        manager.close()
    names = generate_names(model, test)
    results = rouge(names, test)
    log("final test " + ", ".join(f"{k} {v:.4f}" for k, v in results.items()) + f" ({len(names)} names)")
    for name, e in list(zip(names, test))[:8]:
        log(f"  {e['src'][:70]!r:74} -> {name:24} (true: {e['tgt']})")
    if logger is not None:
        logger.save_outputs([{**e, "pred": n} for n, e in zip(names, test)], "test_names", int(state.step))
        logger.close()
    return results


if __name__ == "__main__":
    redeqx.initialize()  # joins the other hosts' processes (SLURM, env vars, launcher); no-op on one host
    main()
