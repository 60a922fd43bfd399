"""lr_schedule: warm-up and decay over exactly the steps a loop over
redeqx.batches runs, whatever accumulate is."""

import warnings

import jax
import numpy as np
import optax
import pytest

import redeqx
from _helpers import mlp, sharded_state, xent_loss


def examples(n, dim=4, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=dim).astype(np.float32), "y": i % 3} for i in range(n)]


def collate(es):
    return {"x": np.stack([e["x"] for e in es]), "y": np.array([e["y"] for e in es], np.int32)}


def test_lr_schedule_shapes(devices):
    mesh = redeqx.make_mesh(2)  # data = 4
    # 1000 examples, 8 per device * 4 = 32 per step -> 31 steps per epoch, 2 epochs -> 62 steps
    lin = redeqx.lr_schedule(1000, 8, 2, 1e-3, mesh, warmup_steps=10, init_learning_rate=1e-5, end_learning_rate=0.0)
    lrs = np.asarray([lin(i) for i in range(63)])
    assert lrs[0] == pytest.approx(1e-5, rel=1e-4)
    assert lrs[10] == pytest.approx(1e-3, rel=1e-5)
    assert np.all(np.diff(lrs[:11]) > 0) and np.all(np.diff(lrs[10:]) < 0)
    assert lrs[62] == pytest.approx(0.0, abs=1e-9)
    assert lrs[36] == pytest.approx(1e-3 * (62 - 36) / 52, rel=1e-4)  # linear decay
    cos = redeqx.lr_schedule(1000, 8, 2, 1e-3, mesh, schedule_type="cosine", warmup_ratio=0.1)
    assert cos(6) == pytest.approx(1e-3, rel=1e-5)  # int(0.1 * 62) = 6 warm-up steps
    assert cos(6 + 28) == pytest.approx(0.5e-3, rel=1e-3)  # half way through the cosine
    assert cos(62) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(TypeError, match=r"schedule_type='step' is a str, expected 'linear' or 'cosine'"):
        redeqx.lr_schedule(1000, 8, 2, 1e-3, mesh, schedule_type="step")
    with pytest.raises(ValueError, match="smaller than one step's 32 examples.*drop_last=False"):
        redeqx.lr_schedule(10, 8, 2, 1e-3, mesh)
    with pytest.raises(ValueError, match="learning_rate must be a finite rate >= 0, got nan"):
        redeqx.lr_schedule(1000, 8, 2, float("nan"), mesh)  # once accepted: every update NaN
    with pytest.raises(ValueError, match="end_learning_rate must be a finite rate >= 0, got -1e-05"):
        redeqx.lr_schedule(1000, 8, 2, 1e-3, mesh, end_learning_rate=-1e-5)


@pytest.mark.parametrize("accumulate", [1, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_schedule_ends_at_the_last_step_batches_yields(shuffle, accumulate, devices):
    """264 examples, 8 rows per data shard x data 4 = 32 a step: 8 steps an
    epoch when shuffled (the short last batch dropped), 9 in order (it is
    filled up), whatever accumulate is. drop_last means what it means in
    batches."""
    mesh = redeqx.make_mesh(2)
    train, per_device, n_epochs, peak, end = examples(264), 8, 2, 1e-2, 1e-4
    schedule = redeqx.lr_schedule(len(train), per_device, n_epochs, peak, mesh, warmup_ratio=0.25,
                                  end_learning_rate=end, accumulate=accumulate, drop_last=shuffle)
    optimizer = optax.sgd(schedule)
    specs, state = sharded_state(mlp(4, 3, 8, depth=1), optimizer, mesh)
    train_step = redeqx.make_train_step(xent_loss, optimizer, mesh, specs, accumulate=accumulate)
    after = []  # the rate once each step is done: schedule(state.step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # in order, the last batch is filled up with a warning
        for epoch in range(n_epochs):
            for batch in redeqx.batches(train, collate, per_device, mesh, shuffle=shuffle,
                                        key=jax.random.fold_in(jax.random.key(2), epoch)):
                state, _ = train_step(state, batch)
                after.append(float(schedule(int(state.step))))
    n = len(after)
    assert n == int(state.step) == n_epochs * (8 if shuffle else 9)
    assert after[-1] == pytest.approx(end, rel=1e-5)  # reached at the last step ...
    assert min(after[:-1]) > 1.01 * end  # ... and not before
    rates = np.asarray([schedule(k) for k in range(n + 1)])
    warm = int(0.25 * n)  # warm-up is a share of those same steps
    assert rates[0] == 0.0 and rates[warm] == pytest.approx(peak, rel=1e-5)
    assert np.all(np.diff(rates[: warm + 1]) > 0) and np.all(np.diff(rates[warm:]) < 0)


def test_accumulate_is_checked_and_changes_nothing(devices):
    mesh = redeqx.make_mesh(2)  # data = 4
    plain = redeqx.lr_schedule(1000, 8, 2, 1e-3, mesh, warmup_ratio=0.1)
    for k in (2, 4, 8):
        acc = redeqx.lr_schedule(1000, 8, 2, 1e-3, mesh, warmup_ratio=0.1, accumulate=k)
        np.testing.assert_array_equal([acc(i) for i in range(64)], [plain(i) for i in range(64)])
    with pytest.raises(ValueError, match=r"per_device_batch_size=6 is not a multiple of accumulate=4.*e\.g\. 24"):
        redeqx.lr_schedule(1000, 6, 2, 1e-3, mesh, accumulate=4)
    with pytest.raises(ValueError, match="accumulate must be a positive int, got 0"):
        redeqx.lr_schedule(1000, 8, 2, 1e-3, mesh, accumulate=0)


def test_drop_last_false_counts_the_filled_up_batch(devices):
    mesh = redeqx.make_mesh(2)  # data = 4: 8 rows a step
    kept = redeqx.lr_schedule(12, 2, 3, 1e-3, mesh, drop_last=False)  # 2 batches an epoch, 6 steps
    assert kept(6) == 0.0 and kept(5) > 0
    with pytest.warns(UserWarning, match="last batch has 4 of 8"):
        assert len(list(redeqx.batches(examples(12), collate, 2, mesh))) == 2
    dropped = redeqx.lr_schedule(12, 2, 3, 1e-3, mesh)  # 1 batch an epoch, 3 steps
    assert dropped(3) == 0.0 and dropped(2) > 0
