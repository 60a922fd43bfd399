"""Sequences split over a 'context' axis: the split step computes what one device does."""

import dataclasses
import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import redeqx
import redeqx.context._blockwise  # noqa: F401  (its BLOCK, set small in a test)
from redeqx import models

# every step here, the zoo's and the user's models done right, trains without the warnings of a step that reads
# places as positions (_context_checks): a warning of theirs is an error, except where a test expects it
pytestmark = pytest.mark.filterwarnings("error:redeqx. the step")

SEQ_KEYS = ("input_ids", "labels", "attention_mask")
MESHES = [(1, 8, 1), (2, 4, 1), (1, 4, 2), (2, 2, 2)]  # (data, context, model)


def _mesh(d, c, m):
    return redeqx.make_mesh(m, n_context_shards=c, devices=jax.devices()[: d * c * m])


def _qkv(key, b=2, t=16, hq=4, hkv=2, d=8):
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (b, t, hq, d)), jax.random.normal(kk, (b, t, hkv, d)),
            jax.random.normal(kv, (b, t, hkv, d)))


def _naive(q, k, v, seg, causal, window=None):
    """Attention written out with a (T, T) mask, in the original order."""
    t, g = q.shape[1], q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    mask = seg[:, None, :, None] == seg[:, None, None, :]
    if causal:
        mask = mask & jnp.tril(jnp.ones((t, t), bool))[None, None]
    if window is not None:  # keys of its segment more than window - 1 back (counted in the segment) hidden
        same = seg[:, :, None] == seg[:, None, :]  # (B, T, T)
        rank = jnp.sum(same & jnp.tril(jnp.ones((t, t), bool))[None], -1) - 1  # (B, T): its segment's tokens before it
        mask = mask & (rank[:, :, None] - rank[:, None, :] < window)[:, None]
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(jnp.where(mask, s, -jnp.inf), -1), v)


def test_context_order_balances_the_causal_work():
    order = redeqx.context_order(16, 4)
    assert sorted(order) == list(range(16))
    per_shard = order.reshape(4, -1)
    assert [list(s) for s in per_shard[:2]] == [[0, 1, 14, 15], [2, 3, 12, 13]]
    assert len({int((s + 1).sum()) for s in per_shard}) == 1  # keys seen under a causal mask: equal per shard
    with pytest.raises(ValueError, match="multiple of 8"):
        redeqx.context_order(12, 4)


def test_make_mesh_context_axis(devices):
    assert redeqx.make_mesh(2).axis_names == ("data", "model")  # without it: as before
    mesh = redeqx.make_mesh(2, n_context_shards=2)
    assert mesh.axis_names == ("data", "context", "model") and dict(mesh.shape) == {"data": 2, "context": 2, "model": 2}
    assert redeqx.check_mesh(mesh) is mesh
    with pytest.raises(ValueError, match="n_context_shards=3"):
        redeqx.make_mesh(1, n_context_shards=3)
    with pytest.raises(ValueError, match="positive int"):
        redeqx.make_mesh(1, n_context_shards=0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("impl", ["gather", "ring", "heads"])
@pytest.mark.parametrize("block", [None, 2])  # 2: each shard's 4 queries and keys in blocks of 2
def test_attention_split_equals_one_device(monkeypatch, causal, impl, block):
    if block is not None:
        monkeypatch.setattr("redeqx.context._blockwise.BLOCK", block)
    (q, k, v, seg, weights), (want, want_grads) = _naive_case(causal, 16, 3, None)  # 3 padding tokens

    def loss(q, k, v, seg, weights):
        return jnp.sum(redeqx.attention(q, k, v, causal=causal, segment_ids=seg, impl=impl) * weights)

    plain = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, seg, weights)  # no mesh: plain attention
    np.testing.assert_allclose(plain[0], want, rtol=1e-5)
    mesh = _mesh(2, 2, 2)
    order = redeqx.context_order(16, 2)
    split = [jax.device_put(x[:, order], NamedSharding(mesh, P("data", "context"))) for x in (q, k, v, seg, weights)]
    with jax.set_mesh(mesh):
        got, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*split)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(g)[:, np.argsort(order)], w, atol=2e-5)


def _naive_loss(q, k, v, seg, weights, causal, window=None):
    return jnp.sum(_naive(q, k, v, seg, causal, window) * weights)


@functools.cache
def _naive_case(causal, t, padding, window, inner=0):
    """The inputs of an attention test (2 sequences of ``t`` tokens, the first ``padding`` of them
    and ``inner`` more in the middle a segment of their own) and the written-out attention's loss and
    gradients on them: computed once for every impl and block size that is compared with them
    (jitted: eagerly each op compiled alone)."""
    q, k, v = _qkv(jax.random.key(0), t=t)
    seg = np.r_[np.zeros(padding), np.ones(t - padding)].astype(np.int32)
    seg[(t + padding) // 2:(t + padding) // 2 + inner] = 0
    seg = jnp.asarray(seg)[None].repeat(2, 0)
    weights = jax.random.normal(jax.random.key(1), q.shape)
    naive = jax.jit(jax.value_and_grad(_naive_loss, argnums=(0, 1, 2)), static_argnums=(5, 6))
    return (q, k, v, seg, weights), naive(q, k, v, seg, weights, causal, window)


@pytest.mark.parametrize("impl", ["gather", "ring", "heads"])  # heads: 2 KV heads repeated over 4 shards
@pytest.mark.parametrize("window", [1, 3, 6, 40])  # 1: itself only; 40: longer than the sequence
def test_sliding_window_split_equals_one_device(monkeypatch, impl, window):
    """Blocks of 2 tokens over 4 shards: a window of 3 hides some pairs of
    every shard's table, unequally (the tables are padded with hidden pairs).
    Padding (a segment of 0s) leads the sequence and splits it at 18-21: the
    window counts a segment's tokens, so the 4 padding slots take no place in
    it (once they did, on every path)."""
    monkeypatch.setattr("redeqx.context._blockwise.BLOCK", 2)
    (q, k, v, seg, weights), (want, want_grads) = _naive_case(True, 32, 5, window, inner=4)

    def loss(q, k, v, seg, weights):
        return jnp.sum(redeqx.attention(q, k, v, segment_ids=seg, window=window, impl=impl) * weights)

    np.testing.assert_allclose(loss(q, k, v, seg, weights), want, rtol=1e-5)  # no mesh: plain attention
    mesh = _mesh(1, 4, 2)
    order = redeqx.context_order(32, 4)
    split = [jax.device_put(x[:, order], NamedSharding(mesh, P(None, "context"))) for x in (q, k, v, seg, weights)]
    with jax.set_mesh(mesh):
        got, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*split)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(g)[:, np.argsort(order)], w, atol=2e-5)
    with pytest.raises(ValueError, match="window=0"):
        redeqx.attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="causal=True"):
        redeqx.attention(q, k, v, causal=False, window=3)


def test_a_boolean_mask_and_numpy_ints_are_taken():
    """An attention mask serves as segment ids as it is (bool), and a window may be a NumPy int
    (a config read from a file); both were refused by the type checks."""
    (q, k, v, seg, _), _ = _naive_case(True, 32, 5, 3, inner=4)
    want = redeqx.attention(q, k, v, segment_ids=seg, window=3)
    np.testing.assert_array_equal(redeqx.attention(q, k, v, segment_ids=seg.astype(bool), window=np.int64(3)), want)
    np.testing.assert_array_equal(redeqx.attention(q, k, v, segment_ids=seg.astype(jnp.uint8), window=3), want)


def test_sliding_window_skips_the_blocks_behind_it():
    """Of a shard's block pairs, a window of one block keeps each query
    block's own and the one before it."""
    from redeqx.context._blockwise import Span, _pairs

    layout = redeqx.context_order(16, 2).reshape(2, -1)[:, ::2] // 2  # blocks of 2: shard 0 holds 0, 1, 6, 7
    everyone = layout.reshape(-1)
    kept = _pairs(layout[0], everyone, Span(True, 2), 2)
    assert sorted((int(layout[0][i]), int(everyone[j])) for i, j in kept) == [(0, 0), (1, 0), (1, 1), (6, 5), (6, 6),
                                                                               (7, 6), (7, 7)]


def test_ring_passes_kv_and_gather_gathers_them(getkey):
    q, k, v = _qkv(getkey(), b=1, t=32)
    mesh = _mesh(1, 8, 1)
    texts = {}
    for impl in ("gather", "ring"):
        sh = NamedSharding(mesh, P(None, "context"))
        with jax.set_mesh(mesh):
            f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(redeqx.attention(q, k, v, impl=impl) ** 2), argnums=(0, 1, 2)))
            texts[impl] = redeqx.collective_summary(f.lower(*(jax.device_put(x, sh) for x in (q, k, v))).compile().as_text())
    assert "all-gather" in texts["gather"] and "collective-permute" not in texts["gather"]
    assert "collective-permute" in texts["ring"] and "all-gather" not in texts["ring"]


@pytest.mark.parametrize("impl", ["gather", "ring"])
def test_causal_attention_skips_the_masked_blocks(getkey, monkeypatch, impl):
    """Blocks of 4 tokens, 2 to a chunk, 2 shards: of the 4 x 8 block pairs
    a shard could compute, the causal mask leaves 2C m^2 + m = 18 (the
    dual-chunk order gives each shard the same 18), so the step's FLOPs,
    loops counted as they run, are 18/32 of the unmasked step's."""
    from redeqx.planner._hlo import estimated_flops

    monkeypatch.setattr("redeqx.context._blockwise.BLOCK", 4)
    q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _qkv(getkey(), b=1, t=32))
    mesh = _mesh(1, 2, 1)
    flops = {}
    for causal in (True, False):
        f = jax.grad(lambda q, k, v: jnp.sum(redeqx.attention(q, k, v, causal=causal, impl=impl)), argnums=(0, 1, 2))
        with jax.set_mesh(mesh):
            lowered = jax.jit(f).lower(q, k, v)
        # the compiled program, and the lowered one plan reads (its loops' bounds wrapped by Shardy in a shard_map)
        flops[causal] = [estimated_flops(text) for text in (lowered.compile().as_text(), lowered.as_text(dialect="hlo"))]
    for skipped, whole in zip(flops[True], flops[False]):
        assert 0.5 < skipped / whole < 0.6, flops


def test_make_mesh_auto_searches_the_context_axis(devices):
    from redeqx.mesh._mesh import _candidates

    assert _candidates(8, "auto", "auto")[:6] == [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)]
    assert _candidates(8, 2, "auto") == [(2, 1), (2, 2), (2, 4)]
    config = models.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    batch = {k: jax.ShapeDtypeStruct((1, 1024), jnp.int32) for k in ("input_ids", "labels")}  # one long sequence

    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["input_ids"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    two = jax.devices()[:2]
    compiled = {}  # mesh shape -> its plan: each candidate mesh's step compiled once, whatever the device_memory

    def planner(mesh, device_memory, explore=False):  # redeqx.plan's keywords, as make_mesh passes them
        shape = tuple(dict(mesh.shape).items())
        if shape not in compiled:
            compiled[shape] = redeqx.plan(lambda key: models.LlamaForCausalLM(config, key=key), loss_fn,
                                          optax.adamw(1e-3), batch, mesh, seq_keys=("input_ids", "labels"),
                                          explore=False, device_memory=1e12)
        return dataclasses.replace(compiled[shape], device_memory=device_memory)

    split_model = planner(redeqx.make_mesh(2, devices=two), device_memory=1e12).peak
    split_seq = planner(redeqx.make_mesh(1, n_context_shards=2, devices=two), device_memory=1e12).peak
    assert split_seq < split_model  # a long sequence: splitting it saves more than splitting the weights
    between = functools.partial(planner, device_memory=(split_seq + split_model) // 2)
    mesh = redeqx.make_mesh("auto", n_context_shards="auto", devices=two, planner=between)
    assert dict(mesh.shape) == {"data": 1, "context": 2, "model": 1}
    with pytest.raises(ValueError, match="no n_model_shards / n_context_shards fits on these 2 devices"):
        redeqx.make_mesh("auto", n_context_shards="auto", devices=two, planner=functools.partial(planner, device_memory=1))
    with pytest.raises(ValueError, match='n_context_shards="auto" needs planner='):
        redeqx.make_mesh(1, n_context_shards="auto")


def test_batches_need_and_order_seq_keys(devices):
    mesh = _mesh(2, 2, 2)
    ex = [{"input_ids": np.arange(8) + 100 * i, "label": np.int32(i)} for i in range(4)]
    collate = lambda xs: {k: np.stack([x[k] for x in xs]) for k in xs[0]}  # noqa: E731
    with pytest.raises(ValueError, match="seq_keys"):
        next(redeqx.batches(ex, collate, 2, mesh))
    batch = next(redeqx.batches(ex, collate, 2, mesh, seq_keys=("input_ids",)))
    assert batch["input_ids"].sharding.spec == P("data", "context")
    np.testing.assert_array_equal(np.asarray(batch["input_ids"])[0], redeqx.context_order(8, 2))
    with pytest.raises(ValueError, match="multiple of 4"):
        next(redeqx.batches([{"input_ids": np.arange(6)}] * 4, collate, 2, mesh, seq_keys=("input_ids",)))
    with pytest.raises(KeyError, match="'ids'"):
        next(redeqx.batches(ex, collate, 2, mesh, seq_keys=("ids",)))


def test_a_per_token_key_left_out_of_seq_keys_is_an_error(devices):
    """labels left out of seq_keys stayed in their order while input_ids were reordered: the first loss was
    4.3078 against one device's 4.3550, without a word. A key whose dim 1 only happens to be as long says
    so with whole_keys."""
    mesh = _mesh(2, 2, 2)
    ex = [dict(e, features=np.arange(16.0)) for e in _examples()]  # (16,) per example, not per token
    with pytest.raises(ValueError, match=r"batch\['labels'\] has shape \(4, 16\).*add 'labels' to seq_keys"):
        next(redeqx.batches(ex, _collate, 2, mesh, seq_keys=("input_ids", "attention_mask"), whole_keys="features"))
    with pytest.raises(ValueError, match=r"batch\['features'\].*whole_keys=\('features',\)"):
        next(redeqx.batches(ex, _collate, 2, mesh, seq_keys=SEQ_KEYS))
    batch = next(redeqx.batches(ex, _collate, 2, mesh, seq_keys=SEQ_KEYS, whole_keys=("features",)))
    np.testing.assert_array_equal(np.asarray(batch["features"])[0], np.arange(16.0))  # kept whole, in its order
    assert batch["features"].sharding.spec == P("data", None)
    with pytest.raises(ValueError, match=r"\['labels'\] are in both seq_keys and whole_keys"):
        redeqx.batches(ex, _collate, 2, mesh, seq_keys=SEQ_KEYS, whole_keys=("labels",))
    with pytest.raises(KeyError, match="whole_keys names 'feature'"):
        next(redeqx.batches(ex, _collate, 2, mesh, seq_keys=SEQ_KEYS, whole_keys=("features", "feature")))
    # evaluate and predict make their batches the same way; plan checks the batch it is given
    model = eqx.filter_eval_shape(UserModel, True, jax.random.key(0))  # never run: the batch fails first
    specs = redeqx.sharding_rules(model, mesh)
    with pytest.raises(ValueError, match=r"batch\['labels'\]"):
        redeqx.evaluate(redeqx.make_eval_step(user_loss, mesh, specs), model, ex, _collate, 2, mesh,
                        key=jax.random.key(0), seq_keys=("input_ids", "attention_mask"), whole_keys="features")
    with pytest.raises(ValueError, match=r"batch\['labels'\]"):
        redeqx.predict(lambda *a: None, model, ex, _collate, 2, mesh, key=jax.random.key(0),
                       seq_keys=("input_ids", "attention_mask"), whole_keys="features")
    with pytest.raises(ValueError, match=r"batch\['labels'\]"):
        redeqx.plan(lambda key: UserModel(True, key), user_loss, optax.sgd(1e-3), _collate(_examples()), mesh,
                    seq_keys=("input_ids", "attention_mask"))
    without = redeqx.make_mesh(2)  # no reorder, nothing to misalign
    next(redeqx.batches(ex, _collate, 1, without, seq_keys=("input_ids",)))


# ----------------------------------------------------------------------------- training: like one device

CONFIG = models.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _examples(t=16, n=4):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (n, t + 1))
    mask = np.ones((n, t), bool)
    mask[0, :5] = False  # left padding
    mask[1, -3:] = False  # right padding
    mask[2, 7:10] = False  # padding inside: a sliding window does not count it
    return [dict(input_ids=ids[i, :-1], labels=ids[i, 1:], attention_mask=mask[i]) for i in range(n)]


def _collate(xs):
    return {k: np.stack([x[k] for x in xs]) for k in xs[0]}


def _token_mean(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"])
    w = batch["attention_mask"].astype(jnp.float32)
    return jnp.sum(ce * w) / jnp.sum(w)


def llama_loss(model, batch, key):
    logits = jax.vmap(lambda i, m: model(i, attention_mask=m))(batch["input_ids"], batch["attention_mask"])
    return _token_mean(logits, batch)


class UserModel(eqx.Module):
    """A user's own model: learned positions read through sequence_positions, redeqx.attention."""

    embed: eqx.nn.Embedding
    pos: jax.Array
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    out: eqx.nn.Linear
    head: eqx.nn.Linear
    causal: bool = eqx.field(static=True)

    def __init__(self, causal, key):
        k = jax.random.split(key, 7)
        self.embed = eqx.nn.Embedding(64, 32, key=k[0])
        self.pos = 0.1 * jax.random.normal(k[1], (16, 32))
        # no K bias: its gradient is zero up to rounding, which Adam would magnify into steps
        self.q, self.k, self.v = (eqx.nn.Linear(32, 32, use_bias=False, key=k[i]) for i in (2, 3, 4))
        self.out = eqx.nn.Linear(32, 32, key=k[5])
        self.head = eqx.nn.Linear(32, 64, key=k[6])
        self.causal = causal

    def __call__(self, ids, valid):
        t = ids.shape[0]
        x = jax.vmap(self.embed)(ids) + self.pos[redeqx.sequence_positions(t)]
        q, k, v = (jax.vmap(proj)(x).reshape(t, 4, 8) for proj in (self.q, self.k, self.v))
        a = redeqx.attention(q, k, v, causal=self.causal, segment_ids=valid.astype(jnp.int32))
        x = x + jax.vmap(self.out)(a.reshape(t, 32))
        return jax.vmap(self.head)(x)


def user_loss(model, batch, key):
    return _token_mean(jax.vmap(model)(batch["input_ids"], batch["attention_mask"]), batch)


def _train(make, loss_fn, mesh, seq_keys, steps=3, accumulate=1):
    model = make()
    specs = redeqx.sharding_rules(model, mesh)
    opt = optax.adamw(1e-2)
    state = redeqx.init_state(model, opt, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss_fn, opt, mesh, specs, accumulate=accumulate)
    ex, losses = _examples(), []
    for _ in range(steps):
        for batch in redeqx.batches(ex, _collate, len(ex) // mesh.shape["data"], mesh, seq_keys=seq_keys):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return losses, jax.tree.leaves(eqx.filter(state.model, eqx.is_array))


_ONE_DEVICE = {}  # reference name -> one device's losses and parameters


def _like_one_device(make, loss_fn, shape, accumulate=1, reference=None):
    """Trains like one device on ``_mesh(*shape)``. The one-device run is computed once per
    ``reference`` name (given where several cases train the same model with the same loss)."""
    if reference is None or reference not in _ONE_DEVICE:
        one = _train(make, loss_fn, redeqx.make_mesh(1, devices=jax.devices()[:1]), None, accumulate=accumulate)
        if reference is not None:
            _ONE_DEVICE[reference] = one
    want, want_params = one if reference is None else _ONE_DEVICE[reference]
    got, params = _train(make, loss_fn, _mesh(*shape), SEQ_KEYS, accumulate=accumulate)
    np.testing.assert_allclose(got, want, rtol=2e-5)
    for a, b in zip(params, want_params):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


class HandMadeModel(UserModel):
    """UserModel with what one device allows and a split does not: positions from jnp.arange, attention by
    hand with a jnp.tril causal mask. It trains 4e-5 to 7e-4 off one device on a context mesh, silently."""

    def __call__(self, ids, valid):
        t = ids.shape[0]
        x = jax.vmap(self.embed)(ids) + self.pos[jnp.arange(t)]
        q, k, v = (jax.vmap(proj)(x).reshape(t, 4, 8) for proj in (self.q, self.k, self.v))
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), jnp.einsum("thd,shd->hts", q, k) / np.sqrt(8), -1e9)
        a = jnp.einsum("hts,shd->thd", jax.nn.softmax(s, -1), v)
        return jax.vmap(self.head)(x + jax.vmap(self.out)(a.reshape(t, 32)))


def shifting_loss(model, batch, key):
    """Labels shifted in loss_fn: logits[:, :-1] against input_ids[:, 1:]."""
    logits = jax.vmap(model)(batch["input_ids"], batch["attention_mask"])
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["input_ids"][:, 1:]).mean()


def cutting_loss(model, batch, key):
    """The input cut in loss_fn to shift it: input_ids[:, :-1] into the model."""
    ids = batch["input_ids"]
    logits = jax.vmap(lambda i: model(i, attention_mask=None))(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def _traced_step(make, loss_fn, mesh):
    """The train step traced on a split batch (its program is read there; nothing built or compiled)."""
    model = eqx.filter_eval_shape(make, jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.sgd(1e-2), mesh, specs, key=jax.random.key(1))
    batch = next(redeqx.batches(_examples(), _collate, 4 // mesh.shape["data"], mesh, seq_keys=SEQ_KEYS))
    return redeqx.make_train_step(loss_fn, optax.sgd(1e-2), mesh, specs).trace(state, batch)


def test_a_step_that_reads_places_as_positions_warns(devices):
    mesh = _mesh(1, 2, 1)
    with pytest.warns(UserWarning) as record:
        _traced_step(functools.partial(HandMadeModel, True), user_loss, mesh)
    said = [str(w.message) for w in record if str(w.message).startswith("redeqx: the step")]
    assert len(said) == 2, said
    assert "never calls redeqx.attention" in said[0] and "redeqx.attention(q, k, v, causal=True)" in said[0]
    assert "iota of shape (16,)" in said[1] and "redeqx.sequence_positions(T)" in said[1]
    with pytest.warns(UserWarning, match=r"cuts a split sequence at a fixed place \(\(4, 16, 64\) -> \(4, 15, 64\)"):
        _traced_step(functools.partial(UserModel, True), shifting_loss, mesh)
    _traced_step(functools.partial(UserModel, True), user_loss, mesh)  # done right: silent (pytestmark)


def test_input_cut_in_loss_fn_names_the_cut_not_collate_fn(devices):
    """input_ids[:, :-1] in loss_fn reached the split as 15 tokens, and the error said to pad the sequence
    in collate_fn, whose sequences were 16 tokens long."""
    with pytest.raises(ValueError, match=r"15 tokens inside the step, but the batch's sequences \(seq_keys\) are 16 "
                                         r"tokens long.*cut inside loss_fn.*Shift in collate_fn instead"):
        _traced_step(lambda key: models.LlamaForCausalLM(CONFIG, key=key), cutting_loss, _mesh(1, 2, 1))
    with pytest.raises(ValueError, match="pad the sequence to a multiple of 4 tokens in collate_fn"):  # a real one
        next(redeqx.batches([{"input_ids": np.arange(6)}] * 2, _collate, 2, _mesh(1, 2, 1), seq_keys=("input_ids",)))


# LLaMA on the two meshes that hold every split (the ring, which equals the gather as tested above on the
# attention alone, included): (1, 8, 1), the longest ring and most context shards, and (2, 2, 2), context
# mixed with data and model. The meshes between, (2, 4, 1) and (1, 4, 2), run the same split code (batches,
# redeqx.attention, sequence_positions) with the user's model below on every mesh.
SPLITS = [(shape, impl) for shape in ((1, 8, 1), (2, 2, 2)) for impl in ("gather", "ring")] + [((2, 2, 2), "heads")]


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "impl"), SPLITS)
def test_llama_trains_like_one_device_every_split(devices, shape, impl):
    config = models.LlamaConfig(**{**CONFIG.__dict__, "context_attention": impl})
    # one device has no context axis, where redeqx.attention runs the same plain attention for either impl:
    # one reference for every split
    _like_one_device(lambda: models.LlamaForCausalLM(config, key=jax.random.key(0)), llama_loss, shape,
                     reference="llama")


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "causal"), [(shape, True) for shape in MESHES] + [((1, 8, 1), False), ((2, 2, 2), False)])
def test_users_model_trains_like_one_device(devices, shape, causal):
    _like_one_device(lambda: UserModel(causal, jax.random.key(0)), user_loss, shape, reference=("user", causal))


@pytest.mark.slow
def test_llama_accumulates_split_micro_batches(devices):
    _like_one_device(lambda: models.LlamaForCausalLM(CONFIG, key=jax.random.key(0)), llama_loss, (2, 2, 2),
                     accumulate=2)


def test_restore_order_undoes_the_split(devices):
    x = np.arange(2 * 16).reshape(2, 16)
    mesh = _mesh(1, 4, 2)
    split = x[:, redeqx.context_order(16, 4)]
    np.testing.assert_array_equal(redeqx.restore_order(split, mesh), x)
    np.testing.assert_array_equal(redeqx.restore_order(jnp.asarray(split), mesh), x)
    np.testing.assert_array_equal(redeqx.restore_order(x, redeqx.make_mesh(2)), x)


class LongAttention(eqx.Module):
    """One non-causal attention layer over a long sequence: attention is most of its FLOPs."""

    embed: eqx.nn.Embedding
    qkv: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(64, 32, key=k[0])
        self.qkv = eqx.nn.Linear(32, 96, use_bias=False, key=k[1])
        self.head = eqx.nn.Linear(32, 64, key=k[2])

    def __call__(self, ids):
        t = ids.shape[0]
        x = jax.vmap(self.embed)(ids)
        q, k, v = jnp.split(jax.vmap(self.qkv)(x).reshape(t, 3, 4, 8), 3, axis=1)
        return jax.vmap(self.head)(x + redeqx.attention(q[:, 0], k[:, 0], v[:, 0], causal=False).reshape(t, 32))


def test_plan_counts_a_split_attention_by_its_share(devices):
    """Split over 2, 4 and 8 context shards (unmasked: every block computed on each), a device does half
    the FLOPs at twice the shards. The plan once scaled XLA's count by loops read from the lowered
    program, whose shard_map body has each device's shapes and the rest the global ones: 4.1e9, 1.5e9
    and 3.7e8 here, a third low at 8 shards (and a LLaMA on libtpu up to 40% low). It reads them from
    the compiled program now."""
    batch = {k: jax.ShapeDtypeStruct((1, 4096), jnp.int32) for k in ("input_ids", "labels")}

    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["input_ids"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    flops = [redeqx.plan(LongAttention, loss_fn, optax.sgd(1e-3), batch, _mesh(1, c, 1), explore=False,
                         seq_keys=("input_ids", "labels")).flops for c in (2, 4, 8)]
    assert flops[0] == pytest.approx(2 * flops[1], rel=0.02) and flops[0] == pytest.approx(4 * flops[2], rel=0.02), flops


STEPPED_LOOP = """HloModule m

%cond (p: (u32[], f32[4,4])) -> pred[] {
  %p = (u32[], f32[4,4]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %n = u32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (u32[], f32[4,4])) -> (u32[], f32[4,4]) {
  %p = (u32[], f32[4,4]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %x = f32[4,4] get-tuple-element(%p), index=1
  %d = f32[4,4] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %k = f32[4,4] custom-call(%d), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"TUxJUg==","cost_estimate":{"flops":"1000","transcendentals":"0"}}}
  %step = u32[] constant(STEP)
  %j = u32[] add(%i, %step)
  ROOT %t = (u32[], f32[4,4]) tuple(%j, %k)
}

%batched (a: f32[8,16,1], b: f32[8,2,16]) -> f32[8,8,2] {
  %a = f32[8,16,1] parameter(0)
  %b = f32[8,2,16] parameter(1)
  ROOT %c = f32[8,8,2] convolution(%a, %b), window={size=2 pad=1_1 rhs_reversal=1}, dim_labels=bf0_o0i->bf0
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4] parameter(0)
  %start = u32[] constant(START)
  %c = u32[] copy(%start)
  %init = (u32[], f32[4,4]) tuple(%c, %a)
  %w = (u32[], f32[4,4]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4,4] get-tuple-element(%w), index=1
}
"""


@pytest.mark.parametrize("start, step, trips", [(0, 1, 8), (0, 2, 4), (2, 3, 2)])
def test_a_loop_stepping_by_more_than_one_is_counted_by_its_trips(start, step, trips):
    """libtpu rewrites a loop to step its counter by 2 (or more) from a constant start: the plan counted
    such a loop's body (bound - 0) / 1 times, twice a loop-split matmul's FLOPs. A batched matmul that
    libtpu writes as a convolution, its window standing for the batch dim, counts one tap per output; a
    Pallas kernel (megablox's grouped matmul) by the cost estimate it carries, once per trip."""
    from redeqx.planner._hlo import _flops, estimated_flops, executions, parse_module

    text = STEPPED_LOOP.replace("START", str(start)).replace("STEP", str(step))
    computations, params, entry = parse_module(text)
    assert executions(computations, entry)["body"] == trips
    assert estimated_flops(text, ("custom-call",)) == 1000 * trips
    shapes = {**params["batched"], **{i.name: i.shape for i in computations["batched"]}}
    conv = computations["batched"][-1]
    assert _flops(conv, shapes) == 2 * 8 * 8 * 2 * 16  # 8 x (8, 2) outputs, each 16 multiply-adds, one tap


def test_auto_picks_gather_off_a_gpu_and_heads_where_cudnn_runs(monkeypatch):
    from redeqx.context import _context

    q = jnp.zeros((16, 4, 8), jnp.bfloat16)
    plain, window = _context.Span(True, None), _context.Span(True, 4)
    assert _context.auto_impl(q, None, plain, 2) == "gather"  # a CPU: blockwise, gathered
    monkeypatch.setattr(_context, "traced_platform", lambda: "gpu")
    assert _context.auto_impl(q, None, plain, 2) == "heads"
    assert _context.auto_impl(q, None, window, 2) == "gather"  # cuDNN would not run: no (T, T) scores
    assert _context.auto_impl(q, jnp.zeros(16, jnp.int32), plain, 2) == "gather"
    assert _context.auto_impl(q.astype(jnp.float32), None, plain, 2) == "gather"
    assert _context.auto_impl(q, None, plain, 8) == "gather"  # 4 heads do not split 8 ways


def test_the_unsplit_path_asks_for_cudnn_by_name_on_a_gpu(monkeypatch):
    """jax.nn.dot_product_attention's default implementation (None) is its XLA code, which forms the
    (T, T) scores: a GPU gets cuDNN's flash attention only when it is named. Before, the heads split's
    attention compiled for 4 H100s at 32k tokens held 112 GiB of temporaries and no cuDNN call
    (`python -m benchmarks.gpu_compile --sections heads`); with the name, 225 MiB and two."""
    from redeqx.context import _context

    calls = []

    def spy(q, k, v, **kw):
        calls.append(kw.get("implementation"))
        return q

    monkeypatch.setattr(_context, "traced_platform", lambda: "gpu")
    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    q = jnp.zeros((16, 4, 8), jnp.bfloat16)
    _context._by_kernel(q, q, q, None, _context.Span(True, None), 0.1)
    assert calls == ["cudnn"]


def test_heads_split_refuses_heads_the_shards_do_not_divide():
    q, k, v = (x[0] for x in _qkv(jax.random.key(0)))  # 4 query heads, 16 tokens
    with jax.set_mesh(_mesh(1, 8, 1)), pytest.raises(ValueError, match=r"impl='heads'.*4 query heads do not split "
                                                                        r"over 8 context shards.*'gather' or 'ring'"):
        redeqx.attention(q, k, v, impl="heads")


def test_heads_split_repeats_kv_heads_only_as_far_as_the_shards_need(monkeypatch):
    """8 query and 2 KV heads over 4 shards: 4 KV heads traded (each device gets the one its two query
    heads read), not 8; the gradient is one device's, and the all-to-alls move less than a repeat to
    one KV head per query head."""
    from redeqx.context import _context

    assert _context.kv_heads_for_split(jnp.zeros((16, 2, 8)), 4).shape == (16, 4, 8)
    assert _context.kv_heads_for_split(jnp.zeros((16, 8, 8)), 4).shape == (16, 8, 8)  # divides: as it is
    assert _context.kv_heads_for_split(jnp.zeros((16, 6, 8)), 4).shape == (16, 12, 8)  # gcd 2: twice
    q, k, v = _qkv(jax.random.key(0), hq=8, hkv=2)
    weights = jax.random.normal(jax.random.key(1), q.shape)

    def loss(q, k, v, weights):
        return jnp.sum(redeqx.attention(q, k, v, impl="heads") * weights)

    seg = jnp.zeros(q.shape[:2], jnp.int32)
    want, want_grads = jax.jit(jax.value_and_grad(
        lambda q, k, v: _naive_loss(q, k, v, seg, weights, True), argnums=(0, 1, 2)))(q, k, v)
    mesh, order = _mesh(2, 4, 1), redeqx.context_order(16, 4)
    split = [jax.device_put(x[:, order], NamedSharding(mesh, P("data", "context"))) for x in (q, k, v, weights)]
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    with jax.set_mesh(mesh):
        got, grads = step(*split)
        moved = redeqx.collective_summary(step, *split)["all-to-all"]["bytes"]
        monkeypatch.setattr(_context, "kv_heads_for_split", lambda x, n: jnp.repeat(x, 4, axis=1))
        per_query_head = redeqx.collective_summary(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), *split)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(g)[:, np.argsort(order)], w, atol=2e-5)
    assert moved < per_query_head["all-to-all"]["bytes"]


@pytest.mark.parametrize("t, n", [(16, 4), (32, 2), (8, 1), (64, 8)])
def test_heads_split_reorders_by_concatenation_as_the_permutation_does(t, n):
    """Shard i holds chunks i and 2n - 1 - i, written out here by position (context_order itself is
    built by in_layout_order)."""
    from redeqx.context._context import in_layout_order, in_sequence_order

    c = t // (2 * n)
    order = np.concatenate([np.r_[i * c:(i + 1) * c, (2 * n - 1 - i) * c:(2 * n - i) * c] for i in range(n)])
    np.testing.assert_array_equal(redeqx.context_order(t, n), order)
    x = np.arange(t * 3).reshape(t, 3)
    np.testing.assert_array_equal(in_sequence_order(jnp.asarray(x[order]), n), x)
    np.testing.assert_array_equal(in_layout_order(jnp.asarray(x), n), x[order])


def test_heads_split_never_forms_the_whole_scores_where_cudnn_does_not_run(monkeypatch):
    """Off a GPU the heads split attends its heads a block at a time, as gather and ring do: the
    (T, T) scores of its heads (33.2 GiB of temporaries for an 8B layer at 32k tokens on 8 TPU v4
    chips) are never formed."""
    monkeypatch.setattr("redeqx.context._blockwise.BLOCK", 4)
    q, k, v = (x[:1] for x in _qkv(jax.random.key(0), t=32))

    def grads(q, k, v):
        return jax.grad(lambda *a: jnp.sum(redeqx.attention(*a, impl="heads")), argnums=(0, 1, 2))(q, k, v)

    with jax.set_mesh(_mesh(1, 4, 1)):
        program = str(jax.make_jaxpr(grads)(q, k, v))
    assert "all_to_all" in program and not re.search(r"\b32,32\]", program)
