"""What every family of the zoo promises, run over the table in tests/families.py:
greedy tokens as Transformers' from a checkpoint either side reads, the hand-written
Megatron plan, stacked layers computing what listed ones do, and a split over a context
axis training as one device (a seq2seq family refuses it). A family's own options
(variants, full-size shapes, config errors) stay in its tests/test_models_*.py."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from families import FAMILIES
from redeqx import models
from redeqx._trees import is_spec, named_leaves
from test_context import SEQ_KEYS, _collate, _examples, _mesh, llama_loss
from test_context_families import assert_split_like_one_device, moe_loss, seq2seq_loss

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# a step over a split sequence warns when it reads places as positions (_context_checks): never for the zoo
pytestmark = pytest.mark.filterwarnings("error:redeqx. the step")
DECODERS = [name for name, family in FAMILIES.items() if family.kind != "seq2seq"]
SEQ2SEQ = [name for name, family in FAMILIES.items() if family.kind == "seq2seq"]


def fast_for(names, fast):
    """``names`` as parameters, all but ``fast`` marked slow: the fast lane keeps a few cheap families
    (each of these compiles for 10-40 s on a CPU core; tests/test_context_families.py splits the options)."""
    return [pytest.param(name, marks=() if name in fast else pytest.mark.slow) for name in names]


def noisy(model, vocab, key=1):
    """``model`` with weights that show a wrong mapping and give varied greedy tokens: vectors
    (norms, biases) moved off their initial ones and zeros by 0.1, matrices other than the
    vocabulary's tables (whose small init keeps the embedding from drowning the layers' work, as a
    greedy loop repeating its last token) drawn with standard deviation 1/sqrt(fan in)."""
    leaves, tree = jax.tree.flatten(eqx.filter(model, eqx.is_inexact_array))
    keys = jax.random.split(jax.random.key(key), len(leaves))

    def noise(x, k):
        if x.ndim == 1:
            return x + 0.1 * jax.random.normal(k, x.shape)
        return x if x.shape[0] == vocab else jax.random.normal(k, x.shape) / x.shape[-1] ** 0.5

    return eqx.combine(jax.tree.unflatten(tree, [noise(x, k) for x, k in zip(leaves, keys)]), model)


def prompts(family, batch=2, t=7, seed=0):
    """Prompt ids, and for a seq2seq family the encoder's mask (the second row right-padded)."""
    ids = np.random.RandomState(seed).randint(3, family.config.vocab_size, (batch, t))
    if family.kind != "seq2seq":
        return {"input_ids": ids}
    mask = np.ones_like(ids, bool)
    mask[1, t - 3:] = False
    return {"input_ids": ids, "attention_mask": mask}


def hf_greedy(hf, batch, n):
    """Transformers' greedy tokens by a full forward at every step (no cache: the simplest reference)."""
    ids = torch.tensor(batch["input_ids"])
    with torch.no_grad():
        if "attention_mask" not in batch:
            for _ in range(n):
                ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], dim=1)
            return ids[:, batch["input_ids"].shape[1]:].numpy()
        mask = torch.tensor(batch["attention_mask"].astype(np.int64))
        out = torch.full((ids.shape[0], 1), hf.config.decoder_start_token_id)
        for _ in range(n):
            logits = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=out).logits
            out = torch.cat([out, logits[:, -1:].argmax(-1)], dim=1)
        return out[:, 1:].numpy()


@pytest.mark.parametrize("name", fast_for(FAMILIES, ("gpt2", "qwen3_moe")))
def test_greedy_generation_matches_transformers(name, tmp_path):
    """Saved by redeqx and read by Transformers, loaded back over 2 model shards: generate()
    in a predict step gives Transformers' greedy tokens."""
    family = FAMILIES[name]
    models.save_pretrained(noisy(family.build(scan_layers=False), family.config.vocab_size), tmp_path)
    auto = transformers.AutoModelForSeq2SeqLM if family.kind == "seq2seq" else transformers.AutoModelForCausalLM
    hf = auto.from_pretrained(tmp_path).eval()
    batch = prompts(family)
    want = hf_greedy(hf, batch, 8)
    assert len(np.unique(want)) >= 3  # varied tokens, so a wrong position or cache shows
    mesh = redeqx.make_mesh(2)
    model = models.from_pretrained(tmp_path, mesh)
    step = redeqx.make_predict_step(lambda m, b, k: models.generate(m, max_new_tokens=8, **b), mesh,
                                    redeqx.sharding_rules(model, mesh))
    got = np.asarray(step(model, {k: jnp.asarray(np.concatenate([v] * 4)) for k, v in batch.items()},
                          jax.random.key(0)))  # 2 rows to a data shard
    np.testing.assert_array_equal(got[:2], want)
    np.testing.assert_array_equal(got[6:], want)


@pytest.mark.parametrize("name", FAMILIES)
def test_rules_give_the_megatron_plan(name):
    """Every leaf of the listed model as the family's hand-written Megatron plan says (shapes are enough)."""
    family = FAMILIES[name]
    model = eqx.filter_eval_shape(lambda: family.build(scan_layers=False))
    mesh = redeqx.make_mesh(2)
    table = redeqx.explain(model, redeqx.sharding_rules(model, mesh), mesh)
    paths = {path for path, _ in named_leaves(model)}
    rows = [line for line in table.splitlines() if line.split() and line.split()[0] in paths]
    assert len(rows) == len(paths)
    for row in rows:
        path, spec = row.split()[0], re.search(r"P\([^)]*\)", row).group(0)
        wants = [want for pattern, want in family.megatron.items() if re.search(pattern, path)]
        assert len(wants) == 1, (path, wants)
        assert spec == wants[0], (path, spec, wants[0])


# Found by this contract: names-only rules read a stacked Qwen3-MoE's attention projections
# (beside its q_norm/k_norm) as an expert stack, and split k_proj on its input features.
@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_stacked_layers_are_the_listed_ones(name, tmp_path):
    """The same weights stacked (a scan over layers) and listed: the same logits, the plan with None on
    the layer axis, Hugging Face names from either layout read into either, and the same generation."""
    family = FAMILIES[name]
    listed, stacked = family.build(scan_layers=False), family.build(scan_layers=True)
    x = jnp.asarray(prompts(family, batch=4, t=9)["input_ids"])
    logits = eqx.filter_jit(family.logits)  # one compile each, not an op-by-op run of every layer
    np.testing.assert_allclose(logits(stacked, x), logits(listed, x), atol=2e-5, rtol=0)

    mesh = redeqx.make_mesh(2)
    l_specs, s_specs = (dict(zip([p for p, _ in named_leaves(m, is_leaf=lambda v: v is None)],
                                 jax.tree.leaves(redeqx.sharding_rules(m, mesh), is_leaf=is_spec)))
                        for m in (listed, stacked))
    for path, spec in s_specs.items():
        stack = next((s for s in type(stacked).hf_stacks if path.startswith(s + ".")), None)
        if spec is None or stack is None:
            continue
        layer = l_specs.get(f"{stack}.1.{path[len(stack) + 1:]}")
        if layer is None:  # T5's bias table sits on the stack when stacked
            continue
        assert spec == (P(None, *layer) if len(layer) else P()), (path, spec, layer)

    models.save_pretrained(stacked, tmp_path)
    for scan_layers, same in ((False, listed), (True, stacked)):
        loaded = models.from_pretrained(tmp_path, mesh, scan_layers=scan_layers)
        assert loaded.config.scan_layers == scan_layers
        for (path, a), (_, b) in zip(named_leaves(eqx.filter(loaded, eqx.is_array)),
                                     named_leaves(eqx.filter(same, eqx.is_array)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
    assert all(a.sharding.spec == (s_specs[p] or P()) for p, a in named_leaves(eqx.filter(loaded, eqx.is_array)))

    ids = x[:, :5]
    np.testing.assert_array_equal(models.generate(loaded, ids, max_new_tokens=4),
                                  models.generate(listed, ids, max_new_tokens=4))
    np.testing.assert_array_equal(models.beam_search(stacked, ids, max_new_tokens=3, num_beams=2),
                                  models.beam_search(listed, ids, max_new_tokens=3, num_beams=2))


@pytest.mark.parametrize("name", fast_for(DECODERS, ("gptj",)))
def test_splits_its_work_over_four_context_shards(devices, name):
    """On (data, context, model) = (1, 4, 1) the gradient is one device's, and each device multiplies
    a quarter of the tokens: a layer that brought the sequence together on every device (a constraint
    replicating the residual stream, experts run on every token) would multiply the whole sequence there."""
    family = FAMILIES[name]
    loss_fn = moe_loss if family.kind == "moe" else llama_loss
    split, one = assert_split_like_one_device(family.build, loss_fn, _mesh(1, 4, 1))
    # a quarter, or a little less: split over context, causal attention skips the key blocks its mask
    # hides whole, which one device's attention computes masked
    assert 0.2 < split / one < 0.26, (name, split / one)


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_seq2seq_refuses_a_context_mesh(devices, name):
    """T5 and BART read positions and masks in the original order: split, they would train on wrong ones."""
    model, mesh, opt = FAMILIES[name].build(), _mesh(2, 2, 2), optax.adamw(1e-2)
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, opt, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(seq2seq_loss, opt, mesh, specs)
    batch = next(redeqx.batches(_examples(), _collate, 2, mesh, seq_keys=SEQ_KEYS))
    with pytest.raises(ValueError, match=r"encoder-decoder models cannot run on a mesh that splits sequences(.|\n)*"
                                         r"without n_context_shards"):
        step(state, batch)
