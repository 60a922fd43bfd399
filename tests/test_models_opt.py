"""OPT against Transformers' PyTorch reference (tiny random configs built and
saved here: no download), and OPT-13B / OPT-66B's shapes built abstractly."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from accelerator_count import accelerator_collectives
from megatron_count import megatron_bytes, gradient_bytes, near_megatron

import redeqx
from redeqx.models import OPTConfig, OPTForCausalLM, from_pretrained, generate, save_pretrained
from redeqx.models._pretrained import _skeleton
from _helpers import hf_checkpoints, hf_shapes, next_token_loss, nudged, one_device, random_ids
from _helpers import logits_match_transformers, redeqx_logits, sharded_state, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 100
SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
             max_position_embeddings=64)


def _hf_model(kind):
    torch.manual_seed(0)
    if kind == "pre":  # OPT-125m ... 175B: pre-LN, final LayerNorm
        config = transformers.OPTConfig(**SIZES)
    else:  # OPT-350m: post-LN, no final LayerNorm, 16-wide embeddings projected in and out
        config = transformers.OPTConfig(**SIZES, do_layer_norm_before=False, word_embed_proj_dim=16)
    # logits of order 1, and weights large enough that greedy tokens vary
    return nudged(transformers.OPTForCausalLM(config).eval(),
                  scale=lambda name, p: 20 if "embed_positions" in name else 10 if p.ndim == 2 else 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return hf_checkpoints(tmp_path_factory, _hf_model, ("pre", "post"))


_ids = partial(random_ids, VOCAB, low=3)


def test_logits_match_transformers_at_1_2_4_model_shards(checkpoints):
    d, hf = checkpoints["pre"]
    ids = _ids(batch=8)
    assert np.abs(logits_match_transformers(d, hf, ids)).max() > 1


def test_post_layernorm_with_projected_embeddings_matches_transformers(checkpoints):
    d, hf = checkpoints["post"]
    model = from_pretrained(d, redeqx.make_mesh(2))
    assert not model.config.do_layer_norm_before and model.config.embed_dim == 16
    assert model.model.decoder.final_layer_norm is None and model.model.decoder.project_in.weight.shape == (32, 16)
    ids = _ids(batch=8)
    np.testing.assert_allclose(redeqx_logits(model, ids), torch_logits(hf, ids), atol=1e-4, rtol=0)


def test_save_pretrained_round_trip_and_hub_names(checkpoints, tmp_path):
    d, hf = checkpoints["post"]
    save_pretrained(from_pretrained(d, redeqx.make_mesh(2)), tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again) is transformers.OPTForCausalLM
    ids = _ids(seed=1)
    np.testing.assert_allclose(torch_logits(again, ids), torch_logits(hf, ids), atol=1e-5, rtol=0)
    # The hub's OPT files were saved from OPTModel: tensors named decoder.*, no lm_head
    d, hf = checkpoints["pre"]
    hf.model.save_pretrained(tmp_path / "hub")
    mesh = one_device()
    hub, ours = from_pretrained(tmp_path / "hub", mesh), from_pretrained(d, mesh)
    assert hub.config.hf_prefix == "" and ours.config.hf_prefix == "model."
    for a, b in zip(jax.tree.leaves(hub), jax.tree.leaves(ours), strict=True):
        np.testing.assert_array_equal(a, b)
    save_pretrained(hub, tmp_path / "hub_again")  # written under the same names, which Transformers reads too
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hub_again").eval()
    np.testing.assert_allclose(torch_logits(again, ids), torch_logits(hf, ids), atol=1e-5, rtol=0)


def test_greedy_generation_from_left_padded_prompts_matches_transformers(checkpoints):
    d, hf = checkpoints["pre"]
    ids = _ids(seq=6, seed=2)
    mask = np.ones_like(ids)
    mask[1, :2] = 0  # the second prompt is 4 tokens, left-padded
    ids[1, :2] = hf.config.pad_token_id
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=hf.config.pad_token_id).numpy()[:, 6:]
    assert len(np.unique(ref)) > 3  # varied tokens, so a wrong position or cache shows
    mesh = redeqx.make_mesh(2)
    model = from_pretrained(d, mesh)

    def pred_fn(model, batch, key):
        return generate(model, batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=8)

    step = redeqx.make_predict_step(pred_fn, mesh, redeqx.sharding_rules(model, mesh))
    batch = {"input_ids": jnp.asarray(np.concatenate([ids] * 4)),
             "attention_mask": jnp.asarray(np.concatenate([mask] * 4).astype(bool))}  # 2 rows per data shard
    out = np.asarray(step(model, batch, jax.random.key(0)))
    np.testing.assert_array_equal(out[:2], ref)
    np.testing.assert_array_equal(out[6:], ref)


def test_train_step_communication_is_megatron(checkpoints):
    d, _ = checkpoints["pre"]
    model = from_pretrained(d, one_device())
    optimizer = optax.sgd(0.1)
    mesh = redeqx.make_mesh(4)
    specs, state = sharded_state(model, optimizer, mesh, key=0)
    batch = jax.device_put({"ids": jnp.asarray(_ids(batch=8, seq=17))}, NamedSharding(mesh, P("data")))

    summary = accelerator_collectives(redeqx.make_train_step(next_token_loss, optimizer, mesh, specs), state, batch)
    grad_bytes = gradient_bytes(state.model)
    c = model.config
    analytic = megatron_bytes(c.hidden_size, c.num_hidden_layers, 8 // mesh.shape["data"], 16, grad_bytes)
    near_megatron(summary, analytic, "OPT")


@pytest.mark.parametrize("name, sizes, n_params", [
    ("OPT-13B", dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, ffn_dim=20480), 12_853_473_280),
    ("OPT-66B", dict(hidden_size=9216, num_hidden_layers=64, num_attention_heads=72, ffn_dim=36864), 65_719_701_504),
])
def test_full_size_shapes_equal_transformers(name, sizes, n_params):
    hf_config = transformers.OPTConfig(**sizes)  # vocab 50272, 2048 positions: the released models' values
    with torch.device("meta"):  # shapes only, nothing allocated
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    config = dataclasses.replace(OPTConfig.from_hf(hf_config.to_dict()), scan_layers=False)  # per-layer names
    model = _skeleton(OPTForCausalLM, config, None)  # built by eqx.filter_eval_shape: nothing allocated
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # the head is tied
    assert hf_shapes(model) == theirs
    assert sum(p.numel() for p in hf.parameters()) == sum(x.size for x in jax.tree.leaves(model)) == n_params


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_attention_heads=5"):
        OPTConfig(hidden_size=32, num_attention_heads=5)
    with pytest.raises(ValueError, match="activation_function='swish'"):
        OPTConfig(activation_function="swish")
    with pytest.raises(ValueError, match="layer_norm_elementwise_affine"):
        OPTConfig.from_hf({**SIZES, "layer_norm_elementwise_affine": False})
    with pytest.raises(TypeError, match="OPTConfig"):
        OPTForCausalLM(SIZES, key=jax.random.key(0))
