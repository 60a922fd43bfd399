"""BART against Transformers' PyTorch reference (a tiny random config built
and saved here: no download), and BART-Large's shapes built abstractly."""

import dataclasses
import re
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from accelerator_count import accelerator_collectives
from megatron_count import megatron_bytes_encoder_decoder, gradient_bytes, near_megatron

import redeqx
from redeqx.models import (
    BartConfig,
    BartForConditionalGeneration,
    from_pretrained,
    save_pretrained,
    shift_right,
)
from redeqx.models._pretrained import _skeleton
from _helpers import hf_shapes, logits_match_transformers, nudged, one_device, seq2seq_inputs, sharded_state, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 100
SIZES = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=48, max_position_embeddings=64)


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.BartForConditionalGeneration(transformers.BartConfig(**SIZES, scale_embedding=True)).eval()
    nudged(hf, norms=("layer_norm", "layernorm"),  # and weights large enough that greedy tokens vary
           scale=lambda name, p: 5 if "shared" in name else 20 if p.ndim == 2 else 1)
    with torch.no_grad():  # and a non-trivial logit bias
        hf.final_logits_bias.copy_(0.1 * torch.randn_like(hf.final_logits_bias))
    d = tmp_path_factory.mktemp("bart")
    hf.save_pretrained(d)
    return d, hf


_inputs = partial(seq2seq_inputs, VOCAB, low=3, pad_id=1, n_pad=4, src=14, tgt=9)  # 1: BART's pad token


@pytest.mark.slow
def test_logits_match_transformers_at_1_2_4_model_shards(bart):
    d, hf = bart
    ids, mask, dec = _inputs(batch=8)
    logits_match_transformers(d, hf, ids, mask, dec)
    model = from_pretrained(d, redeqx.make_mesh(1))
    assert model.config.scale_embedding and model.final_logits_bias.shape == (VOCAB,)


def test_save_pretrained_round_trip(bart, tmp_path):
    d, hf = bart
    save_pretrained(from_pretrained(d, redeqx.make_mesh(2)), tmp_path)
    again = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(again) is transformers.BartForConditionalGeneration
    np.testing.assert_array_equal(again.final_logits_bias.numpy(), hf.final_logits_bias.numpy())
    ids, mask, dec = _inputs(seed=1)
    np.testing.assert_allclose(torch_logits(again, ids, mask, dec), torch_logits(hf, ids, mask, dec),
                               atol=1e-5, rtol=0)


@pytest.mark.slow
def test_train_step_communication_is_megatron(bart):
    d, _ = bart
    model = from_pretrained(d, one_device())
    c = model.config
    optimizer = optax.sgd(0.1)
    mesh = redeqx.make_mesh(4)
    specs, state = sharded_state(model, optimizer, mesh, key=0)
    src, _, tgt = _inputs(batch=8, src=16, tgt=12)
    batch = jax.device_put({"src": jnp.asarray(src), "tgt": jnp.asarray(tgt)}, NamedSharding(mesh, P("data")))

    def loss_fn(m, batch, key):
        logits = jax.vmap(lambda s, t: m(s, shift_right(t, c)))(batch["src"], batch["tgt"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt"]).mean()

    summary = accelerator_collectives(redeqx.make_train_step(loss_fn, optimizer, mesh, specs), state, batch)
    grad_bytes = gradient_bytes(state.model)
    analytic = megatron_bytes_encoder_decoder(c.d_model, c.encoder_layers, c.decoder_layers, 8 // mesh.shape["data"],
                                              src.shape[1], tgt.shape[1], grad_bytes)
    near_megatron(summary, analytic, "BART")


def test_bart_large_shapes_equal_transformers():
    hf_config = transformers.BartConfig()  # BART-Large's sizes
    with torch.device("meta"):  # shapes only, nothing allocated
        hf = transformers.AutoModelForSeq2SeqLM.from_config(hf_config)
    config = dataclasses.replace(BartConfig.from_hf(hf_config.to_dict()), scan_layers=False)  # per-layer names
    model = _skeleton(BartForConditionalGeneration, config, None)  # eval_shape
    copies = re.compile(r"lm_head\.weight|model\.(encoder|decoder)\.embed_tokens\.weight")  # tied to model.shared
    assert hf_shapes(model) == {k: tuple(v.shape) for k, v in hf.state_dict().items() if not copies.fullmatch(k)}
    n_params = sum(p.numel() for p in hf.parameters())
    assert n_params == 406_291_456
    assert sum(x.size for x in jax.tree.leaves(model)) == n_params + hf_config.vocab_size  # + final_logits_bias


def test_shift_right_and_config_errors():
    config = BartConfig(**SIZES)
    np.testing.assert_array_equal(shift_right(jnp.asarray([[5, -100, 6]]), config), [[2, 5, 1]])
    with pytest.raises(ValueError, match="decoder_attention_heads=5"):
        BartConfig(**{**SIZES, "decoder_attention_heads": 5})
    with pytest.raises(ValueError, match="normalize_before"):
        BartConfig.from_hf({**SIZES, "normalize_before": True})
    model = eqx.filter_eval_shape(lambda: BartForConditionalGeneration(config, key=jax.random.key(0)))
    with pytest.raises(ValueError, match="attention_mask is for the encoder"):
        model.decode(jnp.zeros((1,), jnp.int32), None, attention_mask=jnp.ones((1,), bool))
