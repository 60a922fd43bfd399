"""Text to image: a small conditional DDPM that draws 8x8 digits from a
prompt ("draw a 7", "a handwritten seven"), trained on scikit-learn's digits
on every device with redeqx.

    python examples/text_to_image/main.py --workdir runs/t2i    # 8 simulated CPU devices, a few minutes
    python examples/text_to_image/main.py --n_model_shards 4 --per_device_batch_size 32
    python -m redeqx.launch -n 2 examples/text_to_image/main.py  # 2 processes x 4 devices, as on 2 hosts
    tensorboard --logdir runs/t2i

The denoiser is an MLP with residual blocks, told the time step (sinusoidal
features) and the prompt (the mean of its learned word embeddings); a linear
beta schedule; classifier-free guidance (the prompt is dropped from 10% of
the training examples). After each epoch it draws one row per digit into
`--workdir/samples_epoch<N>.png` and scores the drawings with a logistic
regression trained on real digits: "prompt accuracy" is how often the
classifier reads the digit the prompt asked for.
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
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import redeqx  # noqa: E402

WORDS = "zero one two three four five six seven eight nine".split()
TEMPLATES = ["draw a {d}", "draw a {w}", "the digit {d}", "a handwritten {w}", "sketch the number {w}", "{d}"]
VOCAB = ["<pad>"] + sorted({t for tpl in TEMPLATES for n in range(10) for t in tpl.format(d=n, w=WORDS[n]).split()})
PAD, PROMPT_LEN = 0, 4
T = 200  # diffusion steps
BETAS = np.linspace(1e-4, 0.02, T, dtype=np.float32) * (1000 / T)  # Ho et al.'s linear schedule, 1000 steps -> T
ALPHA_BARS = np.cumprod(1 - BETAS)


def tokenize(prompt):
    ids = [VOCAB.index(w) for w in prompt.split()]
    return np.array(ids + [PAD] * (PROMPT_LEN - len(ids)), np.int32)


def load_examples(seed):
    digits = load_digits()
    images = (digits.images / 8.0 - 1.0).astype(np.float32)  # (N, 8, 8) in [-1, 1]
    rng = np.random.default_rng(seed)
    examples = [{"image": x, "prompt": rng.choice(TEMPLATES).format(d=y, w=WORDS[y]), "label": int(y)}
                for x, y in zip(images, digits.target)]
    return train_test_split(examples, test_size=0.1, random_state=seed, stratify=digits.target)


def collate_fn(examples):
    return {"image": np.stack([e["image"].reshape(-1) for e in examples]),  # (B, 64)
            "prompt": np.stack([tokenize(e["prompt"]) for e in examples])}  # (B, PROMPT_LEN)


def time_features(t, d):  # sinusoidal features of the step, as in the Transformer
    freqs = jnp.exp(-jnp.log(10_000.0) * jnp.arange(d // 2) / (d // 2))
    return jnp.concatenate([jnp.sin(t * freqs), jnp.cos(t * freqs)])


class Denoiser(eqx.Module):
    words: eqx.nn.Embedding  # (vocab, d): the text encoder is the mean of its words' embeddings
    time_mlp: eqx.nn.MLP
    inp: eqx.nn.Linear
    norms: list[eqx.nn.LayerNorm]
    blocks: list[eqx.nn.MLP]
    out: eqx.nn.Linear

    def __init__(self, d, n_blocks, *, key):
        keys = jax.random.split(key, 4 + n_blocks)
        self.words = eqx.nn.Embedding(len(VOCAB), d, key=keys[0])
        self.time_mlp = eqx.nn.MLP(d, d, d, depth=1, activation=jax.nn.silu, key=keys[1])
        self.inp = eqx.nn.Linear(64, d, key=keys[2])
        self.norms = [eqx.nn.LayerNorm(d) for _ in range(n_blocks)]
        self.blocks = [eqx.nn.MLP(d, d, 2 * d, depth=1, activation=jax.nn.silu, key=k) for k in keys[4:]]
        self.out = eqx.nn.Linear(d, 64, key=keys[3])

    def __call__(self, x, t, prompt):  # (64,) noisy image, () step, (PROMPT_LEN,) ids -> (64,) predicted noise
        mask = (prompt != PAD)[:, None]
        text = (jax.vmap(self.words)(prompt) * mask).sum(0) / jnp.maximum(mask.sum(), 1)  # all PAD: no prompt
        cond = self.time_mlp(time_features(t, text.shape[0])) + text  # (d,)
        h = self.inp(x) + cond
        for norm, block in zip(self.norms, self.blocks):
            h = h + block(norm(h) + cond)
        return self.out(h)


def loss_fn(model, batch, key):
    x0, prompt = batch["image"], batch["prompt"]
    k_t, k_noise, k_drop = jax.random.split(key, 3)
    t = jax.random.randint(k_t, (x0.shape[0],), 0, T)
    noise = jax.random.normal(k_noise, x0.shape)
    ab = jnp.asarray(ALPHA_BARS)[t][:, None]
    x_t = jnp.sqrt(ab) * x0 + jnp.sqrt(1 - ab) * noise
    prompt = jnp.where(jax.random.bernoulli(k_drop, 0.1, (x0.shape[0], 1)), PAD, prompt)  # for guidance
    return jnp.mean((jax.vmap(model)(x_t, t, prompt) - noise) ** 2)


def pred_fn(model, batch, key, guidance):  # DDPM ancestral sampling with classifier-free guidance
    prompt = batch["prompt"]
    k_init, k_steps = jax.random.split(key)

    def step(x, inputs):
        t, k = inputs
        ts = jnp.full((x.shape[0],), t)
        eps = jax.vmap(model)(x, ts, prompt)
        eps = (1 + guidance) * eps - guidance * jax.vmap(model)(x, ts, jnp.zeros_like(prompt))
        beta, ab = jnp.asarray(BETAS)[t], jnp.asarray(ALPHA_BARS)[t]
        mean = (x - beta / jnp.sqrt(1 - ab) * eps) / jnp.sqrt(1 - beta)
        return mean + jnp.where(t > 0, jnp.sqrt(beta), 0.0) * jax.random.normal(k, x.shape), None

    x = jax.random.normal(k_init, (prompt.shape[0], 64))
    x, _ = jax.lax.scan(step, x, (jnp.arange(T)[::-1], jax.random.split(k_steps, T)))
    return jnp.clip(x, -1, 1)  # (B, 64)


def save_grid(images, prompts, path):  # one row per prompt, 1-pixel white gaps
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols = 10, len(images) // 10
    grid = np.full((rows * 9 + 1, cols * 9 + 1), -1.0)
    for i, image in enumerate(images):
        r, c = divmod(i, cols)
        grid[1 + 9 * r:9 * (r + 1), 1 + 9 * c:9 * (c + 1)] = image.reshape(8, 8)
    fig, ax = plt.subplots(figsize=(0.5 * cols, 0.5 * rows))
    ax.imshow(grid, cmap="gray_r", vmin=-1, vmax=1)
    ax.set_yticks([5 + 9 * r for r in range(rows)], [prompts[r * cols] for r in range(rows)])
    ax.set_xticks([])
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def log(*args):
    if jax.process_index() == 0:  # every process runs this script; one of them speaks
        print(*args, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=16)
    parser.add_argument("--n_epochs", type=int, default=30)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--n_blocks", type=int, default=3)
    parser.add_argument("--guidance", type=float, default=2.0, help="classifier-free guidance weight (0: none)")
    parser.add_argument("--samples_per_digit", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep the last checkpoint, logs and a grid of samples per epoch here")
    args = parser.parse_args()

    key = jax.random.key(args.seed)
    model_key, state_key, data_key, sample_key = jax.random.split(key, 4)
    train, test = load_examples(args.seed)
    judge = LogisticRegression(max_iter=2000).fit([e["image"].reshape(-1) for e in train], [e["label"] for e in train])
    prompts = [{"prompt": TEMPLATES[d % len(TEMPLATES)].format(d=d, w=WORDS[d]), "label": d}  # a row per digit
               for d in range(10) for _ in range(args.samples_per_digit)]

    mesh = redeqx.make_mesh(args.n_model_shards)
    model = Denoiser(args.d_model, args.n_blocks, key=model_key)
    batch = collate_fn(train[:args.per_device_batch_size * mesh.shape["data"]])  # one global batch: its shapes
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)  # each weight's role, from the program
    log(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}; {len(train)} train / {len(test)} test images; "
        f"judge accuracy on real test digits {judge.score([e['image'].reshape(-1) for e in test], [e['label'] for e in test]):.3f}")

    schedule = redeqx.lr_schedule(len(train), args.per_device_batch_size, args.n_epochs, args.learning_rate, mesh,
                                  schedule_type="cosine", warmup_ratio=0.05)
    optimizer = optax.adamw(schedule, weight_decay=1e-4)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=state_key)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)
    predict_step = redeqx.make_predict_step(lambda m, b, k: pred_fn(m, b, k, args.guidance), mesh, specs)
    collate_prompts = lambda es: {"prompt": np.stack([tokenize(e["prompt"]) for e in es])}  # noqa: E731

    manager = logger = None
    if args.workdir:
        manager = redeqx.CheckpointManager(args.workdir, keep_last=1, unit="epoch")
        logger = redeqx.Logger(args.workdir)

    for epoch in range(args.n_epochs):
        epoch_key = jax.random.fold_in(data_key, epoch)
        for batch in redeqx.batches(train, collate_fn, args.per_device_batch_size, mesh, shuffle=True, key=epoch_key):
            state, metrics = train_step(state, batch)
        results = redeqx.evaluate(eval_step, state.model, test, collate_fn, args.per_device_batch_size, mesh,
                                  key=jax.random.key(1))  # the same noise every epoch: comparable test losses
        images = np.stack(redeqx.predict(predict_step, state.model, prompts, collate_prompts,
                                         args.per_device_batch_size, mesh, key=sample_key))  # (10 * n, 64)
        results["prompt_accuracy"] = judge.score(images, [p["label"] for p in prompts])
        log(f"epoch {epoch}: step {int(state.step)}, train loss {float(metrics['loss']):.4f}, "
            f"test loss {results['loss']:.4f}, prompt accuracy {results['prompt_accuracy']:.3f}")
        if manager is not None:
            logger.log({"train_loss": metrics["loss"], **{f"test_{k}": v for k, v in results.items()}},
                       int(state.step), examples=len(train))
            manager.save(state, epoch=epoch + 1, metrics=results)  # at a SIGTERM: saves, exits 143
            if jax.process_index() == 0:
                save_grid(images, [p["prompt"] for p in prompts], os.path.join(args.workdir, f"samples_epoch{epoch}.png"))

    if manager is not None:
        manager.close()
        logger.close()
    log(f"final prompt accuracy {results['prompt_accuracy']:.3f}, test loss {results['loss']:.4f}")
    return results


if __name__ == "__main__":
    redeqx.initialize()  # joins the other hosts' processes (SLURM, env vars, launcher); no-op on one host
    main()
