"""A fused Q/K/V projection (timm's ``qkv``, lucidrains' ``to_qkv``, MosaicML's
``Wqkv``, GPT-2's ``c_attn``) is split only where every device gets whole
heads of each of Q, K and V: under a layout the module states as
``"interleaved"`` (heads, 3, head_dim). Otherwise it stays whole, and so does
its attention's output projection, rather than splitting mid-head (issue 23).
So does a GLU's value and gate cut from one projection by ``chunk(2)``, and the
warnings name the layout that splits."""

import sys
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
from user_gpt import GPT, collate_fn, linear, loss_fn, make_examples

WIDTH, SEQ, VOCAB = 32, 16, 64


def attend(q, k, v):  # (H, T, D) each -> (T, H * D), causal
    t = q.shape[1]
    att = jnp.einsum("htd,hsd->hts", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, jnp.finfo(att.dtype).min), axis=-1)
    return jnp.einsum("hts,hsd->thd", att, v).reshape(t, -1)


class TimmAttention(eqx.Module):  # timm's ViT: qkv(x).reshape(T, 3, H, D)
    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)

    def __init__(self, heads, *, key):
        k1, k2 = jax.random.split(key)
        self.qkv, self.proj, self.num_heads = linear(WIDTH, 3 * WIDTH, key=k1), linear(WIDTH, WIDTH, key=k2), heads

    def __call__(self, x):  # (T, C)
        t, c = x.shape
        q, k, v = jax.vmap(self.qkv)(x).reshape(t, 3, self.num_heads, -1).transpose(1, 2, 0, 3)
        return jax.vmap(self.proj)(attend(q, k, v))


class LucidAttention(eqx.Module):  # lucidrains: to_qkv(x).chunk(3), 'b n (h d) -> b h n d'
    to_qkv: eqx.nn.Linear
    to_out: eqx.nn.Sequential
    heads: int = eqx.field(static=True)

    def __init__(self, heads, *, key):
        k1, k2 = jax.random.split(key)
        self.to_qkv = eqx.nn.Linear(WIDTH, 3 * WIDTH, use_bias=False, key=k1)
        self.to_out, self.heads = eqx.nn.Sequential([linear(WIDTH, WIDTH, key=k2)]), heads

    def __call__(self, x):
        q, k, v = (y.reshape(x.shape[0], self.heads, -1).transpose(1, 0, 2)
                   for y in jnp.split(jax.vmap(self.to_qkv)(x), 3, axis=-1))
        return jax.vmap(self.to_out)(attend(q, k, v))


class MosaicAttention(eqx.Module):  # MosaicML's MPT: Wqkv / out_proj, chunk(3)
    Wqkv: eqx.nn.Linear
    out_proj: eqx.nn.Linear
    n_heads: int = eqx.field(static=True)

    def __init__(self, heads, *, key):
        k1, k2 = jax.random.split(key)
        self.Wqkv, self.out_proj, self.n_heads = linear(WIDTH, 3 * WIDTH, key=k1), linear(WIDTH, WIDTH, key=k2), heads

    def __call__(self, x):
        q, k, v = (y.reshape(x.shape[0], self.n_heads, -1).transpose(1, 0, 2)
                   for y in jnp.split(jax.vmap(self.Wqkv)(x), 3, axis=-1))
        return jax.vmap(self.out_proj)(attend(q, k, v))


class InterleavedAttention(eqx.Module):  # GPT-NeoX's query_key_value: (T, H, 3, D), said by qkv_layout
    query_key_value: eqx.nn.Linear
    dense: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    qkv_layout = "interleaved"

    def __init__(self, heads, *, key):
        k1, k2 = jax.random.split(key)
        self.query_key_value = linear(WIDTH, 3 * WIDTH, key=k1)
        self.dense, self.num_heads = linear(WIDTH, WIDTH, key=k2), heads

    def __call__(self, x):
        q, k, v = jax.vmap(self.query_key_value)(x).reshape(x.shape[0], self.num_heads, 3, -1).transpose(2, 1, 0, 3)
        return jax.vmap(self.dense)(attend(q, k, v))


class StackedAttention(TimmAttention):  # timm's layout, said: replicated without a warning
    qkv_layout = "stacked"


def gpt_with(attention, heads=4):
    model = GPT(vocab=VOCAB, seq=SEQ, width=WIDTH, layers=2, heads=heads, key=jax.random.key(0))
    keys = jax.random.split(jax.random.key(5), len(model.blocks))
    return eqx.tree_at(lambda m: [b.attn for b in m.blocks], model, [attention(heads, key=k) for k in keys])


def rules(model, n_model_shards, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        specs = redeqx.sharding_rules(model, redeqx.make_mesh(n_model_shards), **kw)
    return specs, [str(w.message) for w in caught if "redeqx.sharding_rules" in str(w.message)]


UNKNOWN = [(TimmAttention, "qkv", "proj"), (LucidAttention, "to_qkv", "to_out.layers.0"),
           (MosaicAttention, "Wqkv", "out_proj")]


@pytest.mark.parametrize("attention,fused,out", UNKNOWN)
def test_a_fused_qkv_of_unknown_layout_stays_whole_with_its_output(attention, fused, out):
    model = gpt_with(attention)
    specs, caught = rules(model, 2)
    for block in specs.blocks:
        assert getattr(block.attn, fused).weight == P()
        assert block.mlp.fc1.weight == P("model", None) and block.mlp.fc2.weight == P(None, "model")
    assert len(caught) == 1 and f"blocks.0.attn.{fused}.weight" in caught[0] and "qkv_layout" in caught[0]
    table = redeqx.explain(model, specs, redeqx.make_mesh(2), reasons="full")
    rows = {r.split()[0]: r for r in table.splitlines() if r}
    assert rows[f"blocks.1.attn.{out}.weight"].endswith("attention output, its fused Q/K/V not split: replicated")
    assert "fused Q/K/V: replicated, fused Q/K/V of unknown layout" in rows[f"blocks.1.attn.{fused}.weight"]
    assert caught[0].count("unknown layout") == 1  # said once for both layers
    _, caught = rules(model, 1)
    assert caught == []  # nothing to split, nothing to say


def test_the_program_says_which_layout_of_a_fused_qkv_splits(monkeypatch):
    """Read from the program, a fused Q/K/V cut into q, k and v after a (3, heads, head_dim) reshape or
    a chunk(3) stays whole, and the warning (where splitting it per head with its output projection
    would cost less: 768 wide, 256 rows) says what to write instead, also where the output
    projection sits in a ``Sequential`` of its own (lucidrains' ``to_out``); cut after (heads, 3,
    head_dim), it is split on whole heads, with its output projection, and nothing is warned. At
    256 rows each weight split alone would cost more than whole: the warning prices the pair."""
    monkeypatch.setattr(sys.modules[__name__], "WIDTH", 768)
    batch = {"tokens": jax.ShapeDtypeStruct((256, SEQ + 1), jnp.int32)}
    for attention, fused in ((TimmAttention, "qkv"), (MosaicAttention, "Wqkv"), (LucidAttention, "to_qkv")):
        specs, caught = rules(eqx.filter_eval_shape(gpt_with, attention), 2, loss_fn=loss_fn, batch=batch)
        assert getattr(specs.blocks[0].attn, fused).weight == P(), attention
        assert len(caught) == 1 and "(..., heads, 3, head_dim) for attention" in caught[0], caught
    specs, caught = rules(eqx.filter_eval_shape(gpt_with, InterleavedAttention), 2, loss_fn=loss_fn, batch=batch)
    attn = specs.blocks[0].attn
    assert (attn.query_key_value.weight, attn.dense.weight) == (P("model", None), P(None, "model")) and not caught


def test_gpt2_c_attn_names_a_fused_qkv():
    class GPT2Attention(eqx.Module):
        c_attn: eqx.nn.Linear
        c_proj: eqx.nn.Linear
        n_head: int = eqx.field(static=True)

        def __init__(self, heads, *, key):
            self.c_attn, self.c_proj, self.n_head = (linear(WIDTH, 3 * WIDTH, key=key),
                                                     linear(WIDTH, WIDTH, key=key), heads)

    specs, caught = rules(gpt_with(GPT2Attention), 2)
    assert specs.blocks[0].attn.c_attn.weight == specs.blocks[0].attn.c_proj.weight == P() and len(caught) == 1


def test_a_stated_layout_decides():
    specs, caught = rules(gpt_with(StackedAttention), 2)
    assert specs.blocks[0].attn.qkv.weight == specs.blocks[0].attn.proj.weight == P() and caught == []
    specs, caught = rules(gpt_with(InterleavedAttention), 2)  # whole heads of each of q, k, v: Megatron's plan
    attn = specs.blocks[0].attn
    assert attn.query_key_value.weight == P("model", None) and attn.query_key_value.bias == P("model")
    assert attn.dense.weight == P(None, "model") and caught == []
    specs, caught = rules(gpt_with(InterleavedAttention, heads=2), 4)  # 2 heads over 4 shards: whole, said
    assert specs.blocks[0].attn.query_key_value.weight == specs.blocks[0].attn.dense.weight == P()
    assert len(caught) == 1 and "2 heads not divisible by n_model_shards=4" in caught[0]

    class Typo(InterleavedAttention):
        qkv_layout = "interleave"

    with pytest.raises(ValueError, match=r"Typo.qkv_layout = 'interleave'; say 'interleaved' .* or 'stacked'"):
        redeqx.sharding_rules(gpt_with(Typo), redeqx.make_mesh(2))


def train(model, n_model_shards, devices):
    mesh = redeqx.make_mesh(n_model_shards, devices=devices)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.sgd(0.1)  # not Adam: softmax ignores the key bias, whose gradient is rounding noise
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    batch = collate_fn(make_examples(8, seq=SEQ, vocab=VOCAB))
    losses = []
    for _ in range(2):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.asarray(losses), state.model


@pytest.mark.slow
@pytest.mark.parametrize("attention", [LucidAttention, InterleavedAttention])
def test_trains_as_one_device(attention, devices):
    model = gpt_with(attention)
    ref_losses, ref_model = train(model, 1, devices[:1])
    losses, trained = train(model, 2, devices)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(eqx.filter(trained, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(ref_model, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def collectives(model, n_model_shards, overrides=()):
    mesh = redeqx.make_mesh(n_model_shards)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        specs = redeqx.sharding_rules(model, mesh, overrides=overrides)
    optimizer = optax.adam(1e-2)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    batch = collate_fn(make_examples(4 * mesh.shape["data"], seq=SEQ, vocab=VOCAB))
    return accelerator_collectives(step, state, batch)


def collective_bytes(model, n_model_shards, overrides=()):
    return sum(v["bytes"] for v in collectives(model, n_model_shards, overrides).values())


@pytest.mark.slow
def test_collectives_fall_below_a_split_mid_head():
    """At 2 shards, as an accelerator moves them: timm's fused qkv kept whole
    moves less than the split of dim 0 the rules made before; lucidrains' moves
    no activations between devices but the all-reduces (its chunk(3) of a
    split output took collective-permutes and all-to-alls); an interleaved one,
    split on whole heads, moves what separate Q, K, V layers move."""
    mid_head = [(r"attn\.qkv\.weight", P("model", None)), (r"attn\.qkv\.bias", P("model")),
                (r"attn\.proj\.weight", P(None, "model"))]
    timm = gpt_with(TimmAttention)
    assert collective_bytes(timm, 2) < collective_bytes(timm, 2, mid_head)
    assert set(collectives(gpt_with(LucidAttention), 2)) == {"all-reduce"}
    assert collective_bytes(gpt_with(InterleavedAttention), 2) <= collective_bytes(
        GPT(vocab=VOCAB, seq=SEQ, width=WIDTH, layers=2, heads=4, key=jax.random.key(0)), 2)


class GatedMLP(eqx.Module):
    """A GLU whose value and gate come from one projection: ``chunk(2)`` (x-transformers' GLU), or
    an inner dim of 2 (the layout the warning advises)."""

    w12: eqx.nn.Linear
    w3: eqx.nn.Linear
    interleaved: bool = eqx.field(static=True)

    def __call__(self, x):  # (T, D)
        y = jax.vmap(self.w12)(x)
        if self.interleaved:
            value, gate = jnp.moveaxis(y.reshape(x.shape[0], -1, 2), -1, 0)
        else:
            value, gate = jnp.split(y, 2, axis=-1)
        return x + jax.vmap(self.w3)(value * jax.nn.silu(gate))


def test_a_glu_cut_by_chunk_is_said_with_the_layout_that_splits():
    """A fused value/gate projection cut by ``chunk(2)`` stays whole, with the projection after it
    (no spec gives a device matching halves of both), and the warning says what to write; with
    the halves an inner dim of 2, the rules split the MLP Megatron's way, and say nothing."""
    width, hidden = 1024, 4096
    batch = {"x": jax.ShapeDtypeStruct((16, 64, width), jnp.float32)}

    def loss(model, batch, key):
        return jnp.mean(jax.vmap(model)(batch["x"]) ** 2)

    for interleaved in (False, True):
        k1, k2 = jax.random.split(jax.random.key(0))
        model = eqx.filter_eval_shape(lambda: GatedMLP(eqx.nn.Linear(width, 2 * hidden, use_bias=False, key=k1),
                                                       eqx.nn.Linear(hidden, width, use_bias=False, key=k2),
                                                       interleaved))
        specs, caught = rules(model, 2, loss_fn=loss, batch=batch)
        if interleaved:
            assert (specs.w12.weight, specs.w3.weight) == (P("model", None), P(None, "model")) and not caught
        else:
            assert specs.w12.weight == specs.w3.weight == P()
            assert len(caught) == 1 and "(..., hidden, 2) for a GLU" in caught[0], caught


class RawStackedGLU(eqx.Module):
    """Raw arrays in one module, the layers stacked and run by a scan, each a GLU whose value and gate
    come from one matrix by ``jnp.split`` (or, interleaved, an inner dim of 2); a vocabulary head
    the rules split: the block of the root's whole weights is said though the head beside it is
    split (before, a block partly split was never said)."""

    emb: jax.Array
    up: jax.Array  # (layers, width, 2 * hidden)
    down: jax.Array  # (layers, hidden, width)
    head: jax.Array
    interleaved: bool = eqx.field(static=True)

    def __call__(self, tokens):
        def layer(x, weights):
            up, down = weights
            h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) @ up
            if self.interleaved:
                value, gate = jnp.moveaxis(h.reshape(*x.shape[:-1], -1, 2), -1, 0)
            else:
                value, gate = jnp.split(h, 2, axis=-1)
            return x + (value * jax.nn.silu(gate)) @ down, None

        return jax.lax.scan(layer, self.emb[tokens], (self.up, self.down))[0] @ self.head


def test_raw_arrays_cut_by_jnp_split_beside_a_split_head_are_said():
    width, hidden, vocab = 256, 1024, 16384
    batch = {"tokens": jax.ShapeDtypeStruct((8, 2049), jnp.int32)}

    def loss(model, batch, key):
        logits = jax.vmap(model)(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    for interleaved in (False, True):
        model = RawStackedGLU(jax.ShapeDtypeStruct((vocab, width), jnp.float32),
                              jax.ShapeDtypeStruct((2, width, 2 * hidden), jnp.float32),
                              jax.ShapeDtypeStruct((2, hidden, width), jnp.float32),
                              jax.ShapeDtypeStruct((width, vocab), jnp.float32), interleaved)
        specs, caught = rules(model, 2, loss_fn=loss, batch=batch)
        assert specs.head == P(None, "model")
        if interleaved:
            assert (specs.up, specs.down) == (P(None, None, "model"), P(None, "model", None)) and not caught
        else:
            assert specs.up == specs.down == P()
            assert len(caught) == 1 and "wholly replicated at n_model_shards=2: up+down" in caught[0], caught
            assert "(..., hidden, 2) for a GLU" in caught[0] and "overrides" not in caught[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["chunk", "interleaved"])
def test_vit_pytorch_trains_as_on_one_device_in_either_layout(layout, devices):
    """vit-pytorch's ViT (`written_otherwise.VitPytorch`): its attention whole as written, split per
    head when interleaved; two SGD steps at 2 and 4 shards equal one device's, every weight."""
    import written_otherwise as w
    from test_rules_cells_convs import assert_trains_as_one_device

    rng = np.random.default_rng(0)
    images = {"x": rng.normal(size=(8, 3, 16, 16)).astype(np.float32), "y": rng.integers(0, 10, 8).astype(np.int32)}
    model = w.VitPytorch(layout=layout, key=jax.random.key(0))
    assert_trains_as_one_device(model, images, devices, rules=dict(loss_fn=w.image_loss, batch=images),
                                loss=w.image_loss)
