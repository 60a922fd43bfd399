"""Federated averaging (FedAvg, McMahan et al., 2017) on scikit-learn's digits
split over clients that each hold about two classes (non-IID), beside
centralised training on the same data; trained on every device with redeqx.

    python examples/federated_learning/main.py                          # 8 simulated CPU devices
    python examples/federated_learning/main.py --plot examples/federated_learning/accuracy.png
    python -m redeqx.launch -n 2 examples/federated_learning/main.py   # 2 processes x 4 devices, same numbers
    python examples/federated_learning/main.py --workdir runs/fedavg    # + checkpoints and TensorBoard logs

A round: `per_device_batch_size * data` clients (the rows of a batch are
clients, so each device trains its own clients and each process collates only
its own) start from the global model, run `--local_epochs` of SGD on their own
examples, and the server averages their models weighted by their example
counts. The round is one step written with `redeqx.make_step`.
"""

import argparse
import functools
import itertools
import os

# On a machine with no accelerator, pretend to have 8 devices (must precede `import jax`).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import redeqx  # noqa: E402


def load_clients(n_clients, shards_per_client, local_batch_size, seed):
    """McMahan et al.'s non-IID split: sort the training set by label, cut it
    into n_clients * shards_per_client shards, deal each client that many."""
    digits = load_digits()
    x, y = (digits.images / 16.0).reshape(-1, 64).astype(np.float32), digits.target
    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    shards = np.array_split(np.argsort(train_y, kind="stable"), n_clients * shards_per_client)
    dealt = np.random.default_rng(seed).permutation(len(shards)).reshape(n_clients, shards_per_client)
    owned = [np.concatenate([shards[s] for s in row]) for row in dealt]
    size = -(-max(map(len, owned)) // local_batch_size) * local_batch_size  # pad every client to one shape
    pad = lambda a, n: np.concatenate([a, np.zeros((n - len(a), *a.shape[1:]), a.dtype)])  # noqa: E731
    clients = [{"x": pad(train_x[i], size), "y": pad(train_y[i], size), "mask": pad(np.ones(len(i), np.float32), size)}
               for i in owned]
    to_examples = lambda xs, ys: [{"x": a, "y": b} for a, b in zip(xs, ys)]  # noqa: E731
    return clients, to_examples(train_x, train_y), to_examples(test_x, test_y)


def collate_fn(rows):  # clients: (B, M, 64), (B, M), (B, M); examples: (B, 64), (B,)
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


class MLP(eqx.Module):
    layers: list[eqx.nn.Linear]  # the rules split them column, row, column

    def __init__(self, sizes, *, key):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def loss_fn(model, batch, key=None):  # rows with mask 0 (a client's padding) count for nothing
    logits = jax.vmap(model)(batch["x"])  # (B, 10)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    weights = batch.get("mask", jnp.ones_like(losses))
    loss = jnp.sum(weights * losses) / jnp.maximum(weights.sum(), 1.0)
    return loss, {"accuracy": jnp.sum(weights * (logits.argmax(-1) == batch["y"])) / jnp.maximum(weights.sum(), 1.0)}


def client_update(model, client, key, *, lr, local_epochs, local_batch_size):
    """`local_epochs` of plain SGD over one client's own examples."""
    def epoch(model, k):  # the client's examples in a random order, its padding last
        order = jnp.argsort(jnp.where(client["mask"] > 0, jax.random.uniform(k, client["mask"].shape), 2.0))

        def sgd(model, rows):
            grads = jax.grad(lambda m: loss_fn(m, jax.tree.map(lambda a: a[rows], client))[0])(model)
            return jax.tree.map(lambda p, g: p - lr * g, model, grads), None

        return jax.lax.scan(sgd, model, order.reshape(-1, local_batch_size))[0], None

    return jax.lax.scan(epoch, model, jax.random.split(key, local_epochs))[0]


def fedavg_round(state, clients, *, update):
    """One round over the batch's clients (vmapped: each device trains its own)."""
    key, round_key = jax.random.split(state["key"])
    local = jax.vmap(update, in_axes=(None, 0, 0))(state["model"], clients, jax.random.split(round_key, len(clients["y"])))
    n_k = clients["mask"].sum(1)  # (B,) examples per client
    model = jax.tree.map(lambda p: jnp.tensordot(n_k / n_k.sum(), p, axes=1), local)  # weighted average
    return {"model": model, "key": key}, {"examples": n_k.sum()}


def plot(fed, central, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(1, len(fed) + 1), fed, label="FedAvg, non-IID clients (x: round)")
    ax.plot(range(1, len(central) + 1), central, label="centralised (x: epoch)")
    ax.set(xlabel="round / epoch", ylabel="test accuracy", ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def log(*args):
    if jax.process_index() == 0:  # every process runs this script; one of them speaks
        print(*args, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=2, help="clients per device per round")
    parser.add_argument("--n_clients", type=int, default=20)
    parser.add_argument("--shards_per_client", type=int, default=2, help="about this many classes per client")
    parser.add_argument("--n_rounds", type=int, default=100)
    parser.add_argument("--local_epochs", type=int, default=5)
    parser.add_argument("--local_batch_size", type=int, default=10)
    parser.add_argument("--learning_rate", type=float, default=0.1, help="clients' SGD (and centralised SGD)")
    parser.add_argument("--central_epochs", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep the last and the most accurate global model, and logs, here")
    parser.add_argument("--plot", help="write a PNG of accuracy per round here")
    args = parser.parse_args()

    clients, train, test = load_clients(args.n_clients, args.shards_per_client, args.local_batch_size, args.seed)
    model_key, state_key, data_key, central_key = jax.random.split(jax.random.key(args.seed), 4)
    mesh = redeqx.make_mesh(args.n_model_shards)
    model = MLP([64, args.hidden, args.hidden, 10], key=model_key)  # McMahan et al.'s "2NN"
    batch = collate_fn(train[:args.local_batch_size * mesh.shape["data"]])  # a centralised step's batch
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)  # each weight's role, from the program
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)
    evaluate = lambda m: redeqx.evaluate(eval_step, m, test, collate_fn, 8, mesh, key=data_key)  # noqa: E731
    per_round = args.per_device_batch_size * mesh.shape["data"]
    log(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}; {args.n_clients} clients holding "
        f"{sorted(int(c['mask'].sum()) for c in clients)} examples; {per_round} clients per round")

    # FedAvg: the state is the global model and the key the clients' shuffles come from
    state = redeqx.shard({"model": model, "key": state_key}, {"model": specs, "key": P()}, mesh)
    update = functools.partial(client_update, lr=args.learning_rate, local_epochs=args.local_epochs,
                               local_batch_size=args.local_batch_size)
    fed_step = redeqx.make_step(functools.partial(fedavg_round, update=update), mesh)

    manager = logger = None
    if args.workdir:
        manager = redeqx.CheckpointManager(args.workdir, keep_last=1, every=10, best={"accuracy": "max"})
        logger = redeqx.Logger(args.workdir)

    def rounds():  # passes over the clients, each in a new random order; a batch of clients is a round
        for p in itertools.count():
            yield from redeqx.batches(clients, collate_fn, args.per_device_batch_size, mesh, shuffle=True,
                                      key=jax.random.fold_in(data_key, p))

    fed_accuracy = []
    for r, batch in zip(range(1, args.n_rounds + 1), rounds()):
        state, out = fed_step(state, batch)
        results = evaluate(state["model"])
        fed_accuracy.append(results["accuracy"])
        log(f"round {r}: test loss {results['loss']:.4f}, test accuracy {results['accuracy']:.4f}")
        if manager is not None:
            logger.log({f"test_{k}": v for k, v in results.items()}, r, examples=int(out["examples"]))
            manager.save(state, step=r, metrics=results)  # at a SIGTERM: saves, exits 143
    if manager is not None:
        manager.close()
        logger.close()

    # centralised: the same model and SGD on all the clients' examples pooled, the usual train step
    optimizer = optax.sgd(args.learning_rate)
    central = redeqx.init_state(model, optimizer, mesh, specs, key=state_key)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    central_accuracy = []
    for epoch in range(args.central_epochs):
        for batch in redeqx.batches(train, collate_fn, args.local_batch_size, mesh, shuffle=True,
                                    key=jax.random.fold_in(central_key, epoch)):
            central, _ = train_step(central, batch)
        central_accuracy.append(evaluate(central.model)["accuracy"])
    log(f"centralised, {args.central_epochs} epochs: test accuracy {central_accuracy[-1]:.4f}")
    log(f"FedAvg, {args.n_rounds} rounds: final test accuracy {fed_accuracy[-1]:.4f}, best {max(fed_accuracy):.4f}")
    if args.plot and jax.process_index() == 0:
        plot(fed_accuracy, central_accuracy, args.plot)
    return fed_accuracy, central_accuracy


if __name__ == "__main__":
    redeqx.initialize()  # joins the other hosts' processes (SLURM, env vars, launcher); no-op on one host
    main()
