"""Column-parallel projections of one input as one product (`redeqx.models._layers.joined_linears`:
a gated MLP's gate and up, attention's Q, K and V): the values and gradients of the layers called
one by one, one ``dot_general`` for each shape that joins, and each layer called as it is where
they must not (a single row, a LoRA adapter)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from redeqx import models
from redeqx.models._layers import Linear, joined_linears


def _pair(bias: bool):
    kg, ku = jax.random.split(jax.random.key(0))
    gate, up = Linear(8, 12, bias=bias, key=kg), Linear(8, 12, bias=bias, key=ku)
    if bias:  # nonzero biases, so a bias added to the wrong product shows
        gate = eqx.tree_at(lambda m: m.bias, gate, jnp.arange(12.0) / 7)
        up = eqx.tree_at(lambda m: m.bias, up, -jnp.arange(12.0) / 5)
    return gate, up


def _products(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


def _swiglu(layers, x):
    gate, up = joined_linears(x, layers)
    return jnp.sum(jnp.sin(jax.nn.silu(gate) * up))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 8)])
def test_one_product_gives_each_layers_values_and_gradients(bias, shape):
    layers = _pair(bias)
    x = jax.random.normal(jax.random.key(1), shape)
    separate = lambda ls, x: jnp.sum(jnp.sin(jax.nn.silu(ls[0](x)) * ls[1](x)))  # noqa: E731
    assert _products(lambda x: joined_linears(x, layers), x) == 1
    for got, want in zip(joined_linears(x, layers), (layers[0](x), layers[1](x))):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    got = jax.grad(_swiglu, argnums=(0, 1))(layers, x)
    want = jax.grad(separate, argnums=(0, 1))(layers, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_layers_of_another_shape_join_their_own_kind():
    """Grouped-query attention: Q's product alone, K and V's as one, each layer's values and
    gradients as called one by one."""
    kq, kk, kv = jax.random.split(jax.random.key(4), 3)
    layers = (Linear(8, 12, bias=True, key=kq), Linear(8, 4, bias=True, key=kk), Linear(8, 4, bias=True, key=kv))
    layers = tuple(eqx.tree_at(lambda m: m.bias, layer, jnp.arange(layer.bias.size) / (3 + i))
                   for i, layer in enumerate(layers))
    x = jax.random.normal(jax.random.key(5), (5, 8))
    assert _products(lambda x: joined_linears(x, layers), x) == 2
    for got, layer in zip(joined_linears(x, layers), layers, strict=True):
        np.testing.assert_allclose(got, layer(x), rtol=1e-6, atol=1e-6)
    loss = lambda ls, x, f: sum(jnp.sum(jnp.sin(y) * (i + 1)) for i, y in enumerate(f(ls, x)))  # noqa: E731
    got = jax.grad(loss, argnums=(0, 1))(layers, x, lambda ls, x: joined_linears(x, ls))
    want = jax.grad(loss, argnums=(0, 1))(layers, x, lambda ls, x: tuple(layer(x) for layer in ls))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_unjoined_and_an_adapter_take_each_layer_as_it_is():
    layers = _pair(True)
    x = jax.random.normal(jax.random.key(3), (4, 8))
    assert _products(lambda x: joined_linears(x, layers, joined=False), x) == 2
    for got, want in zip(joined_linears(x, layers, joined=False), (layers[0](x), layers[1](x))):
        np.testing.assert_array_equal(got, want)

    adapted = models.lora({"gate_proj": layers[0], "up_proj": layers[1]}, "gate_proj", rank=2, alpha=4.0,
                          key=jax.random.key(2))
    adapted["gate_proj"] = eqx.tree_at(lambda m: m.lora_b, adapted["gate_proj"], jnp.ones((12, 2)))  # B = 0 hides it
    pair = (adapted["gate_proj"], adapted["up_proj"])
    for got, want in zip(joined_linears(x, pair), (pair[0](x), pair[1](x))):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_training_joins_and_generation_multiplies_each_layer(family):
    """The join's stack is a copy of the weights that only a backward pass pays back: generation's
    passes with a cache (the prompt's, each token's) keep the products apart; a pass without one
    joins (training's, and a seq2seq model's encoder, once per generation). A stack per layer for
    gate and up (LLaMA; T5's gated FF in each of 4 layers), one for Q, K and V (as many KV heads
    as query heads), and one for K and V of T5's decoder's cross attention."""
    if family == "llama":
        config = models.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=2, scan_layers=False)
        model = models.LlamaForCausalLM(config, key=jax.random.key(0))
    else:
        config = models.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2,
                                 feed_forward_proj="gated-gelu", scan_layers=False)
        model = models.T5ForConditionalGeneration(config, key=jax.random.key(0))
    ids = jnp.ones((2, 5), jnp.int32)
    forward = (lambda m: jax.vmap(m)(ids)) if family == "llama" else (lambda m: jax.vmap(m)(ids, ids))
    assert str(jax.make_jaxpr(forward)(model)).count("stack[") == (4 if family == "llama" else 10)
    generated = jax.make_jaxpr(lambda m: models.generate(m, ids, max_new_tokens=3))(model)
    assert str(generated).count("stack[") == (0 if family == "llama" else 4)  # T5's encoder pass has no cache
