"""``make_train_step(..., shard_mean_loss=True)``: each data shard's gradients
from its own rows, averaged with one all-reduce. It trains like one device,
reduces a tied embedding's gradient once, and refuses a loss that is not a
mean over the batch's rows rather than train on wrong gradients."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redeqx
from _helpers import sharded_state
from accelerator_count import accelerator_collectives
from user_gpt import GPT, collate_fn, loss_fn, make_examples


def make_gpt(layers=1):
    """One block: what the option changes (each data shard's gradients, averaged) is the same for every
    block, and a second one only lengthened every program the tests here compile (the memory test keeps two)."""
    return GPT(vocab=64, seq=16, width=32, layers=layers, heads=4, key=jax.random.key(0))


BATCHES = [collate_fn(make_examples(16, seq=16, vocab=64, seed=i)) for i in range(3)]


OPTIMIZER = optax.sgd(0.1, momentum=0.9)
_PLAIN_STEPS = {}  # (mesh, loss) -> a step without options, compiled once for every test that trains it


def train(mesh, loss=loss_fn, batches=BATCHES, **kwargs):
    model = make_gpt()
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, OPTIMIZER, mesh, specs, key=jax.random.key(1),
                              trainable=kwargs.get("trainable"))
    if kwargs:  # shard_mean_loss=True among them: a step of its own, whose first call checks the loss
        step = redeqx.make_train_step(loss, OPTIMIZER, mesh, specs, **kwargs)
    else:
        key = (tuple(mesh.devices.flat), tuple(dict(mesh.shape).items()), loss)
        if key not in _PLAIN_STEPS:
            _PLAIN_STEPS[key] = redeqx.make_train_step(loss, OPTIMIZER, mesh, specs)
        step = _PLAIN_STEPS[key]
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.asarray(losses), state


@pytest.fixture(scope="module")
def reference(devices):
    return train(redeqx.make_mesh(1, devices=devices[:1]))


@pytest.mark.slow
@pytest.mark.parametrize("n_model_shards,accumulate", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_shard_mean_step_matches_one_device(reference, devices, n_model_shards, accumulate):
    losses, state = train(redeqx.make_mesh(n_model_shards), shard_mean_loss=True, accumulate=accumulate)
    np.testing.assert_allclose(losses, reference[0], rtol=2e-5, atol=2e-6)
    for a, b in zip(jax.tree.leaves(eqx.filter(state.model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(reference[1].model, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def frozen_embeddings(model):
    """Train the blocks only (a LoRA-style filter): the tables get no gradient."""
    spec = jax.tree.map(eqx.is_inexact_array, model)
    return eqx.tree_at(lambda m: (m.wte, m.wpe), spec, (False, False))


def test_shard_mean_step_with_frozen_leaves_matches_one_device(devices):
    trainable = frozen_embeddings(make_gpt())
    ref = train(redeqx.make_mesh(1, devices=devices[:1]), trainable=trainable)
    losses, state = train(redeqx.make_mesh(2), shard_mean_loss=True, trainable=trainable)
    np.testing.assert_allclose(losses, ref[0], rtol=2e-5, atol=2e-6)
    assert state.model.wte.weight.tolist() == make_gpt().wte.weight.tolist()  # frozen: bit-identical
    for a, b in zip(jax.tree.leaves(eqx.filter(state.model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(ref[1].model, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("n_model_shards", [1, 2])
def test_tied_embedding_gradient_is_reduced_once(devices, n_model_shards):
    """Without the option, the table's lookup and head terms are all-reduced
    one after the other (tests/test_collectives.py); with it, the step moves
    each gradient once: at one model shard, exactly the gradients' bytes."""
    mesh = redeqx.make_mesh(n_model_shards)
    model = make_gpt()
    specs, state = sharded_state(model, optax.sgd(0.1), mesh)
    moved = {}
    for flag in (False, True):
        step = redeqx.make_train_step(loss_fn, optax.sgd(0.1), mesh, specs, shard_mean_loss=flag)
        moved[flag] = sum(v["bytes"] for v in accelerator_collectives(step, state, BATCHES[0]).values())
    table = 64 * 32 * 4 // n_model_shards
    assert moved[False] - moved[True] == table
    if n_model_shards == 1:
        grad_bytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
        assert grad_bytes <= moved[True] <= grad_bytes + 16  # + the loss and grad norm's scalars


def padded(batch, seed):
    rng = np.random.default_rng(seed)
    n, t = batch["tokens"].shape
    return {**batch, "mask": (np.arange(t - 1)[None] < rng.integers(2, t - 1, (n, 1))).astype(np.float32)}


def token_mean(model, batch, key):
    """A mean over the non-padding tokens of the whole batch: not a mean of
    the shards' values when shards hold different numbers of tokens."""
    t = batch["tokens"]
    ce = optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(t[:, :-1]), t[:, 1:])
    return (ce * batch["mask"]).sum() / batch["mask"].sum()


@pytest.mark.slow
def test_a_mean_over_the_batchs_tokens_is_refused(devices):
    with pytest.raises(ValueError, match=r"'token_mean' is not the mean of its values on equal slices"):
        train(redeqx.make_mesh(2), token_mean, [padded(BATCHES[0], 0)], shard_mean_loss=True)
    # the same loss without the option trains like one device
    one = train(redeqx.make_mesh(1, devices=devices[:1]), token_mean, [padded(BATCHES[0], 0)])
    eight = train(redeqx.make_mesh(2), token_mean, [padded(BATCHES[0], 0)])
    np.testing.assert_allclose(eight[0], one[0], rtol=2e-5)


@pytest.mark.slow
def test_a_shard_with_no_tokens_is_refused_not_trained_on_nan(devices):
    """A token mean whose first rows of some shard are all padding: that
    shard's mean is 0/0, the whole batch's is finite. This once only warned
    'unchecked', and the step then trained on NaN gradients."""
    batch = padded(BATCHES[0], 0)
    batch["mask"][:4] = 0.0  # the first data shard of 4 (rows 0-3) has no tokens
    with pytest.raises(ValueError, match=r"'token_mean' is not the mean .* some shard's are not"):
        train(redeqx.make_mesh(2), token_mean, [batch], shard_mean_loss=True)
    losses, _ = train(redeqx.make_mesh(2), token_mean, [batch])  # without the option it is finite
    assert np.isfinite(losses).all()


@pytest.mark.slow
def test_a_loss_drawing_from_its_key_is_run_unchecked_with_a_warning(devices):
    def noisy(model, batch, key):
        return loss_fn(model, batch, key) + 0.01 * jax.random.normal(key)

    with pytest.warns(UserWarning, match="'noisy' draws random numbers from its key"):
        losses, _ = train(redeqx.make_mesh(2), noisy, BATCHES[:2], shard_mean_loss=True)
    assert np.all(np.isfinite(losses))


class DropoutMLP(eqx.Module):
    mlp: eqx.nn.MLP
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(4, 1, 16, 2, key=key)
        self.dropout = eqx.nn.Dropout(0.5)

    def __call__(self, x, key):
        return self.mlp(self.dropout(x, key=key))


def test_dropout_is_checked_off_and_drawn_per_shard(devices):
    """The check turns dropout off (so a dropout model passes it); in the
    step each shard draws from its own key (fold_in(key, shard)), so rows of
    different shards get different masks, as on one device."""
    mesh = redeqx.make_mesh(1)
    model = DropoutMLP(jax.random.key(0))
    specs, state = sharded_state(model, optax.sgd(0.0), mesh)

    def loss(model, batch, key):
        keys = jax.random.split(key, batch["x"].shape[0])
        return jnp.mean(jax.vmap(model)(batch["x"], keys) ** 2)

    step = redeqx.make_train_step(loss, optax.sgd(0.0), mesh, specs, shard_mean_loss=True)
    x = np.ones((8, 4), np.float32)  # one row per shard, all rows equal: only the masks differ
    key = jax.random.wrap_key_data(np.asarray(jax.random.key_data(state.key)))  # the step donates state
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dropout loss is checked, not waved through
        state, metrics = step(state, {"x": x})
    step_key = jax.random.split(key)[1]

    def shard_loss(k):
        return loss(model, {"x": jnp.ones((1, 4))}, k)

    per_shard = [float(shard_loss(jax.random.fold_in(step_key, d))) for d in range(8)]
    assert len(set(per_shard)) > 1
    np.testing.assert_allclose(float(metrics["loss"]), np.mean(per_shard), rtol=1e-5)


def test_what_shard_mean_loss_cannot_do_is_refused(devices):
    mesh = redeqx.make_mesh(2)
    model = GPT(vocab=256, seq=16, width=128, layers=1, heads=4, key=jax.random.key(0))  # big enough for fsdp
    with pytest.raises(ValueError, match=r"shard_mean_loss=True needs every parameter whole .* fsdp"):
        redeqx.make_train_step(loss_fn, optax.sgd(0.1), mesh, redeqx.sharding_rules(model, mesh, fsdp=True),
                               shard_mean_loss=True)
    with pytest.raises(Exception, match="shard_mean_loss"):
        redeqx.make_train_step(loss_fn, optax.sgd(0.1), mesh, redeqx.sharding_rules(model, mesh),
                               shard_mean_loss="yes")

    bn = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")
    model, model_state = eqx.nn.make_with_state(lambda: bn)()
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.sgd(0.1), mesh, specs, key=jax.random.key(1), model_state=model_state)

    def loss(model, batch, key, model_state):
        out, model_state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            batch["x"], model_state)
        return jnp.mean(out ** 2), model_state

    step = redeqx.make_train_step(loss, optax.sgd(0.1), mesh, specs, shard_mean_loss=True)
    with pytest.raises(ValueError, match="cannot keep a model_state"):
        step(state, {"x": np.ones((8, 4), np.float32)})


def test_accumulate_that_does_not_divide_a_shards_rows_is_named(devices):
    """accumulate=3 on 4 rows per data shard: the error names the shard's rows
    and the fix, not a data axis that the per-shard split does not have."""
    with pytest.raises(ValueError, match=r"accumulate=3 cannot split a data shard's 4 rows into equal micro-batches"
                                         r": make per_device_batch_size a multiple of accumulate"):
        train(redeqx.make_mesh(2), accumulate=3, shard_mean_loss=True)


@pytest.mark.slow
def test_the_first_call_check_needs_less_memory_than_the_step(devices):
    """The check compares two gradient trees in float32, on a few rows of
    each shard, so it never needs more memory than the step it guards
    (XLA's own figures for both compiled programs)."""
    mesh = redeqx.make_mesh(2)
    model = make_gpt(layers=2)
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.adamw(1e-3)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs, shard_mean_loss=True,
                                  compute_dtype=jnp.bfloat16)
    batch = collate_fn(make_examples(64, seq=16, vocab=64))

    def temporaries(compiled):
        return compiled.lower(state, batch).compile().memory_analysis().temp_size_in_bytes

    assert temporaries(step._first_call_check) < temporaries(step._compiled)


@pytest.mark.slow
def test_gradients_the_check_cannot_compare(devices):
    """Zero gradients agree (nothing to refuse); non-finite ones cannot be
    compared, which is said, not mistaken for a broken promise."""
    def constant(model, batch, key):  # no gradient at all
        return jnp.sum(jax.lax.stop_gradient(model.wte.weight)) * 0.0

    losses, _ = train(redeqx.make_mesh(2), constant, BATCHES[:1], shard_mean_loss=True)
    assert losses.tolist() == [0.0]

    def broken(model, batch, key):
        return loss_fn(model, batch, key) * jnp.float32(np.nan)

    with pytest.warns(UserWarning, match="'broken' gave non-finite gradients"):
        train(redeqx.make_mesh(2), broken, BATCHES[:1], shard_mean_loss=True)
