"""The computation `test_multihost.py` runs as several processes (under
``python -m redeqx.launch``) and, for reference, in one process:

    python -m redeqx.launch -n 2 tests/multihost_worker.py OUT_DIR SAVE_TO RESTORE_FROM

Trains a tiny MLP for 5 steps with ``n_model_shards=2`` and saves the state
to SAVE_TO, runs `predict` over 13 examples (not a multiple of the global
batch of 8) and `evaluate`, then restores the checkpoint RESTORE_FROM (saved
by a run with another process count) and trains 3 more steps. Each process
writes what it saw to ``OUT_DIR/process_<i>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import redeqx

N_STEPS = 5
PER_DEVICE = 2  # 4 data shards -> global batch 8


def make_data(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x[:, :4] * 2.0 - x[:, 4:]).astype(np.float32)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def collate_fn(examples):
    return {"x": np.stack([e["x"] for e in examples]), "y": np.stack([e["y"] for e in examples])}


def loss_fn(model, batch, key):
    pred = jax.vmap(model)(batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)


def pred_fn(model, batch, key):
    return jax.vmap(model)(batch["x"])


def setup():
    mesh = redeqx.make_mesh(n_model_shards=2)
    model = eqx.nn.MLP(8, 4, width_size=16, depth=2, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.adam(1e-2)
    return mesh, model, specs, optimizer


def train(state, examples, mesh, specs, optimizer, key):
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    losses = []
    for batch in redeqx.batches(examples, collate_fn, PER_DEVICE, mesh, shuffle=True, key=key):
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def continue_from(path, mesh, model, specs, optimizer):
    """Restores the `TrainState` at ``path`` and trains 3 more steps."""
    like = eqx.filter_eval_shape(redeqx.init_state, model, optimizer, mesh, specs, key=jax.random.key(1))
    state = redeqx.restore_checkpoint(path, like, mesh, specs)
    return train(state, make_data(8 * 3, seed=5), mesh, specs, optimizer, jax.random.key(6))


def run(save_to=None, restore_from=None):
    """The whole computation on whatever devices this run has; returns
    (JSON-able results, the trained state)."""
    mesh, model, specs, optimizer = setup()
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    state, losses = train(state, make_data(8 * N_STEPS, seed=0), mesh, specs, optimizer, jax.random.key(2))
    if save_to is not None:
        redeqx.save_checkpoint(save_to, state)
    test = make_data(13, seed=1)
    preds = redeqx.predict(redeqx.make_predict_step(pred_fn, mesh, specs), state.model, test, collate_fn,
                           PER_DEVICE, mesh, key=jax.random.key(3))
    metrics = redeqx.evaluate(redeqx.make_eval_step(loss_fn, mesh, specs), state.model, test, collate_fn,
                              PER_DEVICE, mesh, key=jax.random.key(4))
    result = {
        "losses": losses,
        "preds": np.stack([np.asarray(p) for p in preds]).tolist(),
        "eval_loss": metrics["loss"],
        "n_devices": len(jax.devices()),
        "n_processes": jax.process_count(),
    }
    # NumPy rows given to a step straight away: each process's rows are its share of the
    # global batch (as redeqx.batches makes them), never taken as the whole batch
    rows = collate_fn(make_data(8, seed=7))["x"]
    n, me = jax.process_count(), jax.process_index()
    mine = rows[me * 8 // n:(me + 1) * 8 // n]
    preds = redeqx.make_predict_step(pred_fn, mesh, specs)(state.model, {"x": mine}, jax.random.key(8))
    from redeqx.data._data import to_host

    result["local_rows_preds"] = np.asarray(to_host(preds)).tolist()
    try:  # make_step cannot know what a NumPy argument means across processes: an error, not a guess
        redeqx.make_step(lambda s, b: (s, jnp.mean(b["x"])), mesh, donate=False)(state, {"x": mine})
        result["make_step_numpy"] = "no error"
    except ValueError as e:
        result["make_step_numpy"] = str(e)
    if restore_from is not None:
        result["continued_losses"] = continue_from(restore_from, mesh, model, specs, optimizer)[1]
    return result, state


def main(out_dir: str, save_to: str, restore_from: str) -> None:
    redeqx.initialize()  # a no-op under redeqx.launch, which already started the run
    try:
        redeqx.initialize("127.0.0.1", n_processes=3, process_id=0)
        second_call = "no error"
    except RuntimeError as e:
        second_call = str(e)
    result, _ = run(save_to, restore_from)
    result["second_call"] = second_call
    with open(os.path.join(out_dir, f"process_{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
