"""Remat: the same loss and gradients, fewer temporaries in the compiled step
(read from the compiled program, which holds on any backend)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redeqx
from redeqx import models
from tiny_transformer import TinyLM, collate_tokens, lm_loss, token_examples


def grads(loss, model, batch):
    """The loss and its gradients, jitted (eagerly each of the model's ops compiled on its own)."""
    return eqx.filter_jit(eqx.filter_value_and_grad(lambda m: loss(m, batch, jax.random.key(0))[0]))(model)


@pytest.mark.slow
def test_remat_gives_the_same_loss_and_gradients():
    model = TinyLM(vocab=32, dim=32, n_heads=4, hidden=64, n_layers=3, key=jax.random.key(0))
    batch = jax.tree.map(jnp.asarray, collate_tokens(token_examples(4, vocab=32)))
    (l0, g0), (l1, g1) = grads(lm_loss, model, batch), grads(redeqx.remat(lm_loss), model, batch)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # the loss sees each block wrapped (called under checkpoint, its attributes passed through); the
    # model itself, its classes and paths (so specs and checkpoints), are untouched
    seen = []

    def spy(model, batch, key):
        seen.append((type(model.blocks[0]), model.blocks[0].attn is not None))
        return lm_loss(model, batch, key)

    grads(redeqx.remat(spy), model, batch)
    assert seen == [(redeqx.steps._remat.Recomputed, True)]
    assert all(type(b).__name__ == "Block" for b in model.blocks)


def test_recomputed_call_and_its_deprecated_public_name():
    w = jax.random.normal(jax.random.key(0), (8, 8))
    f = lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))  # noqa: E731
    x = jax.random.normal(jax.random.key(1), (4, 8))
    recomputed_call = redeqx.steps._remat.recomputed_call
    for keep in ("nothing", "dots"):
        np.testing.assert_allclose(jax.grad(recomputed_call(f, keep=keep))(w, x), jax.grad(f)(w, x), rtol=1e-6)
    # redeqx.checkpoint meant remat while every other checkpoint is on disk: one release of warning, same result
    with pytest.warns(DeprecationWarning, match=r"redeqx\.checkpoint is deprecated .* use redeqx\.remat\(loss_fn\)") as seen:
        old_name = redeqx.checkpoint(f)
    assert seen[0].filename == __file__  # the warning points at the caller's line
    np.testing.assert_allclose(jax.grad(old_name)(w, x), jax.grad(f)(w, x), rtol=1e-6)


def compiled_temp(loss_fn, model, n_model_shards=2, seq=128):
    mesh = redeqx.make_mesh(n_model_shards)
    abstract = eqx.filter_eval_shape(lambda: model)
    specs = redeqx.sharding_rules(abstract, mesh)
    optimizer = optax.sgd(1e-3)
    state = redeqx.init_state(abstract, optimizer, mesh, specs, key=jax.random.key(0))
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    batch = {"tokens": jax.ShapeDtypeStruct((8, seq + 1), jnp.int32)}
    return step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_remat_lowers_temporaries_of_any_model():
    """XLA:CPU merges jax.checkpoint's recomputation back into the forward
    pass; redeqx.remat's survives, so the compiled step needs less memory."""
    model = eqx.filter_eval_shape(lambda: TinyLM(vocab=64, dim=128, n_heads=4, hidden=256, n_layers=8,
                                                 key=jax.random.key(0)))
    plain, rematted = compiled_temp(lm_loss, model), compiled_temp(redeqx.remat(lm_loss), model)
    assert rematted < 0.6 * plain, (rematted, plain)


def _zoo_llama(scan_layers):
    config = models.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                                num_attention_heads=4, scan_layers=scan_layers)
    return eqx.filter_eval_shape(models.LlamaForCausalLM, config, key=jax.random.key(0))


def _zoo_loss(model, batch, key):
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@pytest.fixture(scope="module")
def zoo_plain():
    """The listed layers' step without remat, the bar of both layouts below: compiled once."""
    return compiled_temp(_zoo_loss, _zoo_llama(False))


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True])
def test_zoo_remat_lowers_temporaries(zoo_plain, scan_layers):
    """In either layout (a zoo stack already keeps only its matrix products;
    remat recomputes them too), below 0.6x of the listed layers without remat."""
    plain, rematted = zoo_plain, compiled_temp(redeqx.remat(_zoo_loss), _zoo_llama(scan_layers))
    assert rematted < 0.6 * plain, (rematted, plain)
