"""Muon on Equinox models (`redeqx.muon_dimensions`). ``optax.contrib.muon`` orthogonalises every
2-D array as Flax's ``(in, out)`` kernel and gives everything else to AdamW. On a stacked model
(redeqx's zoo stacks its layers by default) that put every layer's ``(layers, out, in)`` matrices
on AdamW and orthogonalised the ``(layers, features)`` norm scales, the embedding and the head;
on an Equinox ``(out, in)`` weight it swapped fan-in and fan-out in Muon's width scale. The dims
read from the program give each layer's matrix Muon, slice by slice, as a list of layers gets it."""

import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

import redeqx
from redeqx.models import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, cross_entropy

V, D, H, L = 32, 16, 64, 4


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(D)
        self.up, self.down = eqx.nn.Linear(D, H, key=k1), eqx.nn.Linear(H, D, key=k2)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Net(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block | list
    head: eqx.nn.Linear

    def __init__(self, key, stacked: bool):
        ke, kb, kh = jax.random.split(key, 3)
        keys = jax.random.split(kb, L)
        self.embed = eqx.nn.Embedding(V, D, key=ke)
        self.blocks = eqx.filter_vmap(Block)(keys) if stacked else [Block(k) for k in keys]
        self.head = eqx.nn.Linear(D, V, key=kh)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        if isinstance(self.blocks, list):
            for block in self.blocks:
                x = jax.vmap(block)(x)
        else:
            weights, static = eqx.partition(self.blocks, eqx.is_array)
            x, _ = jax.lax.scan(lambda x, w: (jax.vmap(eqx.combine(w, static))(x), None), x, weights)
        return jax.vmap(self.head)(x)


def loss_fn(model, batch, key):
    logits = jax.vmap(model)(batch["tokens"])
    return cross_entropy(logits[:, :-1], batch["tokens"][:, 1:])


BATCH = {"tokens": np.random.RandomState(0).randint(0, V, (8, 12)).astype(np.int32)}


def _muon(dims):
    return optax.contrib.muon(0.02, adam_learning_rate=1e-3, muon_weight_dimension_numbers=dims)


@functools.lru_cache(maxsize=None)
def _trained(stacked: bool, n_model_shards: int, rule: str, fsdp: bool = False):
    """The model after two Muon steps: ``rule`` "program" (muon_dimensions), "default" (optax's)."""
    model = Net(jax.random.key(0), stacked)
    mesh = (redeqx.make_mesh(n_model_shards) if n_model_shards > 1
            else redeqx.make_mesh(devices=jax.devices()[:1]))
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=BATCH, fsdp=fsdp)
    optimizer = _muon(redeqx.muon_dimensions(model, loss_fn, BATCH)) if rule == "program" else optax.contrib.muon(
        0.02, adam_learning_rate=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the default rule on a stacked model warns (tested below)
        state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    for _ in range(2):
        state, _ = step(state, BATCH)
    return jax.tree.map(np.asarray, eqx.filter(state.model, eqx.is_array))


def _layers(model):
    """Each layer's (up, down, norm scale), stacked or listed."""
    if isinstance(model.blocks, list):
        return [(b.up.weight, b.down.weight, b.norm.weight) for b in model.blocks]
    b = model.blocks
    return [(b.up.weight[i], b.down.weight[i], b.norm.weight[i]) for i in range(L)]


def test_the_program_gives_each_layer_its_matrix_and_everything_else_adamw():
    stacked = redeqx.muon_dimensions(Net(jax.random.key(0), True), loss_fn, BATCH)
    listed = redeqx.muon_dimensions(Net(jax.random.key(0), False), loss_fn, BATCH)
    assert stacked.matrices == (("blocks.up.weight", MuonDimensionNumbers((2,), (1,))),
                                ("blocks.down.weight", MuonDimensionNumbers((2,), (1,))))
    assert [d for _, d in listed.matrices] == [MuonDimensionNumbers((1,), (0,))] * (2 * L)
    tree = stacked(None)
    assert tree.embed.weight is None and tree.head.weight is None and tree.blocks.norm.weight is None
    assert tree.blocks.up.bias is None
    assert stacked.output_layers == ("head.weight",)
    assert "head.weight: AdamW, an output layer" in repr(stacked)
    with_head = redeqx.muon_dimensions(Net(jax.random.key(0), True), loss_fn, BATCH, output_layers=True)
    assert with_head(None).head.weight == MuonDimensionNumbers((1,), (0,))


def test_stacked_layers_get_muon_as_listed_ones_do_and_split_as_on_one_device():
    """Two Muon steps: each stacked layer equals its listed twin (Muon per slice, Equinox's
    ``(out, in)`` read as such); optax's default rule differs (the up projection's width scale
    swapped; the stack on AdamW); at data 4 x model 2 the weights are one device's."""
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(_layers(Net(jax.random.key(0), True))),
                                                      jax.tree.leaves(_layers(Net(jax.random.key(0), False)))))
    stacked, listed = _trained(True, 1, "program"), _trained(False, 1, "program")
    for s, li in zip(_layers(stacked), _layers(listed)):
        for a, b in zip(s, li):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    default = _trained(False, 1, "default")
    assert not np.allclose(_layers(default)[0][0], _layers(listed)[0][0], rtol=1e-3)
    split = _trained(True, 2, "program")
    for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(stacked)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_muons_momentum_of_a_stack_is_split_over_data_on_its_layer_axis():
    """Each data shard orthogonalises its own layers' slices (the values: the test above, at data 4
    x model 2); a stack whose layer axis does not divide by ``data`` keeps its weight's spec."""
    from optax.contrib import MuonState

    model = Net(jax.random.key(0), True)
    for n_model, spread in ((2, True), (1, False)):  # data 4 divides 4 layers; data 8 does not
        mesh = redeqx.make_mesh(n_model)
        specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=BATCH)
        state = redeqx.init_state(model, _muon(redeqx.muon_dimensions(model, loss_fn, BATCH)), mesh, specs,
                                  key=jax.random.key(1))
        muon = next(x for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, MuonState))
                    if isinstance(x, MuonState))
        up, down = muon.mu.blocks.up.weight.sharding.spec, muon.mu.blocks.down.weight.sharding.spec
        weight_up, weight_down = specs.blocks.up.weight, specs.blocks.down.weight
        if spread:
            assert (up, down) == (P("data", *weight_up[1:]), P("data", *weight_down[1:])), (up, down)
        else:
            assert (up, down) == (weight_up, weight_down)


def test_under_fsdp_the_momentum_moves_from_the_matrix_dim_to_the_layer_axis(monkeypatch):
    """fsdp splits each stacked matrix over ``data`` on a matrix dim; Muon's momentum mirrored that,
    and the partitioner gathered the matrices for every Newton-Schulz product (libtpu, the
    8-layer LLaMA at data 8: 2.9x AdamW's bytes, `benchmarks/muon.py`). The momentum now takes
    ``data`` on the layer axis instead; two steps at data 4 x model 2 give one device's weights."""
    from optax.contrib import MuonState

    monkeypatch.setattr("redeqx.sharding._specs.FSDP_MIN_SIZE", 1)  # this test's matrices are small
    model = Net(jax.random.key(0), True)
    # on a mesh with context shards fsdp splits over (data, context): the momentum takes both
    for mesh, group in ((redeqx.make_mesh(2), "data"), (redeqx.make_mesh(2, n_context_shards=2), ("data", "context"))):
        specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=BATCH, fsdp=True)
        assert group in tuple(specs.blocks.up.weight)[1:], specs.blocks.up.weight
        state = redeqx.init_state(model, _muon(redeqx.muon_dimensions(model, loss_fn, BATCH)), mesh, specs,
                                  key=jax.random.key(1))
        muon = next(x for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, MuonState))
                    if isinstance(x, MuonState))
        for mu, weight in ((muon.mu.blocks.up.weight, specs.blocks.up.weight),
                           (muon.mu.blocks.down.weight, specs.blocks.down.weight)):
            assert mu.sharding.spec == P(group, *(None if e == group else e for e in tuple(weight)[1:])), mu.sharding
    for a, b in zip(jax.tree.leaves(_trained(True, 2, "program", fsdp=True)),
                    jax.tree.leaves(_trained(True, 1, "program"))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_default_rule_on_stacked_layers_warns_with_the_fix():
    model = Net(jax.random.key(0), True)
    mesh = redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=BATCH)
    with pytest.warns(UserWarning, match=r"stacked vectors blocks\.norm\.weight.*redeqx\.muon_dimensions"):
        redeqx.init_state(model, optax.contrib.muon(0.02), mesh, specs, key=jax.random.key(1))
    abstract = eqx.filter_eval_shape(Net, jax.random.key(0), True)
    with pytest.warns(UserWarning, match="muon_dimensions"):  # plan's abstract state says so too
        redeqx.init_state(abstract, optax.contrib.muon(0.02), mesh, specs, key=jax.random.key(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        redeqx.init_state(model, _muon(redeqx.muon_dimensions(model, loss_fn, BATCH)), mesh, specs,
                          key=jax.random.key(1))
        redeqx.init_state(model, optax.adamw(1e-3), mesh, specs, key=jax.random.key(1))
        redeqx.init_state(Net(jax.random.key(0), False), optax.contrib.muon(0.02), mesh,
                          redeqx.sharding_rules(Net(jax.random.key(0), False), mesh), key=jax.random.key(1))


def test_zoo_models_convolutions_and_experts():
    """The zoo's stacked LLaMA and Mixtral (its experts' grouped matmuls run in a shard_map the
    rules do not split), a convolution and a raw einsum weight; frozen leaves (``trainable=``)."""
    ids = {"ids": np.random.RandomState(0).randint(0, 64, (2, 8)).astype(np.int32)}

    def lm_loss(model, batch, key):
        return cross_entropy(jax.vmap(model)(batch["ids"])[:, :-1], batch["ids"][:, 1:])

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    llama = redeqx.muon_dimensions(LlamaForCausalLM(LlamaConfig(**small), key=jax.random.key(0)), lm_loss, ids)
    assert [p.split(".")[-2] for p, _ in llama.matrices] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert {d for _, d in llama.matrices} == {MuonDimensionNumbers((2,), (1,))}
    mixtral = redeqx.muon_dimensions(
        MixtralForCausalLM(MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2), key=jax.random.key(0)),
        lm_loss, ids)
    experts = {p.split(".")[-1]: d for p, d in mixtral.matrices if ".experts." in p}
    assert experts == {k: MuonDimensionNumbers((3,), (2,)) for k in ("gate_proj", "up_proj", "down_proj")}
    assert "model.layers.block_sparse_moe.gate.weight" in mixtral.output_layers

    class ConvNet(eqx.Module):
        conv: eqx.nn.Conv2d
        mix: jax.Array

        def __call__(self, x):
            return jnp.einsum("chw,oc->ohw", jax.nn.relu(self.conv(x)), self.mix).mean()

    net = ConvNet(eqx.nn.Conv2d(3, 8, 3, key=jax.random.key(0)), jnp.ones((4, 8)))
    images = {"x": np.ones((2, 3, 6, 6), np.float32)}
    dims = redeqx.muon_dimensions(net, lambda m, b, k: jax.vmap(m)(b["x"]).mean(), images, output_layers=True)
    assert dims.matrices == (("conv.weight", MuonDimensionNumbers((1, 2, 3), (0,))),
                             ("mix", MuonDimensionNumbers((1,), (0,))))
    mesh = redeqx.make_mesh(1)
    frozen = jax.tree.map(lambda _: False, net)
    frozen = eqx.tree_at(lambda m: m.mix, frozen, True)
    state = redeqx.init_state(net, _muon(dims), mesh, redeqx.sharding_rules(net, mesh), key=jax.random.key(1),
                              trainable=frozen)
    assert state.opt_state is not None


def test_wrong_inputs_name_the_fix():
    with pytest.raises(ValueError, match="loss_fn= and batch="):
        redeqx.muon_dimensions(Net(jax.random.key(0), True), None, BATCH)
    with pytest.raises(TypeError, match="not callable"):
        redeqx.muon_dimensions(Net(jax.random.key(0), True), "loss", BATCH)
