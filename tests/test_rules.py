import re
import warnings

import equinox as eqx
import jax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from tiny_transformer import TinyLM


def spec_of(specs, where):
    return where(specs)


def model_dim(spec):
    """Which dim the 'model' axis splits, or None when replicated over it."""
    for d, entry in enumerate(spec):
        if entry == "model" or (isinstance(entry, tuple) and "model" in entry):
            return d
    return None


def test_make_mesh_shapes(devices):
    for k, data in [(1, 8), (2, 4), (4, 2), (8, 1)]:
        mesh = redeqx.make_mesh(k)
        assert dict(mesh.shape) == {"data": data, "model": k}
    mesh = redeqx.make_mesh(1, devices=devices[:1])
    assert dict(mesh.shape) == {"data": 1, "model": 1}


def test_make_mesh_bad_n_model_shards(devices):
    with pytest.raises(ValueError, match=r"n_model_shards=3 does not divide the 8 devices.*\[1, 2, 4, 8\]"):
        redeqx.make_mesh(3)
    with pytest.raises(ValueError, match="n_model_shards must be >= 1"):
        redeqx.make_mesh(0)
    with pytest.raises(TypeError, match=r"(?s)parameter 'n_model_shards'.*Actual value: '2'"):
        redeqx.make_mesh("2")  # checked against the annotations at run time


def test_mlp_alternates(getkey):
    mesh = redeqx.make_mesh(2)
    model = eqx.nn.MLP(16, 8, 32, depth=4, key=getkey())
    specs = redeqx.sharding_rules(model, mesh)
    dims = [model_dim(layer.weight) for layer in specs.layers]
    assert dims == [0, 1, 0, 1, 0]
    # the bias of a column-parallel layer is split with it; row-parallel biases are replicated
    assert specs.layers[0].bias == P("model")
    assert specs.layers[1].bias == P()
    assert specs.activation is None


def test_multihead_attention(getkey):
    mesh = redeqx.make_mesh(4)
    model = eqx.nn.MultiheadAttention(num_heads=4, query_size=32, use_query_bias=True, use_output_bias=True, key=getkey())
    specs = redeqx.sharding_rules(model, mesh)
    for proj in (specs.query_proj, specs.key_proj, specs.value_proj):
        assert model_dim(proj.weight) == 0
    assert specs.query_proj.bias == P("model")
    assert model_dim(specs.output_proj.weight) == 1
    assert specs.output_proj.bias == P()


class SwiGLU(eqx.Module):
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(16, 32, use_bias=False, key=k[0])
        self.up = eqx.nn.Linear(16, 32, use_bias=False, key=k[1])
        self.down = eqx.nn.Linear(32, 16, use_bias=False, key=k[2])


class RawAttention(eqx.Module):  # weights held as bare arrays, Equinox (out, in) layout
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.wq, self.wk, self.wv = (jax.random.normal(kk, (16, 16)) for kk in k[:3])
        self.wo = jax.random.normal(k[3], (16, 16))


class GPTBlock(eqx.Module):
    attention: RawAttention
    ffn: SwiGLU
    norm: eqx.nn.RMSNorm

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attention = RawAttention(k1)
        self.ffn = SwiGLU(k2)
        self.norm = eqx.nn.RMSNorm(16)


def test_gpt_style_names_give_megatron_plan(getkey):
    mesh = redeqx.make_mesh(2)
    lm = TinyLM(key=getkey())
    specs = redeqx.sharding_rules(lm, mesh)
    assert model_dim(specs.embed.weight) == 0
    assert model_dim(specs.lm_head.weight) == 0
    for b in specs.blocks:
        assert [model_dim(b.attn.wq.weight), model_dim(b.attn.wk.weight), model_dim(b.attn.wv.weight)] == [0, 0, 0]
        assert model_dim(b.attn.wo.weight) == 1
        assert model_dim(b.mlp.fc1.weight) == 0 and model_dim(b.mlp.fc2.weight) == 1
        assert b.ln1.weight == P() and b.mlp.fc2.bias == P()

    block = GPTBlock(getkey())
    specs = redeqx.sharding_rules(block, mesh)
    assert [model_dim(s) for s in (specs.attention.wq, specs.attention.wk, specs.attention.wv)] == [0, 0, 0]
    assert model_dim(specs.attention.wo) == 1
    assert [model_dim(specs.ffn.gate.weight), model_dim(specs.ffn.up.weight), model_dim(specs.ffn.down.weight)] == [0, 0, 1]
    assert specs.norm.weight == P()


def test_conv_alternates(getkey):
    mesh = redeqx.make_mesh(2)
    model = eqx.nn.Sequential([
        eqx.nn.Conv2d(2, 8, 3, key=getkey()), eqx.nn.Lambda(jax.nn.relu), eqx.nn.Conv2d(8, 4, 3, key=getkey())
    ])
    specs = redeqx.sharding_rules(model, mesh)
    assert specs.layers[0].weight == P("model", None, None, None)
    assert specs.layers[0].bias == P("model", None, None)
    assert specs.layers[2].weight == P(None, "model", None, None)


def test_indivisible_dims_replicated_with_one_warning(getkey):
    mesh = redeqx.make_mesh(4)
    model = eqx.nn.MLP(6, 3, 10, depth=2, key=getkey())  # 10 % 4 != 0 everywhere
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        specs = redeqx.sharding_rules(model, mesh)
    ours = [w for w in caught if "redeqx.sharding_rules" in str(w.message)]
    assert len(ours) == 1
    assert "layers.0.weight" in str(ours[0].message) and "layers.1.weight" in str(ours[0].message)
    assert all(s.weight == P() for s in specs.layers)
    table = redeqx.explain(model, specs, mesh)
    assert "not divisible by 4" in table


def test_overrides_win(getkey):
    mesh = redeqx.make_mesh(2)
    lm = TinyLM(key=getkey())
    specs = redeqx.sharding_rules(lm, mesh, overrides=[(r"attn\.wo\.weight$", P("model", None)), (r"^embed\.", P())])
    for b in specs.blocks:
        assert b.attn.wo.weight == P("model", None)
    assert specs.embed.weight == P()
    assert specs.lm_head.weight == P("model", None)
    rows = {line.split()[0]: line for line in redeqx.explain(lm, specs, mesh).splitlines() if line}
    assert rows["blocks.0.attn.wo.weight"].endswith("given")  # differs from what the rules alone say
    assert not rows["blocks.0.attn.wq.weight"].endswith("given")


def test_bad_overrides(getkey):
    mesh = redeqx.make_mesh(2)
    model = eqx.nn.MLP(6, 3, 10, depth=1, key=getkey())
    with pytest.raises(ValueError, match=r"names axis 'tensor'.*mesh has axes \('data', 'model'\)"):
        redeqx.sharding_rules(model, mesh, overrides=[("layers.0.weight", P("tensor"))])
    with pytest.raises(ValueError, match=r"dim 0 of size 3"):
        redeqx.sharding_rules(model, mesh, overrides=[("layers.1.weight", P("model", None))])
    with pytest.raises(TypeError, match=r"overrides\[0\]"):
        redeqx.sharding_rules(model, mesh, overrides=["layers"])


def test_fsdp_shards_over_data(getkey):
    mesh = redeqx.make_mesh(2)
    model = eqx.nn.MLP(256, 256, 256, depth=1, key=getkey())
    specs = redeqx.sharding_rules(model, mesh, fsdp=True)
    assert specs.layers[0].weight == P("model", "data")
    assert specs.layers[1].weight == P("data", "model")


def test_explain_table(getkey):
    mesh = redeqx.make_mesh(2)
    lm = TinyLM(key=getkey())
    table = redeqx.explain(lm, redeqx.sharding_rules(lm, mesh), mesh)
    assert "blocks.0.attn.wq.weight" in table and "attention Q/K/V: dim 0" in table
    assert re.search(r"total .* per device", table)
    edited = eqx.tree_at(lambda s: s.ln_f.weight, redeqx.sharding_rules(lm, mesh), P("model"))
    assert "given" in redeqx.explain(lm, edited, mesh)


class GPT2Embeddings(eqx.Module):
    wte: jax.Array  # (vocab, dim)
    wpe: jax.Array  # (positions, dim)
    pos_embedding: eqx.nn.Embedding

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.wte = jax.random.normal(k[0], (64, 16))
        self.wpe = jax.random.normal(k[1], (32, 16))
        self.pos_embedding = eqx.nn.Embedding(32, 16, key=k[2])


def test_position_embeddings_are_replicated(getkey):
    mesh = redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(GPT2Embeddings(getkey()), mesh)
    assert model_dim(specs.wte) == 0
    assert specs.wpe == P() and specs.pos_embedding.weight == P()
