"""Differentially private SGD (DP-SGD, Abadi et al., 2016) on scikit-learn's
digits, beside the same model trained without privacy; trained on every
device with redeqx. Each step draws a Poisson sample of the training set,
clips every example's gradient to norm `--clip_norm` and adds Gaussian noise of
std `--noise_multiplier * --clip_norm`; the `dp-accounting` library turns the
sampling rate, noise, steps and delta into the privacy budget epsilon.

    python examples/differential_privacy/main.py                        # 8 simulated CPU devices
    python examples/differential_privacy/main.py --noise_multiplier 2.0   # more noise: smaller epsilon
    python examples/differential_privacy/main.py --plot examples/differential_privacy/accuracy.png
    python -m redeqx.launch -n 2 examples/differential_privacy/main.py   # 2 processes x 4 devices
    python examples/differential_privacy/main.py --workdir runs/dpsgd     # + checkpoints and TensorBoard logs

The private step is written with `redeqx.make_step` over a `TrainState`:
per-example gradients with `jax.vmap(jax.grad(...))`, split over the data
axis like the examples they come from.
"""

import argparse
import dataclasses
import functools
import math
import os

# On a machine with no accelerator, pretend to have 8 devices (must precede `import jax`).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dp_accounting  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import redeqx  # noqa: E402


def load_examples(seed):
    digits = load_digits()
    x = (digits.images / 16.0).reshape(-1, 64).astype(np.float32)  # (N, 64) in [0, 1]
    train_x, test_x, train_y, test_y = train_test_split(x, digits.target, test_size=0.2, random_state=seed,
                                                        stratify=digits.target)
    to_examples = lambda xs, ys: [{"x": a, "y": int(b), "mask": 1.0} for a, b in zip(xs, ys)]  # noqa: E731
    return to_examples(train_x, train_y), to_examples(test_x, test_y)


def poisson_steps(train, rate, capacity, n_steps, seed):
    """`n_steps` batches, each holding every example independently with
    probability `rate` (Poisson sampling, as the accountant assumes), filled up
    to `capacity` rows with blanks (mask 0) so that every step has one shape."""
    rng = np.random.default_rng(seed)
    blank = {"x": np.zeros_like(train[0]["x"]), "y": 0, "mask": 0.0}
    rows = []
    for _ in range(n_steps):
        chosen = np.flatnonzero(rng.random(len(train)) < rate)
        if len(chosen) > capacity:  # never silently drop a sampled example: that would break the accounting
            raise RuntimeError(f"a Poisson sample of {len(chosen)} examples overflowed the {capacity} rows of a step")
        rows += [train[i] for i in chosen] + [blank] * (capacity - len(chosen))
    return rows


def collate_fn(examples):
    return {"x": np.stack([e["x"] for e in examples]),  # (B, 64)
            "y": np.array([e["y"] for e in examples], dtype=np.int32),  # (B,)
            "mask": np.array([e["mask"] for e in examples], dtype=np.float32)}  # (B,) 0: a blank row


class MLP(eqx.Module):
    layers: list[eqx.nn.Linear]  # the rules split them column, row, column

    def __init__(self, sizes, *, key):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))  # bounded activations suit clipped gradients (Papernot et al., 2021)
        return self.layers[-1](x)


def loss_fn(model, batch, key):
    logits = jax.vmap(model)(batch["x"])  # (B, 10)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": jnp.mean(logits.argmax(-1) == batch["y"])}


def dp_sgd_step(state, batch, *, optimizer, clip_norm, noise_multiplier, expected_batch_size):
    """Clip each example's gradient, sum, add N(0, (noise_multiplier * clip_norm)^2)
    noise, divide by the expected batch size (fixed, as Poisson sampling needs)."""
    key, noise_key = jax.random.split(state.key)
    example_loss = lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(m(x), y)  # noqa: E731
    grads = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(state.model, batch["x"], batch["y"])  # (B, ...)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(len(g), -1) ** 2, axis=1) for g in jax.tree.leaves(grads)))  # (B,)
    scale = batch["mask"] * jnp.minimum(1.0, clip_norm / (norms + 1e-12))  # blank rows add nothing
    summed, treedef = jax.tree.flatten(jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1), grads))
    noise_keys = jax.random.split(noise_key, len(summed))
    noisy = [(g + noise_multiplier * clip_norm * jax.random.normal(k, g.shape)) / expected_batch_size
             for g, k in zip(summed, noise_keys)]
    updates, opt_state = optimizer.update(jax.tree.unflatten(treedef, noisy), state.opt_state, state.model)
    state = dataclasses.replace(state, model=optax.apply_updates(state.model, updates), opt_state=opt_state,
                                step=state.step + 1, key=key)
    n = batch["mask"].sum()
    return state, {"batch_size": n, "clipped": jnp.sum(batch["mask"] * (norms > clip_norm)) / jnp.maximum(n, 1.0)}


def epsilon(rate, noise_multiplier, steps, delta, accountant):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise_multiplier)), steps)
    return accountant().compose(event).get_epsilon(delta)


def plot(private, public, epsilons, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    epochs = range(1, len(private) + 1)
    ax.plot(epochs, public, label="non-private")
    ax.plot(epochs, private, label="DP-SGD")
    for e, acc, eps in list(zip(epochs, private, epsilons))[1::3]:
        ax.annotate(f"ε={eps:.1f}", (e, acc), textcoords="offset points", xytext=(0, -14), fontsize=7, ha="center")
    ax.set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def log(*args):
    if jax.process_index() == 0:  # every process runs this script; one of them speaks
        print(*args, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=16,
                        help="rows per device per step (for DP-SGD the expected number: sampling is Poisson)")
    parser.add_argument("--n_epochs", type=int, default=15)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--clip_norm", type=float, default=1.0)
    parser.add_argument("--noise_multiplier", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep the last DP-SGD checkpoint, and logs, here")
    parser.add_argument("--plot", help="write a PNG of accuracy per epoch here")
    args = parser.parse_args()

    train, test = load_examples(args.seed)
    mesh = redeqx.make_mesh(args.n_model_shards)
    n_data = mesh.shape["data"]
    expected = args.per_device_batch_size * n_data  # expected rows per step (the "lot")
    rate = expected / len(train)  # Poisson sampling rate q
    capacity = math.ceil((expected + 6 * math.sqrt(expected)) / n_data)  # rows per device: 6 sigma above the mean
    steps_per_epoch = round(1 / rate)
    model_key, state_key, data_key = jax.random.split(jax.random.key(args.seed), 3)
    model = MLP([64, args.hidden, args.hidden, 10], key=model_key)
    batch = collate_fn(train[:expected])  # one global batch: the program loss_fn runs on it shows each weight's role
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)
    log(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}; {len(train)} train / {len(test)} test examples; "
        f"sampling rate {rate:.4f} ({expected} expected, {capacity * n_data} rows per step), "
        f"noise multiplier {args.noise_multiplier}, clip norm {args.clip_norm}")

    optimizer = optax.adam(args.learning_rate)
    private = redeqx.init_state(model, optimizer, mesh, specs, key=state_key)
    public = redeqx.init_state(model, optimizer, mesh, specs, key=state_key)
    dp_step = redeqx.make_step(functools.partial(
        dp_sgd_step, optimizer=optimizer, clip_norm=args.clip_norm, noise_multiplier=args.noise_multiplier,
        expected_batch_size=expected), mesh)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)  # the non-private run
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)
    evaluate = lambda m: redeqx.evaluate(eval_step, m, test, collate_fn, 16, mesh, key=data_key)["accuracy"]  # noqa: E731

    manager = logger = None
    if args.workdir:
        manager = redeqx.CheckpointManager(args.workdir, keep_last=1, unit="epoch")
        logger = redeqx.Logger(args.workdir)

    history = {"private": [], "public": [], "epsilon": []}
    for epoch in range(args.n_epochs):
        steps = poisson_steps(train, rate, capacity * n_data, steps_per_epoch, seed=args.seed * 1000 + epoch)
        for batch in redeqx.batches(steps, collate_fn, capacity, mesh):  # in order: batch t is step t's sample
            private, out = dp_step(private, batch)
        for batch in redeqx.batches(train, collate_fn, args.per_device_batch_size, mesh, shuffle=True,
                                    key=jax.random.fold_in(data_key, epoch)):
            public, _ = train_step(public, batch)
        eps = epsilon(rate, args.noise_multiplier, int(private.step), args.delta, dp_accounting.rdp.RdpAccountant)
        for name, value in (("private", evaluate(private.model)), ("public", evaluate(public.model)), ("epsilon", eps)):
            history[name].append(value)
        log(f"epoch {epoch}: step {int(private.step)}, test accuracy DP-SGD {history['private'][-1]:.4f} "
            f"(epsilon {eps:.2f} at delta {args.delta:g}), non-private {history['public'][-1]:.4f}; "
            f"last step: {int(out['batch_size'])} examples, {float(out['clipped']):.0%} clipped")
        if manager is not None:
            logger.log({"dp_accuracy": history["private"][-1], "accuracy": history["public"][-1], "epsilon": eps},
                       int(private.step))
            manager.save(private, epoch=epoch + 1)  # at a SIGTERM: saves, exits 143
    if manager is not None:
        manager.close()
        logger.close()

    pld = epsilon(rate, args.noise_multiplier, int(private.step), args.delta, dp_accounting.pld.PLDAccountant)
    log(f"DP-SGD: test accuracy {history['private'][-1]:.4f} at (epsilon, delta) = ({history['epsilon'][-1]:.2f}, "
        f"{args.delta:g}) by RDP, ({pld:.2f}, {args.delta:g}) by PLD; non-private: {history['public'][-1]:.4f}")
    if args.plot and jax.process_index() == 0:
        plot(history["private"], history["public"], history["epsilon"], args.plot)
    return history


if __name__ == "__main__":
    redeqx.initialize()  # joins the other hosts' processes (SLURM, env vars, launcher); no-op on one host
    main()
