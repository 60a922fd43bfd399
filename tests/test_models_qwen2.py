"""Qwen2 against Transformers' PyTorch reference (tiny random configs built
here, saved to a temp dir: no download)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import redeqx
from _helpers import hf_checkpoints, nudged, one_device, random_ids, redeqx_logits, torch_logits
from redeqx.models import Qwen2Config, Qwen2ForCausalLM, from_pretrained, generate, save_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64
# The tiny config of every test here (and of the family table): grouped-query attention, q/k/v biases.
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def _hf_model(tied: bool, **kw):
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=tied, **kw)
    config._attn_implementation = "eager"
    return nudged(transformers.Qwen2ForCausalLM(config).eval())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return hf_checkpoints(tmp_path_factory, _hf_model, (False, True))


_ids = partial(random_ids, VOCAB)


@pytest.mark.parametrize("tied,scan_layers", [(False, True), (True, True), (False, False)])
def test_logits_match_transformers(checkpoints, tied, scan_layers):
    d, hf = checkpoints[tied]
    model = from_pretrained(d, one_device(), scan_layers=scan_layers)
    assert isinstance(model, Qwen2ForCausalLM) and model.config.tie_word_embeddings == tied
    assert model.model.layers.self_attn.k_proj.bias is not None if scan_layers else True
    np.testing.assert_allclose(redeqx_logits(model, _ids()), torch_logits(hf, _ids()), atol=1e-4, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_loads_what_redeqx_writes(checkpoints, tied, tmp_path):
    d, hf = checkpoints[tied]
    model = from_pretrained(d, one_device())
    save_pretrained(model, tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again) is transformers.Qwen2ForCausalLM
    np.testing.assert_allclose(torch_logits(again, _ids(seed=1)), torch_logits(hf, _ids(seed=1)), atol=1e-6, rtol=0)
    assert from_pretrained(tmp_path, one_device()).config == model.config


def test_generate_matches_transformers_greedy(checkpoints):
    d, hf = checkpoints[False]
    model = from_pretrained(d, one_device())
    prompt = _ids(batch=1, seq=5, seed=3)
    ours = np.asarray(jax.jit(lambda m, p: generate(m, p, max_new_tokens=6))(model, jnp.asarray(prompt)))
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0)
    np.testing.assert_array_equal(ours, theirs[:, prompt.shape[1]:].numpy())


def test_two_model_shards_agree_with_one_device(checkpoints):
    """One device against two model shards of the 8-device test mesh (4 data x 2 model)."""
    d, _ = checkpoints[True]
    ids = _ids(batch=8)
    sharded = from_pretrained(d, redeqx.make_mesh(2))
    assert sharded.model.layers.self_attn.q_proj.weight.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    np.testing.assert_allclose(redeqx_logits(sharded, ids), redeqx_logits(from_pretrained(d, one_device()), ids),
                               atol=1e-5, rtol=0)


def test_a_window_in_every_layer_matches_transformers(tmp_path):
    hf = _hf_model(False, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, one_device())
    assert model._window() == 4
    np.testing.assert_allclose(redeqx_logits(model, _ids()), torch_logits(hf, _ids()), atol=1e-4, rtol=0)


def test_a_window_in_some_layers_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_window_layers=1 slides the window in layers 1 to 1"):
        Qwen2Config(**TINY, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    _hf_model(False, use_sliding_window=True, sliding_window=4, max_window_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="config.json: qwen2 config redeqx cannot build: .*max_window_layers=0"):
        from_pretrained(tmp_path, one_device())


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="Qwen2Config.num_hidden_layers"):
        Qwen2Config(**{**TINY, "num_hidden_layers": 0})
    with pytest.raises(ValueError, match="Qwen2Config.scan_unroll=0"):
        Qwen2Config(**TINY, scan_unroll=0)
    with pytest.raises(TypeError, match="redeqx.models.Qwen2Config"):
        Qwen2ForCausalLM(redeqx.models.LlamaConfig(), key=jax.random.key(0))
