"""The mixture-of-experts block (redeqx.models.MoE): dropless top-k routing by
grouped matmuls against a dense reference that runs every token through every
expert, its vmap (the batch routed as one run of tokens, no weight copied per
sequence), and its auxiliary losses against Transformers' load_balancing_loss_func."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from redeqx.models import MoE, RouterStats, mix_experts
from redeqx.models._moe import route, router_stats

H, I, E = 8, 12, 6


def dense(moe, x):
    """Every token through every expert, weighted by the top-k gates (zero elsewhere): E/k times the FLOPs."""
    logits = x @ moe.gate.weight.T
    w, i = route(logits, moe.k, normalize=moe.normalize_top_k)
    gates = jnp.einsum("tk,tke->te", w, jax.nn.one_hot(i, moe.n_experts))
    e = moe.experts
    h = jax.nn.silu(jnp.einsum("th,eih->tei", x, e.gate_proj)) * jnp.einsum("th,eih->tei", x, e.up_proj)
    return jnp.einsum("tei,ehi,te->th", h, e.down_proj, gates)


@pytest.mark.slow
@pytest.mark.parametrize("k,normalize", [(1, True), (2, False), (3, True)])
def test_routing_matches_every_expert_on_every_token(k, normalize):
    moe = MoE(H, I, E, k, normalize_top_k=normalize, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (3, 10, H))
    got = jax.jit(jax.vmap(lambda x: moe(x)[0]))(x)
    np.testing.assert_allclose(got, jax.jit(jax.vmap(lambda x: dense(moe, x)))(x), atol=1e-6, rtol=0)
    one = eqx.filter_jit(lambda f, m, x: f(m, x))  # one sequence, no vmap (jitted: eager compiles op by op)
    np.testing.assert_allclose(one(lambda m, x: m(x)[0], moe, x[1]), one(dense, moe, x[1]), atol=1e-6, rtol=0)

    def loss(f):
        return lambda m, x: jnp.sum(jax.vmap(lambda x: f(m, x))(x) ** 2)

    got = eqx.filter_jit(jax.grad(loss(lambda m, x: m(x)[0]), argnums=(0, 1)))(moe, x)
    want = eqx.filter_jit(jax.grad(loss(dense), argnums=(0, 1)))(moe, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_stacked_blocks_in_a_remat_scan_and_vmapped_weights():
    """Stacked blocks run by a lax.scan under jax.checkpoint (the zoo's stacks), and a vmap over
    models (weights batched: one batch entry at a time) give the dense values and gradients."""
    stack = eqx.filter_vmap(lambda k: MoE(H, I, E, 2, key=k))(jax.random.split(jax.random.key(3), 2))
    x = jax.random.normal(jax.random.key(4), (2, 7, H))

    def run(st, x, f):
        arrays, static = eqx.partition(st, eqx.is_array)
        body = jax.checkpoint(lambda x, a: (x + f(eqx.combine(a, static), x), None),
                              policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        return jax.lax.scan(body, x, arrays)[0]

    def loss(f):
        return lambda st, x: jnp.sum(jax.vmap(lambda x: run(st, x, f))(x) ** 2)

    got = eqx.filter_jit(eqx.filter_value_and_grad(loss(lambda m, x: m(x)[0])))(stack, x)
    want = eqx.filter_jit(eqx.filter_value_and_grad(loss(dense)))(stack, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    per_model = eqx.filter_jit(eqx.filter_vmap(lambda m, x: m(x)[0]))(stack, x)
    np.testing.assert_allclose(per_model, eqx.filter_jit(eqx.filter_vmap(dense))(stack, x), atol=1e-6, rtol=0)


def test_a_vmapped_batch_is_one_grouped_matmul_over_its_tokens():
    """Under vmap the rows of every sequence meet in one ragged_dot against the unbatched
    (E, out, in) stacks: B*T*k rows, no dot of every token with every expert, no weight broadcast."""
    moe = MoE(H, I, E, 2, key=jax.random.key(0))
    x = jnp.ones((3, 10, H))
    text = str(jax.make_jaxpr(jax.vmap(lambda x: moe(x)[0]))(x))
    assert text.count("ragged_dot_general[") == 3
    assert f"f32[60,{I}] = ragged_dot_general" in text and f"f32[60,{H}] = ragged_dot_general" in text
    assert f"f32[3,{E},{I},{H}]" not in text and f"f32[3,10,{E},{I}]" not in text


def test_mix_experts_token_by_token():
    kx, ki, kw, kg = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (5, H))
    idx = jax.random.randint(ki, (5, 2), 0, E)
    w = jax.random.uniform(kg, (5, 2))
    g, u, d = (jax.random.normal(k, s) for k, s in zip(jax.random.split(kw, 3), [(E, I, H), (E, I, H), (E, H, I)]))
    got = mix_experts(x, idx, w, g, u, d, activation="gelu")
    for t in range(5):
        want = sum(w[t, j] * (d[e] @ (jax.nn.gelu(g[e] @ x[t], approximate=False) * (u[e] @ x[t])))
                   for j, e in enumerate(np.asarray(idx[t])))
        np.testing.assert_allclose(got[t], want, atol=1e-4, rtol=1e-5)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="k=5 is more experts per token than n_experts=4"):
        MoE(H, I, 4, 5, key=jax.random.key(0))
    with pytest.raises(ValueError, match="MoE activation='swish'"):
        MoE(H, I, 4, 2, activation="swish", key=jax.random.key(0))
    with pytest.raises(ValueError, match="MoE n_experts must be a positive int"):
        MoE(H, I, 0, 1, key=jax.random.key(0))


def _hf_loss(logits, k, mask=None):
    torch = pytest.importorskip("torch")
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    gate_logits = tuple(torch.tensor(np.asarray(layer).reshape(-1, E)) for layer in logits)
    mask = None if mask is None else torch.tensor(np.asarray(mask))
    return float(mixtral.load_balancing_loss_func(gate_logits, E, k, mask))


@pytest.mark.parametrize("padded", [False, True])
def test_load_balancing_loss_matches_transformers(padded):
    """Per-sequence statistics (vmapped), summed over 3 layers, give Transformers' loss over the batch."""
    logits = jax.random.normal(jax.random.key(0), (3, 4, 9, E))  # (layers, batch, seq, E)
    mask = np.ones((4, 9), bool)
    if padded:
        mask[1, :3] = mask[3, 7:] = False

    def stats(layer):
        _, idx = jax.vmap(lambda z: route(z, 2, normalize=True))(layer)
        return jax.vmap(router_stats)(layer, idx, jnp.asarray(mask) if padded else None)

    total = sum((stats(layer) for layer in logits[1:]), stats(logits[0]))
    assert isinstance(total, RouterStats) and total.tokens_per_expert.shape == (4, E)
    want = _hf_loss(logits, 2, mask if padded else None)
    np.testing.assert_allclose(float(total.load_balancing_loss()), want, atol=1e-6, rtol=1e-6)
    valid = np.broadcast_to(mask, logits.shape[:3])
    z = np.square(np.asarray(jax.nn.logsumexp(logits, axis=-1)))[valid].mean()
    np.testing.assert_allclose(float(total.z_loss()), z, rtol=1e-5)


@pytest.mark.slow
def test_under_a_mesh_each_data_shard_routes_its_own_rows():
    """Traced under a mesh with data=4, model=2 (as redeqx's steps are), each data shard sorts
    only its own sequences' rows (B/4*T*k of them) and each device computes only its own 3 of the
    6 experts' groups; values and gradients stay those of one run."""
    import redeqx
    from jax.sharding import NamedSharding, PartitionSpec as P

    moe = MoE(H, I, E, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 5, H))

    def loss(m, x):
        return jnp.sum(jax.vmap(lambda x: m(x)[0])(x) ** 2)

    want = eqx.filter_jit(eqx.filter_value_and_grad(loss))(moe, x)  # one device
    mesh = redeqx.make_mesh(2)  # data=4, model=2: the experts split over model
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(moe, xs)
        text = str(jax.make_jaxpr(lambda x: jax.vmap(lambda x: moe(x)[0])(x))(xs))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert "shard_map" in text and f"f32[20,{I}] = ragged_dot_general" in text  # 2 sequences x 5 tokens x k=2
    assert f"f32[{E // 2},{I},{H}]" in text  # each device's own experts, inside the shard_map


def test_plan_counts_an_moe_by_its_routed_rows():
    """8 experts top-2 against the dense LLaMA of the same active size (intermediate 2 x the
    expert's), both planned on one CPU device: the MoE's train step within 1.3x of the dense
    one's FLOPs once each grouped matmul counts its rows (XLA:CPU's own figure, a masked product
    over every expert, is several times that, and the plan says so)."""
    import optax

    import redeqx
    from redeqx.models import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)

    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()

    def planned(make):
        return redeqx.plan(make, loss_fn, optax.sgd(0.1), {"ids": jax.ShapeDtypeStruct((4, 33), jnp.int32)},
                           redeqx.make_mesh(1, devices=jax.devices()[:1]), explore=False)

    moe = planned(lambda key: MixtralForCausalLM(MixtralConfig(
        intermediate_size=256, num_local_experts=8, num_experts_per_tok=2, **common), key=key))
    dense = planned(lambda key: LlamaForCausalLM(LlamaConfig(intermediate_size=512, **common), key=key))
    assert dense.note is None and "XLA:CPU lowers jax.lax.ragged_dot densely" in moe.note
    assert "by its rows" in str(moe)
    compiled = float(re.search(r"compiled figure ([0-9.e+]+)", moe.note).group(1))
    assert compiled > 3 * dense.flops
    assert dense.flops <= moe.flops <= 1.3 * dense.flops, (moe.flops / dense.flops)


def test_grouped_matmuls_are_counted_by_rows():
    """The counter behind the plan: forward, input and weight gradients of a grouped matmul, each
    2 x rows x in x out, whatever the number of groups."""
    from redeqx.planner._grouped_flops import overcount

    m, k, n, g = 64, 32, 16, 8

    def f(x, w, s):
        return jnp.sum(jax.lax.ragged_dot(x, w, s) ** 2)

    args = (jnp.ones((m, k)), jnp.ones((g, k, n)), jnp.full((g,), 8, jnp.int32))
    by_rows, extra = overcount(jax.jit(jax.value_and_grad(f, argnums=(0, 1))).trace(*args).jaxpr)
    assert by_rows == 3 * 2 * m * k * n
    assert extra >= (g - 1) * by_rows
