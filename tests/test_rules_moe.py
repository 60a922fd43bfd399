"""Mixture-of-experts layers, written the three ways users write them, get one
consistent plan: expert parallel (every expert stack split on its expert axis,
the router replicated) when n_model_shards divides the expert count, tensor
parallel on the experts' hidden units otherwise; never half of each (issue 23)."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from accelerator_count import accelerator_collectives
from tiny_transformer import collate_tokens, lm_loss, token_examples

VOCAB, DIM, HIDDEN = 32, 16, 20


def top_k_gates(logits, k):  # (T, E) -> (T, E): softmax over each token's k best experts, 0 elsewhere
    best, idx = jax.lax.top_k(logits, k)
    return jnp.einsum("tk,tke->te", jax.nn.softmax(best, axis=-1), jax.nn.one_hot(idx, logits.shape[-1]))


class MoE(eqx.Module):
    """(a) stacks ``w_in (E, F, D)`` / ``w_out (E, D, F)`` and a router ``(E, D)``, all bare arrays."""

    router: jax.Array
    w_in: jax.Array
    w_out: jax.Array

    def __init__(self, n_experts, *, key):
        k = jax.random.split(key, 3)
        self.router = jax.random.normal(k[0], (n_experts, DIM)) / DIM**0.5
        self.w_in = jax.random.normal(k[1], (n_experts, HIDDEN, DIM)) / DIM**0.5
        self.w_out = jax.random.normal(k[2], (n_experts, DIM, HIDDEN)) / HIDDEN**0.5

    def __call__(self, x):  # (T, D): every expert on every token, weighted by a softmax router
        gates = jax.nn.softmax(x @ self.router.T, axis=-1)  # (T, E)
        h = jax.nn.gelu(jnp.einsum("td,efd->tef", x, self.w_in))
        return jnp.einsum("tef,edf,te->td", h, self.w_out, gates)


class SparseMoeBlock(eqx.Module):
    """(b) Mixtral's names: a ``gate`` Linear ``(E, D)`` and SwiGLU stacks ``w1``/``w3`` ``(E, F, D)``, ``w2`` ``(E, D, F)``."""

    gate: eqx.nn.Linear
    w1: jax.Array
    w2: jax.Array
    w3: jax.Array

    def __init__(self, n_experts, *, key):
        k = jax.random.split(key, 4)
        self.gate = eqx.nn.Linear(DIM, n_experts, use_bias=False, key=k[0])
        self.w1 = jax.random.normal(k[1], (n_experts, HIDDEN, DIM)) / DIM**0.5
        self.w2 = jax.random.normal(k[2], (n_experts, DIM, HIDDEN)) / HIDDEN**0.5
        self.w3 = jax.random.normal(k[3], (n_experts, HIDDEN, DIM)) / DIM**0.5

    def __call__(self, x):  # (T, D): top-2 routing
        gates = top_k_gates(jax.vmap(self.gate)(x), 2)
        h = jax.nn.silu(jnp.einsum("td,efd->tef", x, self.w1)) * jnp.einsum("td,efd->tef", x, self.w3)
        return jnp.einsum("tef,edf,te->td", h, self.w2, gates)


class MLPExperts(eqx.Module):
    """(c) a list of ``eqx.nn.MLP`` experts and a router ``Linear``."""

    router: eqx.nn.Linear
    experts: list

    def __init__(self, n_experts, *, key):
        kr, ke = jax.random.split(key)
        self.router = eqx.nn.Linear(DIM, n_experts, key=kr)
        self.experts = [eqx.nn.MLP(DIM, DIM, HIDDEN, depth=1, activation=jax.nn.gelu, key=k)
                        for k in jax.random.split(ke, n_experts)]

    def __call__(self, x):  # (T, D)
        gates = jax.nn.softmax(jax.vmap(self.router)(x), axis=-1)  # (T, E)
        ys = jnp.stack([jax.vmap(e)(x) for e in self.experts], axis=1)  # (T, E, D)
        return jnp.einsum("ted,te->td", ys, gates)


class MoELM(eqx.Module):
    embed: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm
    moe: eqx.Module
    lm_head: eqx.nn.Linear

    def __init__(self, layer, n_experts, *, key):
        k = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k[0])
        self.norm = eqx.nn.LayerNorm(DIM)
        self.moe = layer(n_experts, key=k[1])
        self.lm_head = eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=k[2])

    def __call__(self, tokens):  # (T,) -> (T, V)
        x = jax.vmap(self.embed)(tokens)
        x = x + self.moe(jax.vmap(self.norm)(x))
        return jax.vmap(self.lm_head)(x)


def step_on(model, mesh, specs):
    optimizer = optax.adam(1e-2)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(lm_loss, optimizer, mesh, specs)
    batch = next(redeqx.batches(token_examples(16, seq_len=8, vocab=VOCAB), collate_tokens,
                                16 // mesh.shape["data"], mesh))
    return step, state, batch


def train(model, n_model_shards, devices, n_steps=2):
    mesh = redeqx.make_mesh(n_model_shards, devices=devices)
    step, state, batch = step_on(model, mesh, redeqx.sharding_rules(model, mesh))
    losses = []
    for _ in range(n_steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.asarray(losses), state.model


def test_expert_parallel_when_the_experts_divide():
    """6 experts over 2 shards: every stack split on E, the router whole; no name
    (``w_in``'s "in", ``gate``, ``w1``/``w2``) decides a dim of its own."""
    mesh = redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(MoE(6, key=jax.random.key(0)), mesh)
    assert specs.w_in == specs.w_out == P("model", None, None) and specs.router == P()
    specs = redeqx.sharding_rules(SparseMoeBlock(6, key=jax.random.key(0)), mesh)
    assert specs.w1 == specs.w2 == specs.w3 == P("model", None, None) and specs.gate.weight == P()
    moe = MoE(6, key=jax.random.key(0))
    table = redeqx.explain(moe, redeqx.sharding_rules(moe, mesh), mesh, reasons="full")
    rows = {r.split()[0]: r for r in table.splitlines() if r}
    assert rows["w_in"].endswith("expert stack: dim 0, experts 6 -> 3 per device (expert parallel)")
    assert rows["router"].endswith("MoE router: replicated (every device routes every token)")


def test_tensor_parallel_when_they_do_not():
    """6 experts over 4 shards: the hidden units F split on every stack alike
    (dim 1 of the up stacks, dim 2 of the down stack), the router whole."""
    mesh = redeqx.make_mesh(4)
    specs = redeqx.sharding_rules(MoE(6, key=jax.random.key(0)), mesh)
    assert specs.w_in == P(None, "model", None) and specs.w_out == P(None, None, "model") and specs.router == P()
    specs = redeqx.sharding_rules(SparseMoeBlock(6, key=jax.random.key(0)), mesh)
    assert specs.w1 == specs.w3 == P(None, "model", None) and specs.w2 == P(None, None, "model")
    assert specs.gate.weight == P()
    # F = 20 does not divide by 8 either: every stack replicated, in one warning; never half of each
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        block = SparseMoeBlock(6, key=jax.random.key(0))
        specs = redeqx.sharding_rules(block, redeqx.make_mesh(8))
    assert specs.w1 == specs.w2 == specs.w3 == P() and len(log) == 1
    assert all(f"{w} (6, " in str(log[0].message) for w in ("w1", "w2", "w3"))
    table = redeqx.explain(block, specs, redeqx.make_mesh(8), reasons="full")
    row = [r for r in table.splitlines() if r.startswith("w2")][0]
    assert row.endswith("expert stack, tensor parallel: 6 experts not divisible by n_model_shards=8: dim 2: "
                        "replicated, dim 2 (20) not divisible by n_model_shards=8")


@pytest.mark.parametrize("layer", [MoE, SparseMoeBlock])
def test_the_program_falls_back_to_the_hidden_units_too(layer):
    """Read from the program, 6 experts over 4 shards split each expert's hidden units, as the names
    do, and over 2 shards the experts. The program once seeded each stack's split on its first output
    dim (the experts) alone and, 4 not dividing 6, kept the up stacks whole and split the down stack's
    output features: 2.3x the hand plan's collective bytes a step (107,428 against 46,872 for `MoE`;
    27,920 now, the head and table kept whole as cheaper)."""
    model = MoELM(layer, 6, key=jax.random.key(0))
    up, down = ("w_in", "w_out") if layer is MoE else ("w1", "w2")
    for n, want_up, want_down in [(4, P(None, "model", None), P(None, None, "model")),
                                  (2, P("model", None, None), P("model", None, None))]:
        mesh = redeqx.make_mesh(n)
        batch = next(redeqx.batches(token_examples(16, seq_len=8, vocab=VOCAB), collate_tokens, 16 // mesh.shape["data"],
                                    mesh))
        specs = redeqx.sharding_rules(model, mesh, loss_fn=lm_loss, batch=batch)
        assert (getattr(specs.moe, up), getattr(specs.moe, down)) == (want_up, want_down), n


class RaggedMoE(MoE):
    """(a)'s stacks routed top-2 by sorting the tokens' assignments and `jax.lax.ragged_dot` (grouped
    matmuls, which take each expert's matrix as ``(in, out)``), over the batch's tokens at once."""

    def __call__(self, x):  # (N, D)
        gates, idx = jax.lax.top_k(x @ self.router.T, 2)
        order = jnp.argsort(idx.reshape(-1))
        sizes = jnp.bincount(idx.reshape(-1), length=self.router.shape[0]).astype(jnp.int32)
        h = jax.nn.gelu(jax.lax.ragged_dot(jnp.repeat(x, 2, axis=0)[order], self.w_in.transpose(0, 2, 1), sizes))
        ys = jax.lax.ragged_dot(h, self.w_out.transpose(0, 2, 1), sizes)
        y = jnp.zeros_like(ys).at[order].set(ys).reshape(x.shape[0], 2, -1)
        return jnp.einsum("tkd,tk->td", y, jax.nn.softmax(gates, -1))


def ragged_loss(model, batch, key):
    tokens = batch["tokens"]
    x = jax.vmap(model.embed)(tokens[:, :-1].reshape(-1))
    logits = jax.vmap(model.lm_head)(x + model.moe(jax.vmap(model.norm)(x)))
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:].reshape(-1)).mean()


def test_the_program_reads_grouped_matmuls_as_megatron_within_each_expert():
    """`jax.lax.ragged_dot`'s expert stacks split on each expert's hidden units (column, then row):
    the partitioner cannot split a grouped matmul over its experts, so expert parallelism, which
    the names chose for want of a reading, all-gathered the stacks each step: 561,476 collective
    bytes at 2 shards against 290,092 split on the hidden units (a 64-wide model, 8 experts)."""
    model = MoELM(RaggedMoE, 8, key=jax.random.key(0))
    mesh = redeqx.make_mesh(2)
    batch = next(redeqx.batches(token_examples(16, seq_len=8, vocab=VOCAB), collate_tokens, 8, mesh))
    specs = redeqx.sharding_rules(model, mesh, loss_fn=ragged_loss, batch=batch)
    assert specs.moe.w_in == P(None, "model", None) and specs.moe.w_out == P(None, None, "model")
    assert specs.moe.router == P()


def test_a_list_of_expert_mlps_keeps_each_expert_tensor_parallel():
    """One module per expert cannot be split over experts (a spec places a whole
    array); each expert alternates like any MLP, and the router stays whole."""
    specs = redeqx.sharding_rules(MLPExperts(4, key=jax.random.key(0)), redeqx.make_mesh(2))
    assert specs.router.weight == P() and specs.router.bias == P()
    for expert in specs.experts:
        assert expert.layers[0].weight == P("model", None) and expert.layers[1].weight == P(None, "model")


class Expert(eqx.Module):  # an expert with a SwiGLU 'gate' of its own: not a router
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, *, key):
        k = jax.random.split(key, 3)
        self.gate, self.up = (eqx.nn.Linear(DIM, HIDDEN, key=kk) for kk in k[:2])
        self.down = eqx.nn.Linear(HIDDEN, DIM, key=k[2])


class SwiGLUExperts(eqx.Module):
    router: eqx.nn.Linear
    experts: list

    def __init__(self, *, key):
        kr, ke = jax.random.split(key)
        self.router = eqx.nn.Linear(DIM, 2, key=kr)
        self.experts = [Expert(key=k) for k in jax.random.split(ke, 2)]


class FeedForward(eqx.Module):  # no 'moe' in any name: a router and stacks of a higher rank say it
    gate: jax.Array
    w1: jax.Array
    w2: jax.Array

    def __init__(self, *, key):
        self.gate = jnp.zeros((4, DIM))
        self.w1, self.w2 = jnp.zeros((4, HIDDEN, DIM)), jnp.zeros((4, DIM, HIDDEN))


def test_routers_are_told_from_gates():
    mesh = redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(SwiGLUExperts(key=jax.random.key(0)), mesh)
    assert specs.router.weight == P()
    for expert in specs.experts:  # each expert's own gate is a SwiGLU gate, column parallel
        assert expert.gate.weight == expert.up.weight == P("model", None) and expert.down.weight == P(None, "model")
    specs = redeqx.sharding_rules(FeedForward(key=jax.random.key(0)), mesh)
    assert specs.gate == P() and specs.w1 == specs.w2 == P("model", None, None)


@pytest.mark.slow
@pytest.mark.parametrize("layer", [MoE, SparseMoeBlock, MLPExperts])
def test_every_layout_trains_as_one_device(layer, devices):
    """Expert parallel at 2 shards, tensor parallel at 4 (6 experts), for the
    three ways of writing the layer: the same losses and parameters as one device."""
    model = MoELM(layer, 6, key=jax.random.key(0))
    ref_losses, ref_model = train(model, 1, devices[:1])
    for n in (2, 4):
        losses, trained = train(model, n, devices)
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, err_msg=f"at n_model_shards={n}")
        for a, b in zip(jax.tree.leaves(eqx.filter(trained, eqx.is_array)),
                        jax.tree.leaves(eqx.filter(ref_model, eqx.is_array))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def collective_bytes(model, mesh, specs):
    step, state, batch = step_on(model, mesh, specs)
    return sum(v["bytes"] for v in accelerator_collectives(step, state, batch).values())


def test_collectives_match_a_hand_placed_plan():
    """The rules' plan moves no more than the same model placed by hand (expert
    parallel at 2 shards, tensor parallel at 4), as an accelerator moves them."""
    model = MoELM(SparseMoeBlock, 6, key=jax.random.key(0))
    head = [(r"embed\.", P("model", None)), (r"lm_head\.", P("model", None)), (r"gate\.", P())]
    for n, stacks in [(2, [(r"moe\.w[123]", P("model", None, None))]),
                      (4, [(r"moe\.w[13]", P(None, "model", None)), (r"moe\.w2", P(None, None, "model"))])]:
        mesh = redeqx.make_mesh(n)
        rules = redeqx.sharding_rules(model, mesh)
        by_hand = redeqx.sharding_rules(model, mesh, overrides=head + stacks)
        assert jax.tree.leaves(rules) == jax.tree.leaves(by_hand)
        assert collective_bytes(model, mesh, rules) <= collective_bytes(model, mesh, by_hand)


class GatedAfter(MoE):
    """(a) with a bias on the hidden units, the gates applied in an einsum of their own: the up
    stack's product yields the expert axis, which the down stack takes as a batch dim and the
    gates then sum."""

    b_in: jax.Array

    def __init__(self, n_experts, *, key):
        super().__init__(n_experts, key=key)
        self.b_in = jnp.zeros((n_experts, HIDDEN))

    def __call__(self, x):
        gates = jax.nn.softmax(x @ self.router.T, axis=-1)  # (T, E)
        h = jax.nn.gelu(jnp.einsum("td,efd->tef", x, self.w_in) + self.b_in[None])
        return jnp.einsum("ted,te->td", jnp.einsum("tef,edf->ted", h, self.w_out), gates)


def test_the_program_splits_a_dense_mixture_over_its_experts():
    """Read from the program, the up stack (and its bias) is split over the experts like the down
    stack it feeds. It was kept whole (its output's expert axis is summed against the gates, an
    activation): 51,800 collective bytes a step at 2 shards and 50,872 at 4, against 21,080 and
    20,152 split (2.5x)."""
    model = MoELM(GatedAfter, 8, key=jax.random.key(0))
    mesh = redeqx.make_mesh(2)
    batch = next(redeqx.batches(token_examples(16, seq_len=8, vocab=VOCAB), collate_tokens, 8, mesh))
    read = redeqx.sharding_rules(model, mesh, loss_fn=lm_loss, batch=batch)
    assert read.moe.w_in == read.moe.w_out == P("model", None, None) and read.moe.b_in == P("model", None)
    assert read.moe.router == P()
    by_hand = redeqx.sharding_rules(model, mesh, loss_fn=lm_loss, batch=batch,
                                    overrides=[(r"moe\.(w_in|w_out)", P("model", None, None)),
                                               (r"moe\.b_in", P("model", None))])
    assert jax.tree.leaves(read) == jax.tree.leaves(by_hand)
    table = redeqx.explain(model, read, mesh, loss_fn=lm_loss, batch=batch, reasons="full")
    assert "its product yields the expert axis that moe.w_out takes as a batch dim): 8 experts -> 4" in table


class MoEBlock(eqx.Module):
    """A transformer-ish block holding experts: a projection, a router Linear and expert stacks."""

    proj: eqx.nn.Linear
    router: eqx.nn.Linear
    w_in: jax.Array
    w_out: jax.Array

    def __init__(self, n_experts, *, key):
        k = jax.random.split(key, 4)
        self.proj = eqx.nn.Linear(DIM, DIM, key=k[0])
        self.router = eqx.nn.Linear(DIM, n_experts, key=k[1])
        self.w_in = jax.random.normal(k[2], (n_experts, HIDDEN, DIM)) / DIM**0.5
        self.w_out = jax.random.normal(k[3], (n_experts, DIM, HIDDEN)) / HIDDEN**0.5

    def __call__(self, x):
        x = x + jax.vmap(self.proj)(x)
        gates = jax.nn.softmax(jax.vmap(self.router)(x), axis=-1)
        h = jax.nn.gelu(jnp.einsum("td,efd->tef", x, self.w_in))
        return x + jnp.einsum("tef,edf,te->td", h, self.w_out, gates)


class VmappedExperts(eqx.Module):
    """Experts as one ``eqx.nn.Linear`` pair built by ``eqx.filter_vmap`` (an (E, ...) axis on each), a 2-D gate."""

    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, n_experts, *, key):
        k = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(DIM, n_experts, use_bias=False, key=k[0])
        keys = jax.random.split(k[1], n_experts)
        self.up = eqx.filter_vmap(lambda kk: eqx.nn.Linear(DIM, HIDDEN, key=kk))(keys)
        self.down = eqx.filter_vmap(lambda kk: eqx.nn.Linear(HIDDEN, DIM, key=kk))(jax.random.split(k[2], n_experts))

    def __call__(self, x):
        gates = jax.nn.softmax(jax.vmap(self.gate)(x), axis=-1)
        h = jax.nn.gelu(jnp.einsum("td,efd->tef", x, self.up.weight) + self.up.bias)
        return jnp.einsum("tef,edf,te->td", h, self.down.weight, gates) + jnp.einsum("ed,te->td", self.down.bias, gates)


class StackedMoELM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: MoEBlock
    lm_head: eqx.nn.Linear

    def __init__(self, n_experts, layers=3, *, key):
        k = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k[0])
        self.blocks = eqx.filter_vmap(lambda kk: MoEBlock(n_experts, key=kk))(jax.random.split(k[1], layers))
        self.lm_head = eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=k[2])

    def __call__(self, tokens):
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        x, _ = jax.lax.scan(lambda x, b: (eqx.combine(b, static)(x), None), jax.vmap(self.embed)(tokens), arrays)
        return jax.vmap(self.lm_head)(x)


def test_a_stack_of_moe_blocks_peels_the_layer_axis_from_every_leaf(devices):
    """A stack of blocks that hold experts: the layer axis (3) is not an expert
    axis for the block's other layers or its router (it was taken for one: the
    projection and router split as "3 experts not divisible"), while the
    expert stacks behind it get expert parallelism; the same training as one device."""
    model = StackedMoELM(4, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, redeqx.make_mesh(2))
    assert specs.blocks.router.weight == P()
    assert specs.blocks.proj.weight in (P(None, "model", None), P(None, None, "model"))
    assert specs.blocks.w_in == specs.blocks.w_out == P(None, "model", None, None)
    explained = redeqx.explain(model, specs, redeqx.make_mesh(2), reasons="full")
    assert "3 experts" not in explained and "layer axis (L=3)" in explained
    ref_losses, ref_model = train(model, 1, devices[:1])
    losses, trained = train(model, 2, devices)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    # experts built with eqx.filter_vmap beside an unstacked gate keep their leading axis as the experts'
    specs = redeqx.sharding_rules(VmappedExperts(4, key=jax.random.key(0)), redeqx.make_mesh(2))
    assert specs.gate.weight == P() and specs.up.weight == specs.down.weight == P("model", None, None)


class QwenMoeAttention(eqx.Module):  # a family's name on its attention: "Moe" here says nothing of experts
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear

    def __init__(self, *, key):
        self.q_proj, self.k_proj, self.o_proj = (eqx.nn.Linear(DIM, DIM, use_bias=False, key=kk)
                                                 for kk in jax.random.split(key, 3))


class QwenMoeBlock(eqx.Module):
    self_attn: QwenMoeAttention
    mlp: MoEBlock

    def __init__(self, *, key):
        k = jax.random.split(key)
        self.self_attn, self.mlp = QwenMoeAttention(key=k[0]), MoEBlock(4, key=k[1])


def test_a_family_named_moe_keeps_its_stacked_attention_megatron():
    """Stacked over 3 layers, attention projections have the rank of an expert stack; a class
    named ``...MoeAttention`` must not make them one (k_proj was split on its input features)."""
    blocks = eqx.filter_vmap(lambda kk: QwenMoeBlock(key=kk))(jax.random.split(jax.random.key(0), 3))
    specs = redeqx.sharding_rules(blocks, redeqx.make_mesh(2))
    column, row = P(None, "model", None), P(None, None, "model")
    attention = specs.self_attn
    assert [attention.q_proj.weight, attention.k_proj.weight, attention.o_proj.weight] == [column, column, row]
    assert specs.mlp.w_in == specs.mlp.w_out == P(None, "model", None, None)
