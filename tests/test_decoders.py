"""generate and beam_search with a user's own decoder (issue 23 item 7): one
that follows the Decoder protocol with its own cache, and one that only maps
tokens to logits (driven without a cache), each against a plain greedy loop."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import redeqx
from redeqx import models
from tiny_transformer import TinyLM

VOCAB = 32


class CharRNN(eqx.Module):
    """The Decoder docstring's example: a recurrent decoder, its cache the hidden state."""

    embed: eqx.nn.Embedding
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key):
        ke, kc, kh = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, 16, key=ke)
        self.cell = eqx.nn.GRUCell(16, 24, key=kc)
        self.head = eqx.nn.Linear(24, VOCAB, key=kh)

    def step(self, h, token):
        h = self.cell(self.embed(token), h)
        return h, self.head(h)

    def prefill(self, input_ids, attention_mask, max_new_tokens):
        def read(h, xs):
            token, real = xs
            return jnp.where(real, self.step(h, token)[0], h), None

        h, _ = jax.lax.scan(read, jnp.zeros(self.cell.hidden_size), (input_ids, attention_mask))
        return self.head(h), h

    def decode(self, input_ids, h):
        h, logits = jax.lax.scan(lambda h, token: self.step(h, token), h, input_ids)
        return logits, h


def greedy_by_hand(next_logits, prompt, n):
    """Append the argmax of ``next_logits(tokens)`` n times."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(next_logits(np.asarray(tokens)))))
    return tokens[len(prompt):]


PROMPTS = np.random.default_rng(0).integers(1, VOCAB, (3, 5)).astype(np.int32)


def test_a_users_decoder_with_its_own_cache():
    rnn = CharRNN(jax.random.key(0))
    assert isinstance(rnn, models.Decoder)

    def next_logits(tokens):
        h = jnp.zeros(24)
        for t in tokens:
            h, logits = rnn.step(h, jnp.asarray(t))
        return logits

    out = np.asarray(models.generate(rnn, jnp.asarray(PROMPTS), max_new_tokens=6))
    for row, prompt in zip(out, PROMPTS):
        assert row.tolist() == greedy_by_hand(next_logits, prompt, 6)
    left_padded = np.concatenate([np.zeros((3, 2), np.int32), PROMPTS], 1)
    mask = np.concatenate([np.zeros((3, 2), bool), np.ones((3, 5), bool)], 1)
    np.testing.assert_array_equal(models.generate(rnn, jnp.asarray(left_padded), attention_mask=jnp.asarray(mask),
                                                  max_new_tokens=6), out)


@pytest.mark.slow
def test_a_decoder_without_a_cache_recomputes_the_sequence(devices):
    lm = TinyLM(vocab=VOCAB, dim=32, n_heads=4, hidden=64, n_layers=2, key=jax.random.key(1))
    assert not isinstance(lm, models.Decoder)
    out = np.asarray(models.generate(lm, jnp.asarray(PROMPTS), max_new_tokens=6))
    last_logits = jax.jit(lambda t: lm(t)[-1])  # one program per length, not every op compiled on its own
    for row, prompt in zip(out, PROMPTS):
        assert row.tolist() == greedy_by_hand(last_logits, prompt, 6)
    # padding anywhere in the prompt generates what the bare prompt does
    padded = np.insert(PROMPTS, [0, 3], 0, axis=1)
    mask = np.insert(np.ones_like(PROMPTS, bool), [0, 3], False, axis=1)
    np.testing.assert_array_equal(models.generate(lm, jnp.asarray(padded), attention_mask=jnp.asarray(mask),
                                                  max_new_tokens=6), out)
    np.testing.assert_array_equal(models.beam_search(lm, jnp.asarray(PROMPTS), max_new_tokens=6, num_beams=1), out)
    beams = models.beam_search(lm, jnp.asarray(PROMPTS), max_new_tokens=6, num_beams=3)
    assert beams.shape == (3, 6)

    # as a pred_fn, sharded with the model
    mesh = redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(lm, mesh)
    step = redeqx.make_predict_step(lambda m, b, k: models.generate(m, b["ids"], max_new_tokens=6), mesh, specs)
    batch = {"ids": jnp.asarray(np.concatenate([PROMPTS, PROMPTS, PROMPTS[:2]]))}
    np.testing.assert_array_equal(np.asarray(step(lm, batch, jax.random.key(0)))[:3], out)


def test_what_generate_cannot_drive_is_named():
    with pytest.raises(TypeError, match="neither decode with .*Decoder protocol.* nor call"):
        models.generate(object(), jnp.asarray(PROMPTS), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"must return one row of logits per token"):
        models.generate(lambda ids: jnp.zeros((VOCAB,)), jnp.asarray(PROMPTS), max_new_tokens=2)


class CountingRNN(CharRNN):
    traces: list = eqx.field(static=True)

    def __init__(self, key):
        super().__init__(key)
        self.traces = []

    def prefill(self, input_ids, attention_mask, max_new_tokens):
        self.traces.append(1)
        return super().prefill(input_ids, attention_mask, max_new_tokens)


def test_generate_outside_jit_compiles_its_loop_once():
    """Called eagerly, generate and beam_search compile the prefill and the loop once per model, shapes
    and setting (before: the prefill ran op by op on every call); a sampler built again is the same one."""
    rnn = CountingRNN(jax.random.key(0))
    prompts, key = jnp.asarray(PROMPTS), jax.random.key(1)
    for _ in range(2):
        models.generate(rnn, prompts, max_new_tokens=3)
        models.generate(rnn, prompts, max_new_tokens=3, sampler=models.sample(0.7, top_k=5), key=key)
        models.beam_search(rnn, prompts, max_new_tokens=3, num_beams=2, eos_token_id=[1, 2])
    assert len(rnn.traces) == 3, rnn.traces
    assert models.sample(0.7, top_k=5) == models.sample(0.7, top_k=5) and models.greedy() == models.greedy()
    models.generate(rnn, prompts, max_new_tokens=4)  # another length: compiled anew
    assert len(rnn.traces) == 4
