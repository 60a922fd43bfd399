"""MAML (Finn et al., 2017) on the sinusoid regression benchmark, trained on
every device with redeqx: a task is y = A sin(x - phase), A in [0.1, 5],
phase in [0, pi], x in [-5, 5]; the model sees K=10 points of a new task, takes
one gradient step on them, and must then fit the whole curve.

    python examples/meta_learning/main.py                               # 8 simulated CPU devices
    python examples/meta_learning/main.py --plot examples/meta_learning/sinusoid.png
    python examples/meta_learning/main.py --n_model_shards 1 --inner_steps 5 --workdir runs/maml
    python -m redeqx.launch -n 2 examples/meta_learning/main.py       # 2 processes x 4 devices

A batch is a set of tasks. The inner `jax.grad` (adaptation) lives inside
`loss_fn`, so the usual train step differentiates through it (second-order
MAML), and evaluation and prediction adapt the same way.
"""

import argparse
import functools
import os

# On a machine with no accelerator, pretend to have 8 devices (must precede `import jax`).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import redeqx  # noqa: E402


def sample_tasks(n_tasks, k_shots, seed, grid=0):
    """n sinusoid tasks, each with K (x, y) points to adapt on and K others to
    score on; `grid` > 0 adds the whole curve on a grid, for plots."""
    rng = np.random.default_rng(seed)
    amp, phase = rng.uniform(0.1, 5.0, n_tasks), rng.uniform(0.0, np.pi, n_tasks)
    x = rng.uniform(-5.0, 5.0, (n_tasks, 2 * k_shots, 1)).astype(np.float32)  # (N, 2K, 1)
    y = (amp[:, None, None] * np.sin(x - phase[:, None, None])).astype(np.float32)
    tasks = [{"x_train": x[i, :k_shots], "y_train": y[i, :k_shots], "x_test": x[i, k_shots:],
              "y_test": y[i, k_shots:]} for i in range(n_tasks)]
    if grid:
        xs = np.linspace(-5.0, 5.0, grid, dtype=np.float32)[:, None]  # (G, 1)
        for t, a, p in zip(tasks, amp, phase):
            t.update(x_grid=xs, y_grid=(a * np.sin(xs - p)).astype(np.float32))
    return tasks


def collate_fn(tasks):  # every entry (B, K, 1); (B, G, 1) for the plot's grid
    return {k: np.stack([t[k] for t in tasks]) for k in tasks[0]}


def mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def adapt(model, x, y, *, inner_lr, inner_steps):
    """The inner loop: a few plain gradient steps on one task's K points."""
    for _ in range(inner_steps):
        grads = eqx.filter_grad(mse)(model, x, y)
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -inner_lr * g, grads))
    return model


def loss_fn(model, batch, key, *, inner_lr, inner_steps):
    """MAML's meta-loss: the error on each task's held-back points after
    adapting on its K points, averaged over the tasks of the batch."""
    def one_task(x_train, y_train, x_test, y_test):
        adapted = adapt(model, x_train, y_train, inner_lr=inner_lr, inner_steps=inner_steps)
        return mse(adapted, x_test, y_test), mse(model, x_test, y_test)

    post, pre = jax.vmap(one_task)(batch["x_train"], batch["y_train"], batch["x_test"], batch["y_test"])
    return post.mean(), {"pre_adaptation_mse": pre.mean()}


def pred_fn(model, batch, key, *, inner_lr, steps):
    """The curve on the grid, before adaptation and after each count in `steps`."""
    def one_task(x_train, y_train, x_grid):
        curves = [jax.vmap(adapt(model, x_train, y_train, inner_lr=inner_lr, inner_steps=n))(x_grid) for n in steps]
        return jnp.stack(curves)  # (len(steps), G, 1)

    return jax.vmap(one_task)(batch["x_train"], batch["y_train"], batch["x_grid"])


def plot(tasks, curves, steps, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 2.8), sharey=True)
    for ax, task, curve in zip(axes, tasks, curves):
        ax.plot(task["x_grid"], task["y_grid"], "k", lw=2, label="true")
        for n, c in zip(steps, curve):
            ax.plot(task["x_grid"], c, "--" if n == 0 else "-", label="before adapting" if n == 0 else f"{n} step(s)")
        ax.plot(task["x_train"], task["y_train"], "r^", label=f"K={len(task['x_train'])} points")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def log(*args):
    if jax.process_index() == 0:  # every process runs this script; one of them speaks
        print(*args, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=8, help="tasks per device per meta-step")
    parser.add_argument("--n_epochs", type=int, default=40)
    parser.add_argument("--tasks_per_epoch", type=int, default=2000, help="fresh tasks are drawn every epoch")
    parser.add_argument("--n_test_tasks", type=int, default=600)
    parser.add_argument("--k_shots", type=int, default=10)
    parser.add_argument("--inner_lr", type=float, default=0.01)
    parser.add_argument("--inner_steps", type=int, default=1, help="while meta-training")
    parser.add_argument("--test_steps", type=int, default=10, help="also evaluate after this many inner steps")
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="the meta (outer) learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep the last and the best checkpoint, and logs, here")
    parser.add_argument("--plot", help="write a PNG of a few adapted test curves here")
    args = parser.parse_args()

    model_key, state_key, eval_key = jax.random.split(jax.random.key(args.seed), 3)
    test = sample_tasks(args.n_test_tasks, args.k_shots, seed=10**6 + args.seed)  # held out: another seed
    mesh = redeqx.make_mesh(args.n_model_shards)
    model = eqx.nn.MLP(1, 1, 40, depth=2, activation=jax.nn.relu, key=model_key)  # the paper's 2 x 40 ReLU MLP
    train_loss = functools.partial(loss_fn, inner_lr=args.inner_lr, inner_steps=args.inner_steps)
    # read through the inner jax.grad too: each adapted weight is its weight (the hidden layer column, then row)
    batch = collate_fn(test[:args.per_device_batch_size * mesh.shape["data"]])  # a global batch: shapes only
    specs = redeqx.sharding_rules(model, mesh, loss_fn=train_loss, batch=batch)
    log(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}; {args.tasks_per_epoch} new tasks per epoch, "
        f"{args.n_test_tasks} test tasks, K={args.k_shots}")

    optimizer = optax.adam(args.learning_rate)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=state_key)
    train_step = redeqx.make_train_step(train_loss, optimizer, mesh, specs)
    eval_steps = {n: redeqx.make_eval_step(functools.partial(loss_fn, inner_lr=args.inner_lr, inner_steps=n),
                                           mesh, specs) for n in sorted({args.inner_steps, args.test_steps})}

    def evaluate(model):  # {"pre": MSE before adapting, n: after n inner steps}
        results = {n: redeqx.evaluate(step, model, test, collate_fn, args.per_device_batch_size, mesh, key=eval_key)
                   for n, step in eval_steps.items()}
        return {"pre": results[args.inner_steps]["pre_adaptation_mse"], **{n: r["loss"] for n, r in results.items()}}

    manager = logger = None
    if args.workdir:
        manager = redeqx.CheckpointManager(args.workdir, keep_last=1, unit="epoch", best={"mse": "min"})
        logger = redeqx.Logger(args.workdir)

    for epoch in range(args.n_epochs):
        tasks = sample_tasks(args.tasks_per_epoch, args.k_shots, seed=args.seed * 10**5 + epoch)
        for batch in redeqx.batches(tasks, collate_fn, args.per_device_batch_size, mesh, drop_last=True):
            state, metrics = train_step(state, batch)
        results = evaluate(state.model)
        log(f"epoch {epoch}: step {int(state.step)}, train MSE after adapting {float(metrics['loss']):.3f}; "
            f"test MSE before adapting {results['pre']:.3f}, "
            + ", ".join(f"after {n} step(s) {results[n]:.3f}" for n in eval_steps))
        if manager is not None:
            logger.log({"train_mse": metrics["loss"], **{f"test_mse_{n}": v for n, v in results.items()}},
                       int(state.step), examples=len(tasks))
            # at a SIGTERM: saves, exits 143 (preemption)
            manager.save(state, epoch=epoch + 1, metrics={"mse": results[args.inner_steps]})
    if manager is not None:
        manager.close()
        logger.close()

    if args.plot:
        shown = sample_tasks(4, args.k_shots, seed=10**6 + args.seed, grid=200)  # the first 4 test tasks
        steps = (0, args.inner_steps, args.test_steps)
        predict_step = redeqx.make_predict_step(
            functools.partial(pred_fn, inner_lr=args.inner_lr, steps=steps), mesh, specs)
        curves = redeqx.predict(predict_step, state.model, shown, collate_fn, args.per_device_batch_size, mesh,
                                key=eval_key)
        if jax.process_index() == 0:
            plot(shown, curves, steps, args.plot)
            log(f"wrote {args.plot}")
    return results


if __name__ == "__main__":
    redeqx.initialize()  # joins the other hosts' processes (SLURM, env vars, launcher); no-op on one host
    main()
