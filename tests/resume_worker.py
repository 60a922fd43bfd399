"""A tiny training run for tests/test_resume_preempted.py:
3 epochs of a dropout MLP on shuffled synthetic data, `CheckpointManager.save`
after every step, resuming from the latest checkpoint in WORKDIR when there is one.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/resume_worker.py WORKDIR [EVERY [STEP_SECONDS]]
    python -m redeqx.launch -n 2 tests/resume_worker.py WORKDIR [EVERY [STEP_SECONDS]]

EVERY (default 1) is the manager's ``every``: with a large one, only a
preemption (SIGTERM) writes a checkpoint. STEP_SECONDS (default 0) sleeps after
each step, so a signal lands mid-run. Process 0 prints "step N" after each step
and writes WORKDIR/final.npz at the end.
"""

import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

import redeqx

N_EPOCHS, N_EXAMPLES, PER_DEVICE = 3, 64, 4  # mesh data=4 -> 16 rows a batch, 4 batches an epoch


class Net(eqx.Module):
    mlp: eqx.nn.MLP
    dropout: eqx.nn.Dropout

    def __call__(self, x, key):
        return self.mlp(self.dropout(x, key=key))


def collate_fn(examples):
    return {"x": np.stack([e[0] for e in examples]), "y": np.stack([e[1] for e in examples])}


def loss_fn(model, batch, key):
    keys = jax.random.split(key, batch["x"].shape[0])
    return jnp.mean((jax.vmap(model)(batch["x"], keys) - batch["y"]) ** 2)


def say(text):
    if jax.process_index() == 0:
        print(text, flush=True)


def training():
    """The mesh, specs, initial state and train step every resume worker starts from."""
    mesh = redeqx.make_mesh(2)
    model = Net(eqx.nn.MLP(8, 4, 32, depth=2, key=jax.random.key(0)), eqx.nn.Dropout(0.2))
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.adamw(1e-2)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    return mesh, specs, state, redeqx.make_train_step(loss_fn, optimizer, mesh, specs)


def main(workdir, every=1, step_seconds=0.0):
    rng = np.random.default_rng(0)
    examples = [(rng.normal(size=8).astype(np.float32), rng.normal(size=4).astype(np.float32)) for _ in range(N_EXAMPLES)]
    mesh, specs, state, train_step = training()
    data_key, epoch, start = jax.random.key(2), 0, 0

    manager = redeqx.CheckpointManager(workdir, keep_last=2, every=int(every))
    found = manager.restore(state, mesh, specs)
    if found is not None:
        state, meta = found
        data_key, epoch, start = meta["data_key"], meta["epoch"], meta["batch"]
        say(f"resumed at step {int(state.step)}, epoch {epoch}, batch {start}")

    n_batches = N_EXAMPLES // (PER_DEVICE * mesh.shape["data"])
    for epoch in range(epoch, N_EPOCHS):
        for i, batch in enumerate(redeqx.batches(examples, collate_fn, PER_DEVICE, mesh, shuffle=True,
                                                 key=jax.random.fold_in(data_key, epoch), start=start), start):
            state, _ = train_step(state, batch)
            at_end = i + 1 == n_batches
            manager.save(state, epoch=epoch + at_end, batch=0 if at_end else i + 1, data_key=data_key)
            say(f"step {int(state.step)}")
            time.sleep(float(step_seconds))
        start = 0
    manager.close()
    leaves = jax.tree.leaves(eqx.filter((state.model, state.opt_state), eqx.is_array))
    gathered = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in leaves]
    key_data = np.asarray(multihost_utils.process_allgather(jax.random.key_data(state.key), tiled=True))
    if jax.process_index() == 0:
        np.savez(Path(workdir) / "final.npz", *gathered, key=key_data, step=np.asarray(int(state.step)))


if __name__ == "__main__":
    main(*sys.argv[1:])
