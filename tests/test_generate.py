"""Generation with a KV cache against Transformers' ``generate`` (tiny random
LLaMA built and saved here: no download)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import redeqx
from redeqx import models
from redeqx.models import beam_search, from_pretrained, generate, greedy, sample

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, PROMPT = 64, 7


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf = transformers.LlamaForCausalLM(config).eval()
    d = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(d)
    return d, hf


def _prompts(batch=2, seed=0):
    return np.random.RandomState(seed).randint(3, VOCAB, (batch, PROMPT))


def _hf_generate(hf, ids, mask=None, **kw):
    kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None, **kw}
    with torch.no_grad():
        out = hf.generate(torch.tensor(ids), attention_mask=None if mask is None else torch.tensor(mask), **kw)
    return out.numpy()[:, ids.shape[1]:]


@pytest.mark.slow
def test_greedy_matches_transformers_sharded_as_pred_fn(llama):
    d, hf = llama
    ids = _prompts()
    ref = _hf_generate(hf, ids, max_new_tokens=10)
    mesh = redeqx.make_mesh(2)
    model = from_pretrained(d, mesh)
    specs = redeqx.sharding_rules(model, mesh)

    def pred_fn(model, batch, key):
        return generate(model, batch["input_ids"], max_new_tokens=10)

    predict_step = redeqx.make_predict_step(pred_fn, mesh, specs)
    batch = {"input_ids": jnp.asarray(np.concatenate([ids] * 4))}  # 8 rows: 2 per data shard
    out = np.asarray(predict_step(model, batch, jax.random.key(0)))
    np.testing.assert_array_equal(out[:2], ref)
    np.testing.assert_array_equal(out[2:4], ref)


def test_greedy_stops_at_eos_and_pads(llama):
    d, hf = llama
    ids = _prompts()
    eos = int(_hf_generate(hf, ids, max_new_tokens=10)[0, 3])
    ref = _hf_generate(hf, ids, max_new_tokens=10, eos_token_id=eos)
    model = from_pretrained(d, redeqx.make_mesh(1, devices=jax.devices()[:1]))
    out = np.asarray(jax.jit(lambda m, i: generate(m, i, max_new_tokens=10, eos_token_id=eos))(model, ids))
    np.testing.assert_array_equal(out[:, :ref.shape[1]], ref)
    assert out[0, 3] == eos and (out[0, 4:] == 0).all()


def test_left_padded_prompts_match_transformers(llama):
    d, hf = llama
    ids = _prompts()
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is 4 tokens, left-padded
    ids[1, :3] = 0
    ref = _hf_generate(hf, ids, mask, max_new_tokens=8)
    model = from_pretrained(d, redeqx.make_mesh(1, devices=jax.devices()[:1]))
    out = jax.jit(lambda m, i, a: generate(m, i, attention_mask=a, max_new_tokens=8))(model, ids, mask.astype(bool))
    np.testing.assert_array_equal(np.asarray(out), ref)


@pytest.mark.slow
def test_right_and_inner_padding_generate_as_the_bare_prompt(llama):
    """Padding anywhere in a prompt is skipped: the first new token comes from
    the last real token's logits (prefill once took the last slot's, a pad's
    for a right-padded prompt, and generated from it silently)."""
    d, hf = llama
    ids = _prompts(1)[0, :4]
    ref = _hf_generate(hf, ids[None], max_new_tokens=8)[0]
    pad = 0
    rows = {"left": [pad, pad, *ids], "right": [*ids, pad, pad], "inner": [ids[0], pad, *ids[1:3], pad, ids[3]]}
    batch = np.array(list(rows.values()))
    mask = batch != pad
    model = from_pretrained(d, redeqx.make_mesh(1, devices=jax.devices()[:1]))
    out = np.asarray(jax.jit(lambda m, i, a: generate(m, i, attention_mask=a, max_new_tokens=8))(model, batch, mask))
    for name, row in zip(rows, out):
        np.testing.assert_array_equal(row, ref, err_msg=f"{name}-padded prompt")
    beams = jax.jit(lambda m, i, a: beam_search(m, i, attention_mask=a, max_new_tokens=5, num_beams=3))
    bare = np.asarray(beams(model, ids[None], np.ones((1, 4), bool)))[0]
    for name, row in zip(rows, np.asarray(beams(model, batch, mask))):
        np.testing.assert_array_equal(row, bare, err_msg=f"{name}-padded prompt, beam search")


def test_a_sliding_window_counts_real_tokens_not_padding_slots():
    """Mistral's window over a padded prompt: padding between a prompt and its new tokens (right
    padding), on both sides or inside takes no place in the window. The window once counted slots:
    right- and both-side-padded rows generated other tokens than the bare prompt, silently, and a
    forward with inner padding gave logits off by 0.16 (a window of 4 here)."""
    config = models.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                                use_sliding_window=True, max_position_embeddings=64)
    model = models.LlamaForCausalLM(config, key=jax.random.key(0))
    ids = _prompts(1)[0]
    pad = 0
    rows = {"left": [pad, pad, pad, *ids], "right": [*ids, pad, pad, pad], "both": [pad, *ids, pad, pad],
            "inner": [*ids[:3], pad, pad, *ids[3:], pad]}
    batch = np.array(list(rows.values()))
    run = jax.jit(lambda m, i, a: generate(m, i, attention_mask=a, max_new_tokens=6))
    bare = np.asarray(run(model, ids[None], np.ones((1, PROMPT), bool)))[0]
    for name, row in zip(rows, np.asarray(run(model, batch, batch != pad))):
        np.testing.assert_array_equal(row, bare, err_msg=f"{name}-padded prompt")
    inner = np.array(rows["inner"])
    logits = jax.jit(lambda m, i, a: m(i, attention_mask=a))(model, inner, inner != pad)
    np.testing.assert_allclose(np.asarray(logits)[inner != pad], np.asarray(jax.jit(lambda m, i: m(i))(model, ids)), atol=1e-5)


@pytest.mark.slow
def test_beam_search_matches_transformers(llama):
    d, hf = llama
    ids = _prompts()
    ref = _hf_generate(hf, ids, max_new_tokens=6, num_beams=3, length_penalty=1.0, early_stopping=False)
    model = from_pretrained(d, redeqx.make_mesh(2))
    out = jax.jit(lambda m, i: beam_search(m, i, max_new_tokens=6, num_beams=3))(model, jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(out), ref)
    one = jax.jit(lambda m, i: beam_search(m, i, max_new_tokens=6, num_beams=1))(model, jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(one), np.asarray(generate(model, jnp.asarray(ids), max_new_tokens=6)))


@pytest.mark.slow
def test_sampling_respects_top_k_top_p_and_key(llama):
    d, _ = llama
    model = from_pretrained(d, redeqx.make_mesh(1, devices=jax.devices()[:1]))
    ids = jnp.asarray(_prompts(batch=4))
    run = jax.jit(lambda m, k, s: generate(m, ids, max_new_tokens=8, sampler=s, key=k), static_argnums=2)
    greedy_out = generate(model, ids, max_new_tokens=8, sampler=greedy())
    np.testing.assert_array_equal(run(model, jax.random.key(0), sample(top_k=1)), greedy_out)
    np.testing.assert_array_equal(run(model, jax.random.key(0), sample(top_p=1e-6)), greedy_out)
    s = sample(temperature=1.5, top_k=5, top_p=0.9)
    a, b, c = (run(model, jax.random.key(i), s) for i in (1, 1, 2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # every sampled token is among the 5 most likely given its prefix
    full = jnp.concatenate([ids, a], axis=1)
    logits = jax.vmap(model)(full)[:, PROMPT - 1:-1]
    top5 = jax.lax.top_k(logits, 5)[1]
    assert bool(jnp.all(jnp.any(top5 == a[..., None], axis=-1)))


def test_generation_errors_name_the_argument(llama):
    d, _ = llama
    model = from_pretrained(d, redeqx.make_mesh(1, devices=jax.devices()[:1]))
    ids = jnp.asarray(_prompts())
    with pytest.raises(ValueError, match="pass key="):
        generate(model, ids, max_new_tokens=2, sampler=sample())
    with pytest.raises(ValueError, match="input_ids must be"):
        generate(model, ids[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        sample(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        sample(top_p=1.5)
    with pytest.raises(ValueError, match=rf"token ids from \d+ to {VOCAB}, outside the model's vocabulary of {VOCAB}"):
        generate(model, ids.at[0, 0].set(VOCAB), max_new_tokens=2)  # once NaN logits, argmax 0, silently
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        beam_search(model, ids.at[1, 2].set(-1), max_new_tokens=2, num_beams=2)
