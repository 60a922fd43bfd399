"""Every family of the zoo (tests/families.py) with its layers stacked (``scan_layers=True``, a
``lax.scan`` over one layer's arrays with a leading layer axis): indexed like a list, its scan's
unroll, LoRA, init_model and a train step (stacked = listed is in test_family_contract.py)."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from _helpers import sharded_state
from families import FAMILIES, V
from redeqx import models
from redeqx._trees import named_leaves

CONFIGS = {name: (family.model, family.config) for name, family in FAMILIES.items()}


def build(family, stacked, key=0):
    return FAMILIES[family].build(key, scan_layers=stacked)


def forward(model, family, x):
    return FAMILIES[family].logits(model, x)


@functools.cache
def jitted_forward(family):
    """``forward`` jitted: one compile per model structure (eagerly each op compiled on its own). Not
    for the scan_unroll test, whose platform choice (SCAN_UNROLL) is read when a model is traced."""
    return eqx.filter_jit(FAMILIES[family].logits)


def ids(seed=0, n=4, t=9):
    return jnp.asarray(np.random.default_rng(seed).integers(2, V, (n, t)), jnp.int32)


def lm_loss(model, batch, key):
    x = batch["ids"]
    logits = jax.vmap(model)(x[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()


@pytest.mark.slow
def test_stacked_llama_trains_with_lora_init_model_and_checkpoints(tmp_path):
    mesh = redeqx.make_mesh(2)
    cls, config = CONFIGS["llama"]
    stacked_config = dataclasses.replace(config, scan_layers=True)
    model = redeqx.init_model(lambda k: cls(stacked_config, key=k), mesh, key=jax.random.key(0))
    for (path, a), (_, b) in zip(named_leaves(eqx.filter(model, eqx.is_array)),
                                 named_leaves(eqx.filter(build("llama", True), eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8, err_msg=path)

    adapted = models.lora(model, r"self_attn\.(q_proj|v_proj)$", rank=2, alpha=4, key=jax.random.key(1))
    assert adapted.model.layers.self_attn.q_proj.lora_a.shape == (3, 2, 32)
    trainable = models.lora_trainable(adapted)
    specs = redeqx.sharding_rules(adapted, mesh)
    assert specs.model.layers.self_attn.q_proj.lora_b == P(None, "model", None)
    optimizer = optax.adam(1e-2)
    state = redeqx.init_state(adapted, optimizer, mesh, specs, key=jax.random.key(2), trainable=trainable)
    step = redeqx.make_train_step(lm_loss, optimizer, mesh, specs, trainable=trainable)
    for i in range(2):
        state, metrics = step(state, {"ids": ids(i, n=8)})
    assert np.isfinite(float(metrics["loss"]))

    merged = models.merge_lora(state.model)
    assert type(merged.model.layers.self_attn.q_proj) is models._layers.Linear
    models.save_pretrained(merged, tmp_path / "merged")

    redeqx.save_checkpoint(tmp_path / "ckpt", state)
    restored = redeqx.restore_checkpoint(tmp_path / "ckpt", eqx.filter_eval_shape(lambda: state), mesh, specs)
    for a, b in zip(jax.tree.leaves(restored.model), jax.tree.leaves(state.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def scan_unrolls(fn, *args) -> list:
    """The ``unroll`` of every ``lax.scan`` in ``fn``'s program, "all" where it
    unrolls every iteration (JAX writes that as the scan's length or more)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                unroll = eqn.params["unroll"]
                found.append("all" if unroll is True or unroll >= eqn.params["length"] else unroll)
            for value in eqn.params.values():
                for v in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(v, jax.extend.core.ClosedJaxpr):
                        walk(v.jaxpr)
                    elif isinstance(v, jax.extend.core.Jaxpr):
                        walk(v)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_scan_unroll_compiles_the_stack_differently_and_computes_the_same(family, monkeypatch):
    """scan_unroll is the stack's lax.scan unroll (None: SCAN_UNROLL's choice
    for the platform, a loop on CPU); the logits (and LLaMA's gradients) do
    not change."""
    cls, config = CONFIGS[family]
    x = ids()
    grads = lambda m: eqx.filter_grad(lambda m: forward(m, family, x).astype(jnp.float32).std())(m)  # noqa: E731
    expected = None
    # BART's decoder has 2 layers: unroll=2 unrolls it whole, so 2 is tried on its 3-layer encoder alone
    for unroll, platform_choice, seen in ((None, None, {1}), (2, None, {2, "all"}), (True, None, {"all"}),
                                          (None, True, {"all"})):
        if platform_choice is not None:
            monkeypatch.setitem(models._layers.SCAN_UNROLL, "cpu", platform_choice)
        model = cls(dataclasses.replace(config, scan_layers=True, scan_unroll=unroll), key=jax.random.key(0))
        unrolls = scan_unrolls(lambda m: forward(m, family, x), model)
        assert unrolls and set(unrolls) <= seen and (unroll != 2 or 2 in unrolls), (unroll, unrolls)
        got = forward(model, family, x), jax.tree.leaves(grads(model)) if family == "llama" else []
        if expected is None:
            expected = got
            continue
        np.testing.assert_allclose(got[0], expected[0], atol=2e-6, rtol=0)
        for a, b in zip(got[1], expected[1]):
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)


def test_a_prompts_pass_with_a_cache_loops_where_the_platform_unrolls(monkeypatch):
    """Where the platform unrolls the stack (a GPU: `SCAN_UNROLL`), a generation's prompt pass
    still loops: unrolled, each layer's products read their own offsets in the stack and XLA:GPU
    compiled 22 distinct GEMM kernels per weight of the 1B's prefill (its generation compiled in
    9.3 s against 3.8 as a loop, `_default_unroll`). The forward without a cache unrolls; a
    config's own scan_unroll is kept for both."""
    monkeypatch.setitem(models._layers.SCAN_UNROLL, "cpu", True)  # this CPU unrolls as a GPU does
    cls, config = CONFIGS["llama"]
    x = ids(n=1)[0]

    def prefill(model):
        return model.prefill(x, jnp.ones(x.shape, bool), 3)

    for unroll, train, prompt in ((None, {"all"}, {1}), (2, {2}, {2})):
        model = cls(dataclasses.replace(config, scan_layers=True, scan_unroll=unroll), key=jax.random.key(0))
        assert set(scan_unrolls(lambda m: forward(m, "llama", x[None]), model)) == train
        assert set(scan_unrolls(prefill, model)) == prompt


@pytest.mark.parametrize("bad", [0, -1, 1.5, "all"])
def test_a_bad_scan_unroll_is_refused_with_the_choices(bad):
    for cls, config in CONFIGS.values():
        with pytest.raises(ValueError, match=rf"{type(config).__name__}\.scan_unroll={bad!r}.*None.*True.*positive int"):
            dataclasses.replace(config, scan_unroll=bad)


@pytest.mark.slow
def test_from_pretrained_and_a_train_step_take_scan_unroll(tmp_path):
    """from_pretrained sets the loaded config's scan_unroll; a train step
    under redeqx.remat keeps the user's unroll on the stack's scan and
    computes what the loop computes."""
    mesh = redeqx.make_mesh(2)
    models.save_pretrained(build("llama", True), tmp_path / "llama")
    batch = {"ids": ids(3, n=8)}
    losses = {}
    for unroll in (None, True):
        model = models.from_pretrained(tmp_path / "llama", mesh, scan_layers=True, scan_unroll=unroll)
        assert model.config.scan_unroll == unroll
        assert scan_unrolls(lambda m: redeqx.remat(lm_loss)(m, batch, None), model) == [1 if unroll is None else "all"]
        specs, state = sharded_state(model, optax.sgd(0.1), mesh, key=0)
        step = redeqx.make_train_step(redeqx.remat(lm_loss), optax.sgd(0.1), mesh, specs)
        for i in range(2):
            state, metrics = step(state, {"ids": ids(i, n=8)})
        losses[unroll] = float(metrics["loss"])
    np.testing.assert_allclose(losses[True], losses[None], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_stack_is_indexed_like_a_layer_list_and_a_changed_layer_goes_back(family):
    """Before: ``model.model.layers[0]`` on a stacked model (the default) was
    ``TypeError: 'LlamaDecoderLayer' object is not subscriptable``."""
    listed, stacked = build(family, False), build(family, True)
    stacks = type(stacked).hf_stacks

    def get(model, dotted):
        for part in dotted.split("."):
            model = getattr(model, part)
        return model

    for name in stacks:
        stack, layers = get(stacked, name), get(listed, name)
        if family == "t5":  # listed, block 0 holds the bias table that a stack keeps beside it
            layers = layers[1:]
            pairs = [(stack[i + 1], layer) for i, layer in enumerate(layers)]
        else:
            pairs = [(stack[i], layer) for i, layer in enumerate(layers)] + [(stack[-1], layers[-1])]
        for got, want in pairs:
            assert type(got) is type(want)
            for a, b in zip(jax.tree.leaves(eqx.filter(got, eqx.is_array)), jax.tree.leaves(eqx.filter(want, eqx.is_array)),
                            strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        with pytest.raises(IndexError, match=r"use 0 to \d"):
            stack[len(layers) + 5]
        with pytest.raises(TypeError, match="is one layer, not a stack"):
            stack[0][0]
    # a changed layer put back: the model then computes what the listed model with that layer changed does
    name = stacks[0]
    first = get(stacked, name)[1]
    scaled = lambda layer: jax.tree.map(lambda a: a * 1.5 if eqx.is_array(a) else a, layer)  # noqa: E731
    new_stacked = eqx.tree_at(lambda m: get(m, name), stacked, get(stacked, name).with_layer(1, scaled(first)))
    new_listed = eqx.tree_at(lambda m: get(m, name)[1], listed, scaled(get(listed, name)[1]))
    x, logits = ids(), jitted_forward(family)  # the two stacked models: one compile
    np.testing.assert_allclose(logits(new_stacked, x), logits(new_listed, x), atol=5e-5, rtol=1e-5)
    assert not np.array_equal(logits(new_stacked, x), logits(stacked, x))
