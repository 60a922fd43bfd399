import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
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
    with pytest.raises(TypeError, match=r"^make_mesh\(\): argument n_model_shards='2' is a str, expected int or 'auto'.$"):
        redeqx.make_mesh("2")  # checked against the annotations at run time, in one line


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
    table = redeqx.explain(model, specs, mesh, reasons="full")
    assert "not divisible by n_model_shards=4" in table


def test_overrides_win(getkey):
    mesh = redeqx.make_mesh(2)
    lm = TinyLM(key=getkey())
    overrides = [(r"attn\.wo\.weight$", P("model", None)), (r"^embed\.", P())]
    specs = redeqx.sharding_rules(lm, mesh, overrides=overrides)
    for b in specs.blocks:
        assert b.attn.wo.weight == P("model", None)
    assert specs.embed.weight == P()
    assert specs.lm_head.weight == P("model", None)
    table = redeqx.explain(lm, specs, mesh, overrides=overrides, reasons="full")
    rows = {line.split()[0]: line for line in table.splitlines()
            if line}
    # explain names the override and what the rules alone would have said
    assert rows["blocks.0.attn.wo.weight"].endswith(r"override 'attn\.wo\.weight$' (rules: attention output: dim 1)")
    assert rows["blocks.0.attn.wq.weight"].endswith("attention Q/K/V: dim 0")


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
    assert "global batch is per_device_batch_size x 4 (data) rows" in table
    edited = eqx.tree_at(lambda s: s.ln_f.weight, redeqx.sharding_rules(lm, mesh), P("model"))
    assert f"given (rules: {P()}, replicated)" in redeqx.explain(lm, edited, mesh, reasons="full")


class FixedNoise(eqx.Module):
    """A model that keeps a PRNG key among its arrays (fixed random features drawn from it)."""

    layer: eqx.nn.Linear
    key: jax.Array

    def __call__(self, x):
        return self.layer(x) + jax.random.normal(self.key, (4,))


def test_a_model_holding_a_prng_key_is_explained_and_planned(getkey):
    """``explain`` read each leaf's dtype through NumPy, which cannot read a key's: it raised. The
    table gives the key its 8 bytes (two words), and `plan` counts them so too."""
    model = FixedNoise(eqx.nn.Linear(8, 4, key=getkey()), jax.random.key(0))
    mesh = redeqx.make_mesh(2)
    table = redeqx.explain(model, redeqx.sharding_rules(model, mesh), mesh)
    assert re.search(r"^key +\(\) +key<fry> +P\(\) +8 B ", table, re.M), table

    def loss(model, batch, key):
        return jnp.mean(jax.vmap(model)(batch["x"]) ** 2)

    batch = {"x": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    with_key, without = (redeqx.plan(m, loss, optax.sgd(0.1), batch, mesh).parameters for m in (model, model.layer))
    assert with_key == without + 8


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


# ----------------------------------------------------------------------------- the rules on users' models


def rules_warnings(model, mesh, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        specs = redeqx.sharding_rules(model, mesh, **kw)
    return specs, [w for w in caught if "redeqx.sharding_rules" in str(w.message)]


def test_attention_heads_are_never_split_mid_head(getkey):
    """3 heads over 2 shards: 3 * 16 output features divide by 2, but a head would be cut in half."""
    mesh = redeqx.make_mesh(2)
    model = eqx.nn.MultiheadAttention(num_heads=3, query_size=48, key=getkey())
    specs, caught = rules_warnings(model, mesh)
    for proj in (specs.query_proj, specs.key_proj, specs.value_proj, specs.output_proj):
        assert proj.weight == P()
    assert len(caught) == 1 and "3 heads not divisible by n_model_shards=2" in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the caller's line, not a wrapper
    assert "3 heads not divisible" in redeqx.explain(model, specs, mesh, reasons="full")
    specs = redeqx.sharding_rules(eqx.nn.MultiheadAttention(num_heads=4, query_size=48, key=getkey()), mesh)
    assert specs.query_proj.weight == P("model", None) and specs.output_proj.weight == P(None, "model")


def test_zoo_grouped_query_heads_follow_their_own_count(getkey):
    from redeqx.models import LlamaConfig, LlamaForCausalLM

    for scan_layers, layer in ((False, lambda s: s.model.layers[0]), (True, lambda s: s.model.layers)):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, scan_layers=scan_layers)
        model = eqx.filter_eval_shape(LlamaForCausalLM, config, key=getkey())
        specs, caught = rules_warnings(model, redeqx.make_mesh(4))
        attn = layer(specs).self_attn
        lead = (None,) if scan_layers else ()  # the layer axis, never split
        assert attn.q_proj.weight == P(*lead, "model", None) and attn.o_proj.weight == P(*lead, None, "model")
        assert attn.k_proj.weight == P() and attn.v_proj.weight == P()  # 2 KV heads over 4 shards
        assert any("2 heads not divisible" in str(w.message) for w in caught)


def test_conv_bias_follows_its_conv(getkey):
    mesh = redeqx.make_mesh(2)
    model = eqx.nn.Sequential([eqx.nn.Conv2d(2, 8, 3, key=getkey()), eqx.nn.Conv2d(8, 4, 3, key=getkey()),
                               eqx.nn.Conv2d(4, 6, 1, key=getkey())])
    specs = redeqx.sharding_rules(model, mesh)
    assert [model_dim(layer.weight) for layer in specs.layers] == [0, 1, 0]  # biases do not alternate
    assert specs.layers[0].bias == P("model", None, None)  # (C, 1, 1), split with its dim-0 conv
    assert specs.layers[1].bias == P()
    assert specs.layers[2].bias == P("model", None, None)


class ViT(eqx.Module):
    cls_token: jax.Array
    pos_table: jax.Array
    blocks: list
    value_head: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 5)
        self.cls_token = jax.random.normal(k[0], (1, 32))
        self.pos_table = jax.random.normal(k[1], (17, 32))
        self.blocks = [eqx.nn.Linear(32, 64, key=k[2]), eqx.nn.Linear(64, 32, key=k[3])]
        self.value_head = eqx.nn.Linear(32, 1, key=k[4])
        self.head = eqx.nn.Linear(32, 10, key=k[4])


def test_bare_parameters_and_small_heads_make_no_noise(getkey):
    mesh = redeqx.make_mesh(2)
    model = ViT(getkey())
    specs, caught = rules_warnings(model, mesh)
    assert caught == []
    assert specs.cls_token == P() and specs.pos_table == P()
    assert [model_dim(b.weight) for b in specs.blocks] == [0, 1]  # bare arrays took no part in the alternation
    table = redeqx.explain(model, specs, mesh)
    rows = {line.split()[0]: line for line in table.splitlines() if line}
    assert rows["cls_token"].endswith("parameter array (not a layer): replicated")
    assert "LM head" not in table and "classifier head" in rows["head.weight"]
    assert specs.value_head.weight == P()  # (1, 32): one output, nothing to split, and no warning about it


def test_lm_head_is_said_of_vocabulary_sized_heads_only(getkey):
    lm = TinyLM(vocab=64, key=getkey())
    table = redeqx.explain(lm, redeqx.sharding_rules(lm, redeqx.make_mesh(2)), redeqx.make_mesh(2))
    assert "LM head: dim 0 (vocab)" in [line for line in table.splitlines() if line.startswith("lm_head")][0]


def test_overrides_are_final_and_checked(getkey):
    mesh = redeqx.make_mesh(2)
    model = eqx.nn.MLP(256, 256, 256, depth=1, key=getkey())
    overrides = [(r"layers\.0\.weight", P("model", None))]
    specs = redeqx.sharding_rules(model, mesh, overrides=overrides, fsdp=True)
    assert specs.layers[0].weight == P("model", None)  # fsdp did not re-split it
    assert specs.layers[1].weight == P("data", "model")
    table = redeqx.explain(model, specs, mesh, overrides=overrides, reasons="full")
    assert "+ fsdp over data" in table and "override 'layers\\.0\\.weight'" in table and "given" not in table
    with pytest.raises(ValueError, match=re.escape("override 'layer\\.0\\.weight' matches no array path") + ".*layers.0.weight"):
        redeqx.sharding_rules(model, mesh, overrides=[(r"layer\.0\.weight", P())])


def test_name_prefixes_paths_in_warnings(getkey):
    model = eqx.nn.MLP(6, 3, 10, depth=1, key=getkey())
    _, caught = rules_warnings(model, redeqx.make_mesh(4), name="critic")
    assert "sharding_rules(name='critic')" in str(caught[0].message)
    assert "critic.layers.0.weight" in str(caught[0].message)


def test_a_layer_at_the_root_is_a_layer(getkey):
    """A Linear, Conv or Embedding is a layer wherever it sits, the root included (issue 23)."""
    mesh = redeqx.make_mesh(8)
    specs, caught = rules_warnings(eqx.nn.Linear(12, 16, key=getkey()), mesh)
    assert specs.weight == P("model", None) and specs.bias == P("model") and caught == []
    table = redeqx.explain(eqx.nn.Linear(12, 16, key=getkey()), specs, mesh)
    assert "not a layer" not in table and "unnamed layers alternate column/row: column (dim 0)" in table
    specs, caught = rules_warnings(eqx.nn.Linear(12, 20, key=getkey()), mesh)  # 20 % 8: said, as for any layer
    assert specs.weight == P() and len(caught) == 1 and "weight (20, 12): dim 0 (20)" in str(caught[0].message)
    assert redeqx.sharding_rules(eqx.nn.Conv2d(3, 8, 3, key=getkey()), mesh).weight == P("model", None, None, None)
    specs = redeqx.sharding_rules(eqx.nn.Embedding(64, 16, key=getkey()), mesh)
    assert specs.weight == P("model", None)
    assert "embedding: dim 0 (vocab)" in redeqx.explain(eqx.nn.Embedding(64, 16, key=getkey()), specs, mesh)


# ----------------------------------------------------------------------------- small heads, hand plans (issue 40)


def test_a_small_head_that_does_not_divide_is_said_in_explain_not_warned(getkey):
    """Before: a 10-class head warned at 4 shards though its copy costs nothing worth a warning."""
    mesh = redeqx.make_mesh(4)
    model = eqx.nn.MLP(64, 10, 1024, depth=2, key=getkey())  # the head (10, 1024): 0.9 % of the parameters
    batch = {"x": jax.ShapeDtypeStruct((8, 64), jnp.float32), "y": jax.ShapeDtypeStruct((8,), jnp.int32)}

    def loss_fn(m, b, key):
        return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(m)(b["x"]), b["y"]).mean()

    for program in ({}, dict(loss_fn=loss_fn, batch=batch)):
        specs, caught = rules_warnings(model, mesh, **program)
        assert caught == [] and specs.layers[2].weight == P(), program
        row = [r for r in redeqx.explain(model, specs, mesh, **program).splitlines() if r.startswith("layers.2.weight")]
        assert row[0].endswith("replicated (small): dim 0 (10) does not split 4 ways"), row
        row = [r for r in redeqx.explain(model, specs, mesh, **program, reasons="full").splitlines()
               if r.startswith("layers.2.weight")]
        assert "not divisible by n_model_shards=4" in row[0] and "so not warned" in row[0], row
    # a large leaf that does not divide is still warned about
    specs, caught = rules_warnings(eqx.nn.MLP(64, 10, 30, depth=1, key=getkey()), mesh)
    assert len(caught) == 1 and "(30, 64): dim 0 (30)" in str(caught[0].message)


def test_specs_from_overrides_is_a_hand_plan(getkey):
    mesh = redeqx.make_mesh(2)
    lm = TinyLM(key=getkey())
    megatron = [(r"attn\.w[qkv]\.weight$", P("model", None)), (r"attn\.wo\.weight$", P(None, "model")),
                (r"mlp\.fc1\.(weight|bias)$", P("model")), (r"mlp\.fc2\.weight$", P(None, "model"))]
    specs = redeqx.specs_from_overrides(lm, mesh, megatron)
    assert jax.tree.structure(specs, is_leaf=lambda x: x is None) == jax.tree.structure(
        redeqx.sharding_rules(lm, mesh), is_leaf=lambda x: x is None)
    block = specs.blocks[0]
    assert (block.attn.wq.weight, block.attn.wo.weight) == (P("model", None), P(None, "model"))
    assert (block.mlp.fc1.bias, block.mlp.fc2.bias) == (P("model"), P())
    assert specs.embed.weight == specs.lm_head.weight == P()
    # a hand plan trains: the state takes it as it takes the rules' specs
    state = redeqx.init_state(lm, optax.sgd(0.1), mesh, specs, key=getkey())
    assert state.model.blocks[0].attn.wq.weight.sharding.spec == P("model", None)
    assert redeqx.specs_from_overrides(lm, mesh, []).blocks[0].attn.wq.weight == P()
    with pytest.raises(ValueError, match="override 'attn.wz' matches no array path"):
        redeqx.specs_from_overrides(lm, mesh, [("attn.wz", P())])
    with pytest.raises(ValueError, match="has 3 entries but the leaf has shape"):
        redeqx.specs_from_overrides(lm, mesh, [("attn.wq.weight", P("model", None, None))])
