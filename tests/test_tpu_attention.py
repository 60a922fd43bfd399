"""The TPU's attention kernel (Pallas splash attention, `redeqx.context._tpu`), run here in Pallas's
interpreter: where `redeqx.attention`, its heads split and the zoo's causal attention would form a
sequence's (T, T) scores on a TPU, the kernel gives one device's exact values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import redeqx
from redeqx import models
from redeqx.context import _tpu
from test_context import _mesh, _naive_loss


@pytest.fixture
def tpu_kernel(monkeypatch):
    monkeypatch.setattr(_tpu, "INTERPRET", True)


def _one_device():
    return jax.set_mesh(redeqx.make_mesh(1, devices=jax.devices()[:1]))


def _case(t=256, hq=4, hkv=2, d=64, padding=37):
    ks = jax.random.split(jax.random.key(0), 4)
    q, w = (jax.random.normal(k, (1, t, hq, d)) for k in (ks[0], ks[3]))
    k, v = (jax.random.normal(k, (1, t, hkv, d)) for k in ks[1:3])
    seg = jnp.asarray(np.r_[np.zeros(padding), np.ones(t - padding)].astype(np.int32))[None]
    return q, k, v, seg, w


@pytest.mark.parametrize("causal, window, segments", [(True, None, False), (True, 40, False), (False, None, True),
                                                      (True, 40, True)])
def test_the_kernel_gives_the_exact_scores_values_and_gradients(tpu_kernel, causal, window, segments):
    """A window over segments is not the kernel's: its window counts places, where the window counts a
    segment's tokens (padding inside a sequence takes no place in it); the exact scores serve it."""
    q, k, v, seg, w = _case()
    if window is not None and segments:
        seg = seg.at[:, 100:120].set(0)  # padding inside too
    kw = dict(causal=causal, window=window, segment_ids=seg if segments else None)
    with _one_device():
        got = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(redeqx.attention(q, k, v, **kw) * w),
                                         argnums=(0, 1, 2)))(q, k, v)
        program = str(jax.make_jaxpr(lambda q: redeqx.attention(q, k, v, **kw))(q))
    seg = seg if segments else jnp.zeros_like(seg)
    want = jax.jit(jax.value_and_grad(lambda q, k, v: _naive_loss(q, k, v, seg, w, causal, window),
                                      argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert ("pallas_call" in program) == (window is None or not segments)


def test_the_heads_split_runs_the_kernel_on_its_heads(tpu_kernel):
    q, k, v, seg, w = _case(t=512, hq=8, hkv=2)
    order = redeqx.context_order(512, 4)
    mesh = _mesh(1, 4, 1)  # context alone: nothing left to the partitioner, which cannot split the kernel

    def loss(q, k, v, w, seg):  # segments: 37 padding tokens that see only each other
        return jnp.sum(redeqx.attention(q, k, v, segment_ids=seg, impl="heads") * w)

    split = [jax.device_put(x[:, order], NamedSharding(mesh, P(None, "context"))) for x in (q, k, v, w, seg)]
    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        got, grads = step(*split)
        assert "pallas_call" in str(jax.make_jaxpr(step)(*split))
    want, want_grads = jax.value_and_grad(lambda q, k, v: _naive_loss(q, k, v, seg, w, True), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for g, ref in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(g)[:, np.argsort(order)], ref, atol=1e-4)


def test_the_zoo_attends_causally_with_the_kernel(tpu_kernel, monkeypatch):
    config = models.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    model = models.LlamaForCausalLM(config, key=jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (128,), 0, 64)
    with _one_device():
        got = jax.jit(lambda ids: model(ids))(ids)
        assert "pallas_call" in str(jax.make_jaxpr(lambda ids: model(ids))(ids))
    monkeypatch.setattr(_tpu, "INTERPRET", False)
    np.testing.assert_allclose(got, jax.jit(lambda ids: model(ids))(ids), atol=1e-4)


def test_the_kernel_is_left_out_where_the_partitioner_would_have_to_split_it(tpu_kernel):
    """libtpu: "Mosaic kernels cannot be automatically partitioned". Inside the heads split's
    shard_map on a mesh with data 2 the data axis is still the partitioner's: blockwise there."""
    q, k, v, _, _ = _case(t=512, hq=8, hkv=2)
    order = redeqx.context_order(512, 4)
    mesh = _mesh(2, 4, 1)
    split = [jax.device_put(jnp.concatenate([x, x])[:, order], NamedSharding(mesh, P("data", "context")))
             for x in (q, k, v)]
    with jax.set_mesh(mesh):
        program = str(jax.make_jaxpr(lambda q, k, v: redeqx.attention(q, k, v, impl="heads"))(*split))
        plain = str(jax.make_jaxpr(lambda q, k, v: redeqx.attention(q, k, v))(*split))
    assert "all_to_all" in program and "pallas_call" not in program and "pallas_call" not in plain


@pytest.mark.slow
def test_a_stacked_remat_step_trains_with_the_kernel_as_without(monkeypatch):
    """The zoo's stacked layers under `redeqx.remat` (scan residuals kept by kind) with the kernel's
    own backward: three steps' losses and the weights equal the exact path's."""
    import equinox as eqx
    import optax

    config = models.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)

    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["input_ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    mesh = redeqx.make_mesh(1, devices=jax.devices()[:1])
    ids = np.random.default_rng(0).integers(0, 64, (2, 129))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    runs = []
    for interpret in (False, True):
        monkeypatch.setattr(_tpu, "INTERPRET", interpret)
        model = models.LlamaForCausalLM(config, key=jax.random.key(0))
        specs = redeqx.sharding_rules(model, mesh)
        state = redeqx.init_state(model, optax.sgd(0.1), mesh, specs, key=jax.random.key(1))
        step = redeqx.make_train_step(redeqx.remat(loss_fn), optax.sgd(0.1), mesh, specs)
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs.append((losses, [x for x in jax.tree.leaves(state.model) if eqx.is_inexact_array(x)]))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-6)
    for a, b in zip(runs[1][1], runs[0][1]):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_the_zoo_picks_cudnn_by_the_mesh_it_traces_under(monkeypatch):
    """A step traced under a mesh of GPUs this machine lacks (a plan, an ahead-of-time compile)
    attends with cuDNN's flash attention, as on the GPU; the choice read JAX's default devices
    before, so such a plan counted the (T, T) scores the GPU never forms."""
    from jax._src.mesh import AbstractDevice, AbstractMesh

    from redeqx.models._layers import CausalMask, attention

    calls = []

    def spy(q, k, v, **kw):  # cuDNN's kernel, asked for by name (CPUs have none to run)
        calls.append(kw.get("implementation"))
        return q

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    q = jnp.zeros((16, 4, 64), jnp.bfloat16)
    gpu = AbstractMesh((1,), ("data",), abstract_device=AbstractDevice("NVIDIA H100 80GB HBM3", None, "gpu"))
    attention(q, q, q, CausalMask(16), scale=0.125)
    assert calls == []  # this machine's CPU
    with jax.sharding.use_abstract_mesh(gpu):
        attention(q, q, q, CausalMask(16), scale=0.125)
        assert calls == ["cudnn"]
        attention(q.astype(jnp.float32), q.astype(jnp.float32), q.astype(jnp.float32), CausalMask(16), scale=0.125)
        assert calls == ["cudnn"]  # float32: no kernel
