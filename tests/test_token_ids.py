"""Token ids outside a zoo model's vocabulary are never read as other tokens
(issue 49, item 3): `jnp.take` reads ``-1`` as the last row, so a ``-1`` pad id
left in a batch trained on the last token with a finite loss. The zoo's one
token lookup (`redeqx.models._layers.Embedding`) gives such ids, negative or
``>= vocab_size``, a row of NaN, so the loss is NaN and `redeqx.Logger` stops
the run; valid ids' rows and gradients are unchanged, on a table split over
the vocabulary too."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redeqx
from _helpers import next_token_loss, one_device, sharded_state
from families import FAMILIES, V
from redeqx import models
from redeqx.models import shift_right
from redeqx.models._layers import Embedding

BAD = 5  # the position the bad id takes


def _ids(rows=3, seq=12, seed=0):
    """A clean row, then the same row with -1, then with ``V``, at `BAD`."""
    ids = np.random.default_rng(seed).integers(3, V, (rows, seq)).astype(np.int32)
    ids[:] = ids[0]
    ids[1, BAD], ids[2, BAD] = -1, V
    return jnp.asarray(ids)


def test_embedding_gives_nan_rows_for_out_of_range_ids():
    emb = Embedding(V, 8, key=jax.random.key(0))
    ids = jnp.asarray([0, V - 1, -1, V, -100, 2**30, -(2**31), 7], jnp.int32)
    out = np.asarray(jax.jit(lambda e, i: e(i))(emb, ids))
    w = np.asarray(emb.weight)
    np.testing.assert_array_equal(out[[0, 1, 7]], w[[0, V - 1, 7]])
    assert np.isnan(out[2:7]).all(), "an out-of-range id must look up NaN, not another token's row"
    small = np.asarray(emb(jnp.asarray([-1, 3], jnp.int16)))  # narrow ints: -1 is not wrapped either
    assert np.isnan(small[0]).all() and (small[1] == w[3]).all()


def test_embedding_gradients_unchanged_for_valid_ids_and_none_from_bad_ones():
    emb = Embedding(V, 8, key=jax.random.key(0))
    valid = jnp.asarray([0, V - 1, 3, 3], jnp.int32)
    ct = jax.random.normal(jax.random.key(1), (4, 8))

    def loss(e, ids, lookup):
        rows = lookup(e, ids)
        return jnp.sum(jnp.where(jnp.isnan(rows), 0.0, rows) * ct)  # bad rows masked out of the loss

    new = jax.grad(loss)(emb, valid, lambda e, i: e(i)).weight
    old = jax.grad(loss)(emb, valid, lambda e, i: jnp.take(e.weight, i, axis=0)).weight  # the lookup before
    np.testing.assert_array_equal(new, old)
    bad = jnp.asarray([0, -1, 3, V], jnp.int32)  # -1 must not send its gradient to the last row
    g = np.asarray(jax.grad(loss)(emb, bad, lambda e, i: e(i)).weight)
    expect = np.zeros((V, 8), np.float32)
    expect[0], expect[3] = ct[0], ct[2]
    np.testing.assert_array_equal(g, expect)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_gives_nan_logits_for_out_of_range_ids(name):
    family = FAMILIES[name]
    model = family.build()
    logits = eqx.filter_jit(family.logits)
    ids = _ids()
    out = np.asarray(logits(model, ids))
    assert np.isfinite(out[0]).all()
    np.testing.assert_allclose(out[0], np.asarray(logits(model, ids[:1]))[0], rtol=0, atol=1e-6)  # valid: unchanged
    for row, what in ((1, "-1"), (2, f"{V} (= vocab_size)")):
        seen = out[row, BAD:] if family.kind != "seq2seq" else out[row]  # seq2seq: the encoder sees every position
        assert np.isnan(seen).all(), f"{name}: id {what} at position {BAD} gave finite logits"


def test_shift_right_ignores_minus_100_and_leaves_other_bad_labels_to_give_nan():
    family = FAMILIES["t5"]
    model = family.build()
    src = _ids()[0]
    labels = jnp.asarray([[5, 6, -100, -100], [5, 6, -1, 7], [5, 6, V, 7]], jnp.int32)
    dec = shift_right(labels, model.config)
    np.testing.assert_array_equal(dec[0], [model.config.decoder_start_token_id, 5, 6, model.config.pad_token_id])
    out = np.asarray(eqx.filter_jit(jax.vmap(lambda d: model(src, d)))(dec))
    assert np.isfinite(out[0]).all()
    assert np.isnan(out[1, 3:]).all() and np.isnan(out[2, 3:]).all()  # the bad label is the last position's input


def test_vocab_split_lookup_gives_a_nan_loss_for_a_minus_1_id():
    """On 4 data x 2 model shards, the token table split over the vocabulary:
    a clean batch's loss and updated table are the one-device step's, and a
    ``-1`` in the batch makes the step's loss NaN (no shard's row is read for it)."""
    model = FAMILIES["llama"].build()
    clean = np.random.default_rng(0).integers(3, V, (4, 13)).astype(np.int32)
    bad = clean.copy()
    bad[2, 4] = -1  # an input id (the next position's label is valid)
    results = {}
    for n, mesh in (("one", one_device()), ("split", redeqx.make_mesh(2))):
        specs, state = sharded_state(model, optax.sgd(0.1), mesh)
        step = redeqx.make_train_step(next_token_loss, optax.sgd(0.1), mesh, specs)
        state, metrics = step(state, {"ids": jnp.asarray(clean)})
        results[n] = float(metrics["loss"]), np.asarray(state.model.model.embed_tokens.weight)
        if n == "split":
            assert state.model.model.embed_tokens.weight.sharding.spec[0] == "model", "the table is not split"
            _, metrics = step(state, {"ids": jnp.asarray(bad)})
            assert np.isnan(float(metrics["loss"])), "a -1 input id must not give a finite loss"
    assert np.isfinite(results["one"][0])
    np.testing.assert_allclose(results["split"][0], results["one"][0], rtol=1e-5)
    np.testing.assert_allclose(results["split"][1], results["one"][1], rtol=0, atol=1e-6)


def test_cross_entropy_skips_ignored_labels_and_refuses_out_of_range_ones():
    """optax alone reads -100 or -1 as a token counted from the end of the vocabulary (a finite, wrong
    loss); models.cross_entropy skips -100 on purpose and makes any other out-of-range label NaN."""
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
    labels = jnp.array([[1, 2, -100, 3, 6], [0, -100, -100, 5, 4]])
    counted = labels != -100
    plain = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(counted, labels, 0))
    loss = jax.jit(models.cross_entropy)(logits, labels)
    np.testing.assert_allclose(loss, (plain * counted).sum() / counted.sum(), rtol=1e-6)
    grads = jax.jit(jax.grad(models.cross_entropy))(logits, labels)
    assert not np.asarray(grads[0, 2]).any() and np.isfinite(np.asarray(grads)).all()  # nothing from a skipped label
    for bad in (-1, 7):
        assert np.isnan(models.cross_entropy(logits, labels.at[0, 0].set(bad)))
    assert float(models.cross_entropy(logits, jnp.full((2, 5), -100))) == 0.0
    assert np.isnan(models.cross_entropy(logits, labels, ignore_index=None))  # then -100 is out of range too
    # NumPy arrays (a metric outside a step) are taken as they are, and give the same loss
    np.testing.assert_allclose(models.cross_entropy(np.asarray(logits), np.asarray(labels)), loss, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_gradient_is_autodiffs_without_a_scatter(dtype):
    """models.cross_entropy's written-out derivative (softmax - one_hot, in the logits' dtype) gives
    what autodiff derives from optax on float32 logits, skipped labels included, in reverse and
    forward mode; the gradient's program holds no scatter (take_along_axis's transpose, which wrote
    the label's gradient into a float32 zero array the size of the logits)."""
    k = jax.random.split(jax.random.key(1), 3)
    logits = (3 * jax.random.normal(k[0], (3, 6, 40))).astype(dtype)
    labels = jax.random.randint(k[1], (3, 6), 0, 40).at[1, 2].set(-100)
    counted = labels != -100

    def optax_loss(x):
        nll = optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), jnp.where(counted, labels, 0))
        return (nll * counted).sum() / counted.sum()

    (v0, g0), (v1, g1) = (jax.value_and_grad(f)(logits) for f in (optax_loss, lambda x: models.cross_entropy(x, labels)))
    assert g1.dtype == dtype
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g1, np.float32), np.asarray(g0, np.float32), rtol=0,
                               atol=1e-7 if dtype == jnp.float32 else 0)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: models.cross_entropy(x, labels)))(logits))
    assert "scatter" not in jaxpr
    # forward mode too (jax.jvp, Hessian-vector products): a custom_vjp would refuse it
    t = jax.random.normal(k[2], logits.shape).astype(dtype)
    j0, j1 = (jax.jvp(f, (logits,), (t,))[1] for f in (optax_loss, lambda x: models.cross_entropy(x, labels)))
    np.testing.assert_allclose(j1, j0, rtol=1e-5, atol=1e-6)
    if dtype == jnp.float32:
        hvp = lambda f: jax.jvp(jax.grad(f), (logits,), (t,))[1]  # noqa: E731
        np.testing.assert_allclose(hvp(lambda x: models.cross_entropy(x, labels)), hvp(optax_loss), atol=1e-6)
