"""evaluate and predict on a mesh that splits sequences over 'context': the
same metrics and, in the original token order, the same outputs as one device."""

import functools

import jax
import numpy as np
import pytest
from test_context import CONFIG, SEQ_KEYS, UserModel, _collate, _examples, _mesh, llama_loss, user_loss
from families import FAMILIES

import redeqx
from redeqx import models

N = 5  # examples: no global batch below divides them, so the last batch is padded

# a step over a split sequence warns when it reads places as positions (_context_checks): never for the zoo
pytestmark = pytest.mark.filterwarnings("error:redeqx. the step")


def _llama():
    return models.LlamaForCausalLM(CONFIG, key=jax.random.key(0))


def _user():
    return UserModel(True, jax.random.key(0))


def _logits(model, batch):
    if isinstance(model, UserModel):
        return jax.vmap(model)(batch["input_ids"], batch["attention_mask"])
    return jax.vmap(lambda i, m: model(i, attention_mask=m))(batch["input_ids"], batch["attention_mask"])


def pred_fn(model, batch, key):
    logits = _logits(model, batch)
    # per-token outputs, the ids themselves among them (their order shows at once), and one that is not
    return {"logits": logits, "ids": batch["input_ids"], "pooled": logits.mean(1)}


def _run(make, loss_fn, mesh, seq_keys):
    model = make()
    specs = redeqx.sharding_rules(model, mesh)
    model = redeqx.shard(model, specs, mesh)
    key = jax.random.key(3)
    metrics = redeqx.evaluate(redeqx.make_eval_step(loss_fn, mesh, specs), model, _examples(n=N), _collate, 2, mesh,
                              key=key, seq_keys=seq_keys)
    preds = redeqx.predict(redeqx.make_predict_step(pred_fn, mesh, specs), model, _examples(n=N), _collate, 2, mesh,
                           key=key, seq_keys=seq_keys, seq_outputs=("logits", "ids"))
    return metrics, preds


@functools.cache
def _one_device(which):
    make, loss_fn = {"llama": (_llama, llama_loss), "user": (_user, user_loss)}[which]
    return _run(make, loss_fn, redeqx.make_mesh(1, devices=jax.devices()[:1]), None)


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 4, 2)])  # (data, context, model)
@pytest.mark.parametrize("which", ["llama", "user"])
def test_evaluate_and_predict_like_one_device(devices, which, shape):
    want_metrics, want = _one_device(which)
    make, loss_fn = {"llama": (_llama, llama_loss), "user": (_user, user_loss)}[which]
    metrics, got = _run(make, loss_fn, _mesh(*shape), SEQ_KEYS)
    np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-5)
    examples = _examples(n=N)
    assert len(got) == len(want) == N
    for g, w, ex in zip(got, want, examples):
        np.testing.assert_array_equal(g["ids"], ex["input_ids"])  # the original order, not the split one
        real = ex["attention_mask"] if which == "llama" else slice(None)  # the zoo's padding sees other keys unsplit
        np.testing.assert_allclose(g["logits"][real], w["logits"][real], atol=2e-5)
        if which == "user":
            np.testing.assert_allclose(g["pooled"], w["pooled"], atol=2e-5)


def test_predict_says_what_it_leaves_in_the_split_order(devices):
    mesh = _mesh(2, 2, 2)
    model = _user()
    specs = redeqx.sharding_rules(model, mesh)
    model = redeqx.shard(model, specs, mesh)
    step = redeqx.make_predict_step(lambda m, b, k: _logits(m, b), mesh, specs)  # one array: the logits
    run = functools.partial(redeqx.predict, step, model, _examples(n=N), _collate, 2, mesh, key=jax.random.key(0))
    whole = np.stack(run(seq_keys=SEQ_KEYS, seq_outputs=True))
    with pytest.warns(UserWarning, match=r"output \(4, 16, 64\).*seq_outputs does not name it") as said:
        split = np.stack(run(seq_keys=SEQ_KEYS))
    assert len(said) == 1 and said[0].filename == __file__  # once, at the caller's line
    np.testing.assert_array_equal(redeqx.restore_order(split, mesh), whole)
    np.testing.assert_array_equal(np.stack(run(seq_keys=SEQ_KEYS, seq_outputs=True, output_fn=list)), whole)
    with pytest.raises(TypeError, match="seq_outputs=\\('logits',\\) names outputs of a dict"):
        run(seq_keys=SEQ_KEYS, seq_outputs="logits")
    with pytest.raises(ValueError, match="redeqx.predict needs seq_keys="):
        run()


def test_seq_outputs_are_checked(devices):
    mesh = _mesh(2, 2, 2)
    model = _user()
    specs = redeqx.sharding_rules(model, mesh)
    model = redeqx.shard(model, specs, mesh)
    step = redeqx.make_predict_step(pred_fn, mesh, specs)
    run = functools.partial(redeqx.predict, step, model, _examples(n=N), _collate, 2, mesh, key=jax.random.key(0),
                            seq_keys=SEQ_KEYS)
    with pytest.raises(KeyError, match="'tokens'.*keys are \\['ids', 'logits', 'pooled'\\]"):
        run(seq_outputs=("logits", "tokens"))
    with pytest.raises(ValueError, match="output\\['pooled'\\], of shape \\(4, 64\\).*not per-token"):
        run(seq_outputs=("logits", "ids", "pooled"))
    eval_step = redeqx.make_eval_step(user_loss, mesh, specs)
    with pytest.raises(ValueError, match="redeqx.evaluate needs seq_keys="):
        redeqx.evaluate(eval_step, model, _examples(n=N), _collate, 2, mesh, key=jax.random.key(0))


def _generate_fn(fn):
    def pred_fn(model, batch, key):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        first = jax.vmap(lambda i, m: model.prefill(i, m, 4)[0])(ids, mask)  # the next token's logits
        return {"tokens": fn(model, ids, attention_mask=mask, max_new_tokens=4), "first": first}

    return pred_fn


def _generated(make, fn, mesh, seq_keys):
    model = make()
    specs = redeqx.sharding_rules(model, mesh)
    step = redeqx.make_predict_step(_generate_fn(fn), mesh, specs)
    preds = redeqx.predict(step, redeqx.shard(model, specs, mesh), _examples(n=4), _collate, 2, mesh,
                           key=jax.random.key(0), seq_keys=seq_keys)  # one dict per example
    return {k: np.stack([p[k] for p in preds]) for k in preds[0]}


MISTRAL = models.LlamaConfig(**{**CONFIG.__dict__, "model_type": "mistral", "use_sliding_window": True,
                                "sliding_window": 5, "context_attention": "ring"})
GENERATED = {  # the prompts padded on the left (row 0) and the right (row 1)
    "llama": (_llama, models.generate, (2, 2, 2)),
    "llama_beams": (_llama, functools.partial(models.beam_search, num_beams=3), (1, 4, 2)),
    "mistral_window_ring": (lambda: models.LlamaForCausalLM(MISTRAL, key=jax.random.key(0)), models.generate, (1, 4, 2)),
    "gpt2": (FAMILIES["gpt2"].build, models.generate, (2, 2, 2)),
    "mixtral": (FAMILIES["mixtral"].build, models.generate, (1, 4, 2)),
}
SLOW = ("mistral_window_ring", "gpt2", "mixtral")  # 30-55 s each on a busy core; the split prefill: llama's


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow if c in SLOW else ()) for c in GENERATED])
def test_generate_splits_the_prefill_like_one_device(devices, case):
    """A prompt batched in the split order: its forward split over context, the cache put back in the
    original order; the same next-token logits and the same tokens as on one device."""
    make, fn, shape = GENERATED[case]
    want = _generated(make, fn, redeqx.make_mesh(1, devices=jax.devices()[:1]), None)
    got = _generated(make, fn, _mesh(*shape), SEQ_KEYS)  # labels unused, but per-token: named (or an error)
    np.testing.assert_allclose(got["first"], want["first"], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got["tokens"], want["tokens"])


def test_generate_refuses_a_context_mesh_for_a_model_without_a_split_prefill(devices):
    """A model that only maps tokens to logits is re-run on the whole buffer, which would read the split order."""
    mesh = _mesh(2, 2, 2)
    model = _user()
    specs = redeqx.sharding_rules(model, mesh)
    model = redeqx.shard(model, specs, mesh)
    prompts = [{"input_ids": np.zeros(16, np.int32)}] * 4
    for fn in (models.generate, functools.partial(models.beam_search, num_beams=2)):
        pred_fn = lambda m, b, k: fn(lambda ids: m(ids, ids >= 0), b["input_ids"], max_new_tokens=2)  # noqa: B023
        step = redeqx.make_predict_step(pred_fn, mesh, specs)
        with pytest.raises(ValueError, match="needs a model whose prefill reads a prompt in the split order"):
            redeqx.predict(step, model, prompts, _collate, 2, mesh, key=jax.random.key(0), seq_keys="input_ids")
