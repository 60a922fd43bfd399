"""Classification (breast cancer) and regression (diabetes) on scikit-learn's
bundled tabular data with an Equinox MLP per task, trained on every device with
redeqx, beside scikit-learn baselines fitted on the same split.

    python examples/classification_regression/main.py                 # both tasks, 8 simulated CPU devices
    python examples/classification_regression/main.py --task regression --n_model_shards 4
    python -m redeqx.launch -n 2 examples/classification_regression/main.py   # 2 processes x 4 devices
    python examples/classification_regression/main.py --workdir runs/tabular  # + checkpoints and TensorBoard logs

The two tasks share the loop and differ in three things: the data, the loss
(cross-entropy or squared error) and how a prediction is read (argmax, or
un-standardised).
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
from sklearn.datasets import load_breast_cancer, load_diabetes  # noqa: E402
from sklearn.ensemble import GradientBoostingClassifier, GradientBoostingRegressor  # noqa: E402
from sklearn.linear_model import LogisticRegression, Ridge  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

import redeqx  # noqa: E402


def classification_loss(model, batch, key):
    keys = jax.random.split(key, batch["x"].shape[0])
    logits = jax.vmap(model)(batch["x"], keys)  # (B, 2)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"].astype(jnp.int32)).mean()
    return loss, {"accuracy": jnp.mean(logits.argmax(-1) == batch["y"])}


def regression_loss(model, batch, key):  # squared error on the standardised target
    keys = jax.random.split(key, batch["x"].shape[0])
    return jnp.mean((jax.vmap(model)(batch["x"], keys)[:, 0] - batch["y"]) ** 2)


def pred_fn(model, batch, key):
    keys = jax.random.split(key, batch["x"].shape[0])
    return jax.vmap(model)(batch["x"], keys)  # (B, n_outputs)


# name: (data, n_outputs, loss_fn, (scikit-learn baselines), metric of the predictions, its name)
TASKS = {
    "classification": (load_breast_cancer, 2, classification_loss,
                       (LogisticRegression(max_iter=1000), GradientBoostingClassifier(random_state=0)),
                       lambda pred, y: np.mean(pred == y), "accuracy"),
    "regression": (load_diabetes, 1, regression_loss,
                   (Ridge(alpha=1.0), GradientBoostingRegressor(random_state=0)),
                   lambda pred, y: np.mean((pred - y) ** 2), "MSE"),
}


def collate_fn(examples):
    return {"x": np.stack([e["x"] for e in examples]),  # (B, n_features)
            "y": np.array([e["y"] for e in examples], dtype=np.float32)}  # (B,) class or standardised target


class MLP(eqx.Module):
    layers: list[eqx.nn.Linear]  # consecutive linear layers: the rules split them column, row, column
    dropout: eqx.nn.Dropout

    def __init__(self, sizes, dropout, *, key):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)]
        self.dropout = eqx.nn.Dropout(dropout)

    def __call__(self, x, key):
        for layer, k in zip(self.layers[:-1], jax.random.split(key, len(self.layers) - 1)):
            x = self.dropout(jax.nn.gelu(layer(x)), key=k)
        return self.layers[-1](x)


def log(*args):
    if jax.process_index() == 0:  # every process runs this script; one of them speaks
        print(*args, flush=True)


def run_task(name, args, mesh, key):
    load, n_out, loss_fn, baselines, metric, metric_name = TASKS[name]
    x, y = load(return_X_y=True)
    stratify = y if n_out > 1 else None
    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=0.2, random_state=args.seed, stratify=stratify)
    scaler = StandardScaler().fit(train_x)  # statistics of the training split only
    train_x, test_x = scaler.transform(train_x).astype(np.float32), scaler.transform(test_x).astype(np.float32)
    y_mean, y_std = (train_y.mean(), train_y.std()) if n_out == 1 else (0.0, 1.0)  # the regressor sees y standardised
    train = [{"x": a, "y": (b - y_mean) / y_std} for a, b in zip(train_x, train_y)]
    test = [{"x": a, "y": (b - y_mean) / y_std} for a, b in zip(test_x, test_y)]
    read = (lambda out: out.argmax(-1)) if n_out > 1 else (lambda out: out[:, 0] * y_std + y_mean)

    model_key, state_key, data_key = jax.random.split(key, 3)
    model = MLP([train_x.shape[1], args.hidden, args.hidden, n_out], args.dropout, key=model_key)
    batch = collate_fn(train[:args.per_device_batch_size * mesh.shape["data"]])  # one global batch: its shapes
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)  # each weight's role, from the program
    schedule = redeqx.lr_schedule(len(train), args.per_device_batch_size, args.n_epochs, args.learning_rate, mesh,
                                  schedule_type="cosine", warmup_ratio=0.05)
    optimizer = optax.adamw(schedule, weight_decay=args.weight_decay)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=state_key)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)
    predict_step = redeqx.make_predict_step(pred_fn, mesh, specs)
    log(f"--- {name}: {len(train)} train / {len(test)} test examples, {train_x.shape[1]} features")

    manager = logger = None
    if args.workdir:
        manager = redeqx.CheckpointManager(f"{args.workdir}/{name}", keep_last=1, unit="epoch", best={"loss": "min"})
        logger = redeqx.Logger(f"{args.workdir}/{name}")

    for epoch in range(args.n_epochs):
        epoch_key = jax.random.fold_in(data_key, epoch)
        for batch in redeqx.batches(train, collate_fn, args.per_device_batch_size, mesh, shuffle=True, key=epoch_key):
            state, metrics = train_step(state, batch)
        results = redeqx.evaluate(eval_step, state.model, test, collate_fn, args.per_device_batch_size, mesh,
                                  key=epoch_key)
        if epoch % args.log_every == 0 or epoch == args.n_epochs - 1:
            log(f"epoch {epoch}: step {int(state.step)}, train loss {float(metrics['loss']):.4f}, "
                + ", ".join(f"test {k} {v:.4f}" for k, v in results.items()))
        if manager is not None:
            logger.log({"train_loss": metrics["loss"], **{f"test_{k}": v for k, v in results.items()}},
                       int(state.step), examples=len(train))
            manager.save(state, epoch=epoch + 1, metrics=results)  # at a SIGTERM: saves, exits 143
    if manager is not None:
        manager.close()
        logger.close()

    outputs = redeqx.predict(predict_step, state.model, test, collate_fn, args.per_device_batch_size, mesh,
                             key=data_key)
    scores = {"MLP (redeqx)": metric(read(np.stack(outputs)), test_y)}
    for baseline in baselines:  # fitted on the same standardised features, raw targets
        scores[type(baseline).__name__] = metric(baseline.fit(train_x, train_y).predict(test_x), test_y)
    for who, score in scores.items():
        log(f"{name} test {metric_name} {who:28s} {score:.4f}")
    return scores


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["classification", "regression", "both"], default="both")
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--n_epochs", type=int, default=20)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=1e-2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log_every", type=int, default=5, help="print every this many epochs")
    parser.add_argument("--workdir", help="checkpoints and logs go to <workdir>/<task>")
    args = parser.parse_args()

    mesh = redeqx.make_mesh(args.n_model_shards)
    log(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}")
    tasks = ["classification", "regression"] if args.task == "both" else [args.task]
    return {name: run_task(name, args, mesh, jax.random.key(args.seed)) for name in tasks}


if __name__ == "__main__":
    redeqx.initialize()  # joins the other hosts' processes (SLURM, env vars, launcher); no-op on one host
    main()
