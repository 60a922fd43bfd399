"""Image captioning on scikit-learn's 8x8 digits: a small CNN encoder and a
transformer decoder with cross-attention, trained on every device with redeqx.

    python examples/image_to_text/main.py --workdir runs/i2t    # 8 simulated CPU devices, ~2 minutes
    python examples/image_to_text/main.py --n_model_shards 4 --per_device_batch_size 16
    python -m redeqx.launch -n 2 examples/image_to_text/main.py  # 2 processes x 4 devices, as on 2 hosts
    tensorboard --logdir runs/i2t

Captions are generated from the label and two image statistics, each split
into thirds within the digit's class: how much ink ("thin"/"thick") and the
slant of the strokes ("leaning left"/"leaning right"), e.g. "a thick seven
leaning right" or "an eight". Captions are decoded greedily and scored by
exact match and BLEU-4; a grid of test images with their captions is saved.
"""

import argparse
import os

# On a machine with no accelerator, pretend to have 8 devices (must precede `import jax`).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from nltk.translate.bleu_score import SmoothingFunction, corpus_bleu  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import redeqx  # noqa: E402

DIGITS = "zero one two three four five six seven eight nine".split()
VOCAB = ["<pad>", "<s>", "</s>", "a", "an", "thin", "thick", "leaning", "left", "right"] + DIGITS
PAD, BOS, EOS = 0, 1, 2
MAX_LEN = 8  # <s> a thick seven leaning right </s>, padded


def caption(label, ink_third, slant_third):
    words = [["thin"], [], ["thick"]][ink_third] + [DIGITS[label]] + [["leaning", "right"], [], ["leaning", "left"]][slant_third]
    return " ".join(["an" if words[0] == "eight" else "a"] + words)


def load_examples(seed):
    digits = load_digits()
    images = digits.images / 16.0  # (N, 8, 8) in [0, 1]
    rows, cols = np.mgrid[:8, :8]
    mass = images.sum((1, 2))
    r = (images * rows).sum((1, 2)) / mass
    c = (images * cols).sum((1, 2)) / mass
    slant = (images * (rows - r[:, None, None]) * (cols - c[:, None, None])).sum((1, 2)) / mass  # < 0: top to the right
    thirds = lambda v, y: np.array([np.searchsorted(np.quantile(v[y == y_], [1 / 3, 2 / 3]), x)  # noqa: E731
                                    for x, y_ in zip(v, y)])
    ink, lean = thirds(mass, digits.target), thirds(slant, digits.target)
    examples = [{"image": im.astype(np.float32), "caption": caption(y, i, s)}
                for im, y, i, s in zip(images, digits.target, ink, lean)]
    return train_test_split(examples, test_size=0.2, random_state=seed, stratify=digits.target)


def collate_fn(examples):
    tokens = np.full((len(examples), MAX_LEN + 1), PAD, np.int32)
    for i, e in enumerate(examples):
        ids = [BOS] + [VOCAB.index(w) for w in e["caption"].split()] + [EOS]
        tokens[i, :len(ids)] = ids
    return {"image": np.stack([e["image"] for e in examples]),  # (B, 8, 8)
            "inputs": tokens[:, :-1], "targets": tokens[:, 1:]}  # (B, MAX_LEN) each


class Block(eqx.Module):
    norms: list[eqx.nn.LayerNorm]
    self_attn: eqx.nn.MultiheadAttention
    cross_attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP

    def __init__(self, d, n_heads, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norms = [eqx.nn.LayerNorm(d) for _ in range(3)]
        self.self_attn = eqx.nn.MultiheadAttention(n_heads, d, key=k1)
        self.cross_attn = eqx.nn.MultiheadAttention(n_heads, d, key=k2)
        self.mlp = eqx.nn.MLP(d, d, 4 * d, depth=1, activation=jax.nn.gelu, key=k3)

    def __call__(self, x, memory):  # x: (T, d) caption so far, memory: (64, d) image features
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        h = jax.vmap(self.norms[0])(x)
        x = x + self.self_attn(h, h, h, mask=causal)
        x = x + self.cross_attn(jax.vmap(self.norms[1])(x), memory, memory)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norms[2])(x))


class Captioner(eqx.Module):
    convs: list[eqx.nn.Conv2d]
    pixel_pos: jax.Array  # (64, d) one learned position per pixel
    embed: eqx.nn.Embedding
    token_pos: jax.Array  # (MAX_LEN, d)
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, d, n_layers, n_heads, *, key):
        keys = jax.random.split(key, 6 + n_layers)
        self.convs = [eqx.nn.Conv2d(1, d, 3, padding=1, key=keys[0]), eqx.nn.Conv2d(d, d, 3, padding=1, key=keys[1])]
        self.pixel_pos = jax.random.normal(keys[2], (64, d))
        self.embed = eqx.nn.Embedding(len(VOCAB), d, key=keys[3])
        self.token_pos = 0.02 * jax.random.normal(keys[4], (MAX_LEN, d))
        self.blocks = [Block(d, n_heads, key=k) for k in keys[6:]]
        self.norm = eqx.nn.LayerNorm(d)
        self.head = eqx.nn.Linear(d, len(VOCAB), key=keys[5])

    def encode(self, image):  # (8, 8) -> (64, d)
        x = jax.nn.gelu(self.convs[0](image[None]))  # (d, 8, 8)
        x = jax.nn.gelu(self.convs[1](x))  # (d, 8, 8)
        return x.reshape(x.shape[0], -1).T + self.pixel_pos  # (64, d): one token per pixel

    def decode(self, memory, tokens):  # (64, d), (T,) -> (T, vocab)
        x = jax.vmap(self.embed)(tokens) + self.token_pos[:tokens.shape[0]]
        for block in self.blocks:
            x = block(x, memory)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def loss_fn(model, batch, key):
    logits = jax.vmap(lambda im, t: model.decode(model.encode(im), t))(batch["image"], batch["inputs"])  # (B, T, V)
    weights = batch["targets"] != PAD
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    correct = (logits.argmax(-1) == batch["targets"]) | ~weights
    return (loss * weights).sum() / weights.sum(), {"caption_accuracy": correct.all(-1).mean()}


def pred_fn(model, batch, key):  # greedy decoding, one token at a time
    memory = jax.vmap(model.encode)(batch["image"])  # (B, 64, d)
    tokens = jnp.full(batch["inputs"].shape, PAD).at[:, 0].set(BOS)  # (B, T)

    def step(i, tokens):
        logits = jax.vmap(model.decode)(memory, tokens)  # (B, T, V); the causal mask hides what follows i
        return tokens.at[:, i + 1].set(logits[:, i].argmax(-1))

    return jax.lax.fori_loop(0, MAX_LEN - 1, step, tokens)[:, 1:]


def output_fn(preds):  # token ids -> caption strings, up to </s>
    return [" ".join(VOCAB[t] for t in row[:list(row).index(EOS) if EOS in row else None]) for row in preds]


def scores(captions, examples):
    refs = [[e["caption"].split()] for e in examples]
    return {"exact_match": float(np.mean([c == e["caption"] for c, e in zip(captions, examples)])),
            "bleu": corpus_bleu(refs, [c.split() for c in captions], smoothing_function=SmoothingFunction().method1)}


def save_grid(examples, captions, path, n=16):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, n // 4, figsize=(10, 10))
    for ax, e, c in zip(axes.flat, examples, captions):
        ax.imshow(e["image"], cmap="gray_r")
        wrong = "" if c == e["caption"] else f"\n(true: {e['caption']})"  # a wrong caption, in red, over the truth
        ax.set_title(c + wrong, fontsize=9, color="red" if wrong else "black")
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)


def log(*args):
    if jax.process_index() == 0:  # every process runs this script; one of them speaks
        print(*args, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--n_epochs", type=int, default=30)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--n_layers", type=int, default=2)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep the last and the best (BLEU) checkpoint, logs and a picture here")
    args = parser.parse_args()

    key = jax.random.key(args.seed)
    model_key, state_key, data_key = jax.random.split(key, 3)
    train, test = load_examples(args.seed)

    mesh = redeqx.make_mesh(args.n_model_shards)
    model = Captioner(args.d_model, args.n_layers, args.n_heads, key=model_key)
    batch = collate_fn(train[:args.per_device_batch_size * mesh.shape["data"]])  # one global batch: its shapes
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)  # each weight's role, from the program
    log(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}; {len(train)} train / {len(test)} test examples")

    schedule = redeqx.lr_schedule(len(train), args.per_device_batch_size, args.n_epochs, args.learning_rate, mesh,
                                  schedule_type="cosine", warmup_ratio=0.05)
    optimizer = optax.adamw(schedule, weight_decay=1e-4)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=state_key)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)
    predict_step = redeqx.make_predict_step(pred_fn, mesh, specs)

    manager = logger = None
    if args.workdir:
        manager = redeqx.CheckpointManager(args.workdir, keep_last=1, unit="epoch", best={"bleu": "max"})
        logger = redeqx.Logger(args.workdir)

    for epoch in range(args.n_epochs):
        epoch_key = jax.random.fold_in(data_key, epoch)
        for batch in redeqx.batches(train, collate_fn, args.per_device_batch_size, mesh, shuffle=True, key=epoch_key):
            state, metrics = train_step(state, batch)
        results = redeqx.evaluate(eval_step, state.model, test, collate_fn, args.per_device_batch_size, mesh,
                                  key=epoch_key)
        captions = redeqx.predict(predict_step, state.model, test, collate_fn, args.per_device_batch_size, mesh,
                                  key=epoch_key, output_fn=output_fn)
        results |= scores(captions, test)
        log(f"epoch {epoch}: step {int(state.step)}, train loss {float(metrics['loss']):.4f}, "
            f"test loss {results['loss']:.4f}, exact match {results['exact_match']:.4f}, BLEU {results['bleu']:.4f}")
        if manager is not None:
            logger.log({"train_loss": metrics["loss"], **{f"test_{k}": v for k, v in results.items()}},
                       int(state.step), examples=len(train))
            manager.save(state, epoch=epoch + 1, metrics=results)  # at a SIGTERM: saves, exits 143

    if manager is not None:  # the final captions come from the best checkpoint by BLEU
        model, meta = manager.restore(state.model, mesh, specs, best="bleu")
        manager.close()
        captions = redeqx.predict(predict_step, model, test, collate_fn, args.per_device_batch_size, mesh,
                                  key=data_key, output_fn=output_fn)
        logger.save_outputs([{"caption": c, "true": e["caption"]} for c, e in zip(captions, test)], "captions",
                            meta["step"])
        if jax.process_index() == 0:
            save_grid(test, captions, os.path.join(args.workdir, "captions.png"))
        logger.close()
    final = scores(captions, test)
    log(f"final test exact match {final['exact_match']:.4f}, BLEU {final['bleu']:.4f} ({len(captions)} captions)")
    for c, e in list(zip(captions, test))[:6]:
        log(f"  {c!r:32} (true: {e['caption']!r})")
    return final


if __name__ == "__main__":
    redeqx.initialize()  # joins the other hosts' processes (SLURM, env vars, launcher); no-op on one host
    main()
