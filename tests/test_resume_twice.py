"""The README's resume loop, stopped and resumed several times (twice within
an epoch, once across an epoch boundary), runs exactly the steps of a run
that never stopped and ends bit-identical to it. The saved batch position
must be absolute: ``enumerate(redeqx.batches(..., start=s), start=s)``. With
``enumerate(redeqx.batches(..., start=s))`` the second stop in one epoch
saves a position relative to the first, and the resumed run repeats
batches."""

import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import redeqx

sys.path.insert(0, str(Path(__file__).parent))
from tiny_transformer import TinyLM, collate_tokens, lm_loss, token_examples  # noqa: E402

N_EPOCHS, PER_DEVICE, N_EXAMPLES = 2, 2, 32  # mesh data = 4: 8 rows a batch; 4 batches an epoch, 8 steps


@pytest.fixture(scope="module")
def setup(devices):
    mesh = redeqx.make_mesh(2)
    make_model = lambda: TinyLM(vocab=32, dim=16, n_heads=2, hidden=32, n_layers=1, key=jax.random.key(0))  # noqa: E731
    specs = redeqx.sharding_rules(make_model(), mesh)
    optimizer = optax.adamw(redeqx.lr_schedule(N_EXAMPLES, PER_DEVICE, N_EPOCHS, 1e-2, mesh, warmup_ratio=0.25))
    train_step = redeqx.make_train_step(lm_loss, optimizer, mesh, specs)
    return mesh, make_model, specs, optimizer, train_step, token_examples(N_EXAMPLES, seq_len=8, vocab=32)


def run(workdir, setup, stop_after=None):
    """The README loop; returns the state and how many steps this call ran."""
    mesh, make_model, specs, optimizer, train_step, train = setup
    state = redeqx.init_state(make_model(), optimizer, mesh, specs, key=jax.random.key(1))  # a fresh process's start
    key, ran = jax.random.key(2), 0
    manager = redeqx.CheckpointManager(workdir, keep_last=2)
    start_epoch, start_batch = 0, 0
    if (found := manager.restore(state, mesh, specs)) is not None:
        state, meta = found
        start_epoch, start_batch = meta["epoch"], meta["batch"]
    for epoch in range(start_epoch, N_EPOCHS):
        data_key = jax.random.fold_in(key, epoch)
        s = start_batch if epoch == start_epoch else 0
        for i, batch in enumerate(redeqx.batches(train, collate_tokens, PER_DEVICE, mesh, shuffle=True,
                                                 key=data_key, start=s), start=s):
            state, _ = train_step(state, batch)
            ran += 1
            manager.save(state, epoch=epoch, batch=i + 1, data_key=data_key)
            if int(state.step) == stop_after:
                manager.close()
                return state, ran
    manager.close()
    return state, ran


def leaves(state):
    arrays = jax.tree.leaves(eqx.filter((state.model, state.opt_state), eqx.is_array))
    return [np.asarray(x) for x in arrays] + [np.asarray(jax.random.key_data(state.key)), np.asarray(state.step)]


@pytest.mark.slow
def test_stopped_and_resumed_is_bit_identical(setup, tmp_path):
    want, n_reference = run(tmp_path / "reference", setup)
    assert n_reference == int(want.step) == 8
    # stop after step 2 and 3 (both mid epoch 0), then 6 (mid epoch 1, resumed across the boundary). With
    # the relative position the second stop saves batch 1, not 3: the third call repeats batches 1 and 2
    # and the last one runs 5 steps, not 2
    ran = [run(tmp_path / "resumed", setup, stop_after=stop)[1] for stop in (2, 3, 6)]
    got, last = run(tmp_path / "resumed", setup)
    ran.append(last)
    assert ran == [2, 1, 3, 2]  # 8 steps in all, none repeated or skipped
    for a, b in zip(leaves(want), leaves(got), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
