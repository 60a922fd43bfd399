"""T5 against Transformers' PyTorch reference (tiny random v1.0- and
v1.1-style configs built and saved here: no download)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from megatron_count import megatron_bytes_encoder_decoder, step_at_4_shards_vs_one_device, gradient_bytes, near_megatron

import redeqx
from _helpers import hf_checkpoints, one_device, redeqx_logits, seq2seq_inputs, torch_logits
from redeqx.models import (
    T5Config,
    T5ForConditionalGeneration,
    beam_search,
    from_pretrained,
    generate,
    sample,
    save_pretrained,
    shift_right,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64
# 8 buckets up to distance 20: sequences of 12+ tokens reach the log-spaced and the last buckets
SIZES = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
             relative_attention_num_buckets=8, relative_attention_max_distance=20)


def _hf_model(kind):
    torch.manual_seed(0)
    if kind == "v1":  # ReLU FF, LM head tied to `shared` and scaled by 1/sqrt(d_model)
        config = transformers.T5Config(**SIZES, feed_forward_proj="relu", decoder_start_token_id=0)
    else:  # v1.1: gated GELU, its own LM head, no scaling
        config = transformers.T5Config(**SIZES, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                       decoder_start_token_id=0)
    hf = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        if kind == "v11":  # Transformers 5 ties the head in memory; give it weights of its own
            hf.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, SIZES["d_model"]))
        for name, p in hf.named_parameters():  # non-trivial norms, so a wrong mapping shows
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return hf_checkpoints(tmp_path_factory, _hf_model, ("v1", "v11"))


_inputs = partial(seq2seq_inputs, VOCAB, low=2, pad_id=0, n_pad=5, src=16, tgt=13)


@pytest.mark.parametrize("kind", ["v1", "v11"])
def test_logits_match_transformers(checkpoints, kind):
    d, hf = checkpoints[kind]
    model = from_pretrained(d, one_device())
    assert model.config.tie_word_embeddings == (kind == "v1")
    assert model.config.gated == (kind == "v11")
    ids, mask, dec = _inputs()
    np.testing.assert_allclose(redeqx_logits(model, ids, mask, dec), torch_logits(hf, ids, mask, dec),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["v1", "v11"])
def test_save_pretrained_round_trip(checkpoints, kind, tmp_path):
    d, hf = checkpoints[kind]
    save_pretrained(from_pretrained(d, redeqx.make_mesh(2)), tmp_path)
    again = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    ids, mask, dec = _inputs(seed=1)
    np.testing.assert_allclose(torch_logits(again, ids, mask, dec), torch_logits(hf, ids, mask, dec),
                               atol=1e-5, rtol=0)


@pytest.mark.slow
def test_forward_agrees_across_model_shards(checkpoints):
    d, _ = checkpoints["v11"]
    ids, mask, dec = _inputs(batch=8)
    outs = {n: redeqx_logits(from_pretrained(d, redeqx.make_mesh(n)), ids, mask, dec) for n in (1, 2, 4)}
    # the untied head's logits reach ~15: float32 sums in another order differ by a few 1e-6 of that
    np.testing.assert_allclose(outs[2], outs[1], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(outs[4], outs[1], atol=1e-5, rtol=1e-5)


def _hf_generate(hf, ids, mask, **kw):
    # use_cache=False: Transformers 5 sizes T5's decoding cache by the encoder's
    # layer count and fails when the decoder has more layers, as here
    kw = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0, "use_cache": False, **kw}
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), **kw).numpy()
    return out[:, 1:]  # drop the decoder start token


@pytest.mark.slow
def test_beam_search_and_eos_match_transformers(checkpoints):
    d, hf = checkpoints["v1"]
    ids, mask, _ = _inputs()
    model = from_pretrained(d, one_device())
    ref = _hf_generate(hf, ids, mask, max_new_tokens=6, num_beams=3, length_penalty=1.0, early_stopping=False)
    out = jax.jit(lambda m, i, a: beam_search(m, i, attention_mask=a, max_new_tokens=6, num_beams=3))(
        model, ids, mask.astype(bool))
    np.testing.assert_array_equal(np.asarray(out), ref)
    greedy = _hf_generate(hf, ids, mask, max_new_tokens=8)
    eos = int(greedy[0, 2])
    first = int(np.argmax(greedy[0] == eos))  # where row 0 first emits it
    ref = _hf_generate(hf, ids, mask, max_new_tokens=8, eos_token_id=eos)
    out = np.asarray(jax.jit(lambda m, i, a: generate(m, i, attention_mask=a, max_new_tokens=8, eos_token_id=eos))(
        model, ids, mask.astype(bool)))
    np.testing.assert_array_equal(out[:, :ref.shape[1]], ref)
    assert out[0, first] == eos and (out[0, first + 1:] == 0).all()
    # sampling goes through the same prefill/decode; top_k=1 is greedy
    top1 = jax.jit(lambda m, i, a, k: generate(m, i, attention_mask=a, max_new_tokens=8, sampler=sample(top_k=1), key=k))(
        model, ids, mask.astype(bool), jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(top1), greedy)


def test_decode_with_cache_equals_full_forward(getkey):
    model = T5ForConditionalGeneration(T5Config(**SIZES, feed_forward_proj="gated-gelu"), key=getkey())
    ids, mask, dec = (jnp.asarray(a[1]) for a in _inputs())
    mask = mask.astype(bool)
    full = jax.jit(lambda m: m(ids, dec, attention_mask=mask))(model)
    cache = jax.jit(lambda m: m.init_cache(m.encode(ids, mask), mask, 16))(model)
    decode = jax.jit(lambda m, i, c: m.decode(i, c))
    first, cache = decode(model, dec[:5], cache)
    rest = []
    for t in range(5, dec.shape[0]):
        logits, cache = decode(model, dec[t:t + 1], cache)
        rest.append(logits)
    np.testing.assert_allclose(jnp.concatenate([first, *rest]), full, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_remat_and_bf16(checkpoints, getkey):
    config = T5Config(**SIZES)
    key = getkey()
    plain = T5ForConditionalGeneration(config, key=key)
    ids, mask, dec = (jnp.asarray(a) for a in _inputs())

    def loss(m):
        logits = jax.vmap(lambda i, a, d: m(i, shift_right(d, config), attention_mask=a))(ids, mask.astype(bool), dec)
        return optax.softmax_cross_entropy_with_integer_labels(logits, dec).mean()

    for a, b in zip(jax.tree.leaves(jax.jit(jax.grad(loss))(plain)),
                    jax.tree.leaves(jax.jit(jax.grad(redeqx.remat(loss)))(plain))):
        np.testing.assert_allclose(a, b, atol=1e-6)

    d, hf = checkpoints["v11"]
    model = from_pretrained(d, redeqx.make_mesh(2), dtype=jnp.bfloat16)
    assert model.decoder.block.layer[2].DenseReluDense.wi_0.weight.dtype == jnp.bfloat16  # stacked, the default
    ids, mask, dec = _inputs()
    out = redeqx_logits(model, ids, mask, dec)
    assert out.dtype == jnp.bfloat16
    ref = torch_logits(hf, ids, mask, dec)
    assert np.abs(np.asarray(out, np.float32) - ref).max() < 0.05 * np.abs(ref).max()


def test_shift_right_and_config_errors():
    config = T5Config(**SIZES)
    np.testing.assert_array_equal(shift_right(jnp.asarray([[5, 6, -100]]), config), [[0, 5, 6]])
    # a Transformers 4 config.json says untied (and so unscaled) outright; Transformers 5's
    # always says tied, and the checkpoint's own lm_head.weight is what unties it
    hf4 = T5Config.from_hf({**SIZES, "tie_word_embeddings": False, "feed_forward_proj": "gated-gelu"})
    assert not hf4.tie_word_embeddings and not hf4.scale_head and hf4.activation == "gelu_new"
    hf5 = T5Config.from_hf_checkpoint({**SIZES, "tie_word_embeddings": True, "scale_decoder_outputs": False},
                                      {"shared.weight", "lm_head.weight"})
    assert not hf5.tie_word_embeddings and not hf5.scale_head
    assert T5Config.from_hf({**SIZES}).scale_head
    with pytest.raises(ValueError, match="feed_forward_proj='gated-swish'"):
        T5Config(feed_forward_proj="gated-swish")
    with pytest.raises(ValueError, match="d_kv must be a positive int"):
        T5Config(d_kv=0)
    model = T5ForConditionalGeneration(T5Config(**SIZES), key=jax.random.key(0))
    cache = model.init_cache(jnp.zeros((4, SIZES["d_model"])), jnp.ones((4,), bool), 2)
    with pytest.raises(ValueError, match="max_len=2"):
        model.decode(jnp.zeros((3,), jnp.int32), cache)
    with pytest.raises(ValueError, match="attention_mask is for the encoder"):
        model.decode(jnp.zeros((1,), jnp.int32), cache, attention_mask=jnp.ones((1,), bool))


@pytest.mark.slow
def test_train_step_communication_is_megatron_and_matches_one_device(getkey):
    config = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=True)
    model = T5ForConditionalGeneration(config, key=getkey())
    optimizer = optax.sgd(0.1)
    rs = np.random.RandomState(0)
    src, tgt = rs.randint(2, 256, (8, 16)), rs.randint(2, 256, (8, 12))

    def loss_fn(m, batch, key):
        logits = jax.vmap(lambda s, d: m(s, shift_right(d, config)))(batch["src"], batch["tgt"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt"]).mean()

    mesh, state4, summary = step_at_4_shards_vs_one_device(model, optimizer, loss_fn, {"src": src, "tgt": tgt})

    grad_bytes = gradient_bytes(state4.model)
    analytic = megatron_bytes_encoder_decoder(config.d_model, config.num_layers, config.n_decoder_layers,
                                              8 // mesh.shape["data"], src.shape[1], tgt.shape[1], grad_bytes)
    # Measured 1.06x: the activation all-reduces are Megatron's exactly; the data-parallel
    # gradient reduction also carries `shared`'s gradient three times (two lookups and the
    # tied head, reduced before XLA adds them) and the per-position relative bias gradients.
    near_megatron(summary, analytic, "T5")


@pytest.mark.parametrize("kind", ["v1", "v11"])
def test_initialisation_is_t5s_own(kind, getkey):
    """Built from a config, every tensor has the spread Transformers gives it (T5 does not scale its
    attention scores, so q's init does; N(0, 0.02) everywhere leaves a from-scratch decoder ignoring
    the encoder)."""
    sizes = {**SIZES, "d_model": 64, "d_ff": 96, "vocab_size": 256, "initializer_factor": 0.5}
    extra = {"feed_forward_proj": "relu"} if kind == "v1" else {"feed_forward_proj": "gated-gelu",
                                                                "tie_word_embeddings": False}
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(**sizes, **extra))
    ours = T5ForConditionalGeneration(T5Config(**sizes, **extra, scan_layers=False), key=getkey())  # per-layer names
    theirs = {n: p.detach().numpy() for n, p in hf.named_parameters()}
    leaves = jax.tree_util.tree_flatten_with_path(ours)[0]
    checked = 0
    for path, x in leaves:
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        if name not in theirs:
            continue
        want, got = float(np.std(theirs[name])), float(np.std(np.asarray(x)))
        rel = 0.2 if x.size >= 1000 else 0.6  # the bias table has 32 entries: its spread is noisy
        assert got == pytest.approx(want, rel=rel), (name, got, want)
        checked += 1
    assert checked >= 20
