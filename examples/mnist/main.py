"""Handwritten digits (scikit-learn's 8x8 digits, shipped with the package)
with an Equinox MLP, trained on every device with redeqx.

    python examples/mnist/main.py                       # 8 simulated CPU devices
    python examples/mnist/main.py --n_model_shards 4 --per_device_batch_size 8
    python -m redeqx.launch -n 2 examples/mnist/main.py           # 2 processes x 4 devices, as on 2 hosts
    python examples/mnist/main.py --workdir runs/mnist            # + checkpoints and TensorBoard logs
    python examples/mnist/main.py --workdir runs/mnist --resume   # continue where it stopped
    tensorboard --logdir runs/mnist

The loop is yours: train one epoch, evaluate, repeat; predict at the end.
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
from sklearn.model_selection import train_test_split  # noqa: E402

import redeqx  # noqa: E402


def load_examples(seed):
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)  # (N, 8, 8) in [0, 1]
    train_x, test_x, train_y, test_y = train_test_split(
        images, digits.target, test_size=0.2, random_state=seed, stratify=digits.target)
    to_examples = lambda xs, ys: [{"image": x, "label": int(y)} for x, y in zip(xs, ys)]  # noqa: E731
    return to_examples(train_x, train_y), to_examples(test_x, test_y)


def collate_fn(examples):
    return {
        "image": np.stack([e["image"].reshape(-1) for e in examples]),  # (B, 64)
        "label": np.array([e["label"] for e in examples], dtype=np.int32),  # (B,)
    }


def loss_fn(model, batch, key):
    keys = jax.random.split(key, batch["image"].shape[0])
    logits = jax.vmap(model)(batch["image"], keys)  # (B, 10)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": jnp.mean(logits.argmax(-1) == batch["label"])}


def pred_fn(model, batch, key):
    keys = jax.random.split(key, batch["image"].shape[0])
    return jax.vmap(model)(batch["image"], keys).argmax(-1)


class Classifier(eqx.Module):
    mlp: eqx.nn.MLP
    dropout: eqx.nn.Dropout

    def __init__(self, hidden, *, key):
        self.mlp = eqx.nn.MLP(64, 10, hidden, depth=2, activation=jax.nn.gelu, key=key)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, x, key):
        return self.mlp(self.dropout(x, key=key))


def log(*args):
    if jax.process_index() == 0:  # every process runs this script; one of them speaks
        print(*args, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--n_epochs", type=int, default=12)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep the last and the most accurate checkpoint, and logs, here")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --workdir")
    args = parser.parse_args()
    if args.resume and not args.workdir:
        parser.error("--resume needs --workdir")

    key = jax.random.key(args.seed)
    model_key, state_key, data_key = jax.random.split(key, 3)
    train, test = load_examples(args.seed)

    mesh = redeqx.make_mesh(args.n_model_shards)
    model = Classifier(args.hidden, key=model_key)
    batch = collate_fn(train[:args.per_device_batch_size * mesh.shape["data"]])  # one global batch: its shapes
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)  # each weight's role, from the program
    log(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}; {len(train)} train / {len(test)} test examples")
    log(redeqx.explain(model, specs, mesh, loss_fn=loss_fn, batch=batch))

    schedule = redeqx.lr_schedule(len(train), args.per_device_batch_size, args.n_epochs, args.learning_rate, mesh,
                                  schedule_type="cosine", warmup_ratio=0.05)
    optimizer = optax.adamw(schedule, weight_decay=1e-4)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=state_key)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)
    predict_step = redeqx.make_predict_step(pred_fn, mesh, specs)

    start_epoch, manager, logger = 0, None, None
    if args.workdir:
        manager = redeqx.CheckpointManager(args.workdir, keep_last=1, unit="epoch", best={"accuracy": "max"})
        logger = redeqx.Logger(args.workdir)  # TensorBoard event files + metrics.jsonl + log.txt
        if args.resume and (found := manager.restore(state, mesh, specs)) is not None:
            state, meta = found
            start_epoch = meta["epoch"]  # the epoch to run next
            log(f"resumed from step {meta['step']}, epoch {start_epoch}")

    for epoch in range(start_epoch, args.n_epochs):
        epoch_key = jax.random.fold_in(data_key, epoch)
        for batch in redeqx.batches(train, collate_fn, args.per_device_batch_size, mesh,
                                    shuffle=True, key=epoch_key, desc=f"epoch {epoch}"):
            state, metrics = train_step(state, batch)
        results = redeqx.evaluate(eval_step, state.model, test, collate_fn, args.per_device_batch_size, mesh,
                                  key=epoch_key)
        log(f"epoch {epoch}: step {int(state.step)}, train loss {float(metrics['loss']):.4f}, "
              f"test loss {results['loss']:.4f}, test accuracy {results['accuracy']:.4f}")
        if manager is not None:
            logger.log({"train_loss": metrics["loss"], "learning_rate": schedule(state.step),
                        **{f"test_{k}": v for k, v in results.items()}}, int(state.step), examples=len(train))
            manager.save(state, epoch=epoch + 1, metrics=results)  # in the background; at a SIGTERM: saves, exits 143

    if manager is not None:  # predict with the most accurate checkpoint (parameters only)
        state = eqx.tree_at(lambda s: s.model, state, manager.restore(state.model, mesh, specs, best="accuracy")[0])
        manager.close()
        logger.close()

    preds = redeqx.predict(predict_step, state.model, test, collate_fn, args.per_device_batch_size, mesh,
                           key=data_key)
    accuracy = np.mean([int(p) == e["label"] for p, e in zip(preds, test)])
    log(f"final test accuracy from predict: {accuracy:.4f} ({len(preds)} predictions)")
    return accuracy


if __name__ == "__main__":
    redeqx.initialize()  # joins the other hosts' processes (SLURM, env vars, launcher); no-op on one host
    main()
