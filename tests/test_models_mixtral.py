"""Mixtral and Qwen3-MoE against Transformers' PyTorch reference (tiny random
configs built here by Transformers, saved to a temp dir: no download): logits,
the load-balancing loss, checkpoints both ways, cached decoding, init_model."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from _helpers import hf_checkpoints, one_device, random_ids, torch_output
from redeqx.models import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    beam_search,
    from_pretrained,
    generate,
    save_pretrained,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64


def _hf_config(kind):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, num_experts_per_tok=2)
    if kind == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=24, num_local_experts=4)
    if kind == "qwen3_moe":  # every layer sparse, top-k weights renormalised, tied head
        return transformers.Qwen3MoeConfig(**common, intermediate_size=40, moe_intermediate_size=24, head_dim=8,
                                           num_experts=8, norm_topk_prob=True, tie_word_embeddings=True)
    if kind == "qwen3_moe_mixed":  # layer 1 dense (mlp_only_layers), raw top-k probabilities
        return transformers.Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, intermediate_size=40,
                                           moe_intermediate_size=24, head_dim=8, num_experts=4,
                                           norm_topk_prob=False, mlp_only_layers=[1])
    raise ValueError(kind)


def _hf_model(kind):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind)).eval()
    with torch.no_grad():  # non-trivial norms, and routers whose choices are clear-cut
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight")):
                p.normal_(0.0, 1.0)
    return model


KINDS = ("mixtral", "qwen3_moe", "qwen3_moe_mixed")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return hf_checkpoints(tmp_path_factory, _hf_model, KINDS)


_ids = partial(random_ids, VOCAB)


def _torch(model, ids, mask=None):
    return torch_output(model, ids, mask, output_router_logits=True)


@pytest.mark.parametrize("kind,scan_layers", [("mixtral", False), ("mixtral", True), ("qwen3_moe", True),
                                              ("qwen3_moe", False), ("qwen3_moe_mixed", False)])
@pytest.mark.slow
def test_logits_and_aux_loss_match_transformers(checkpoints, kind, scan_layers):
    d, hf = checkpoints[kind]
    model = from_pretrained(d, one_device(), scan_layers=scan_layers)
    assert model.config.scan_layers == scan_layers
    ids = _ids()
    logits, stats = jax.jit(jax.vmap(model.with_aux))(jnp.asarray(ids))
    want = _torch(hf, ids)
    np.testing.assert_allclose(logits, want.logits.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(jax.jit(jax.vmap(model))(jnp.asarray(ids)), logits, atol=1e-6, rtol=0)
    np.testing.assert_allclose(float(stats.load_balancing_loss()), float(want.aux_loss), atol=1e-5, rtol=0)
    assert float(stats.z_loss()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe_mixed"])
def test_padding_is_not_counted(checkpoints, kind):
    """Left padding: the real tokens' logits and Transformers' masked load-balancing loss."""
    d, hf = checkpoints[kind]
    model = from_pretrained(d, one_device())
    ids, mask = _ids(seed=2), np.ones((2, 12), bool)
    mask[0, :4] = False
    logits, stats = jax.jit(jax.vmap(model.with_aux))(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
    want = _torch(hf, ids, mask)
    np.testing.assert_allclose(np.asarray(logits)[mask], want.logits.numpy()[mask], atol=1e-4, rtol=0)
    np.testing.assert_allclose(float(stats.load_balancing_loss()), float(want.aux_loss), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind,scan_layers", [("mixtral", True), ("qwen3_moe_mixed", False)])
def test_transformers_loads_what_redeqx_writes(checkpoints, kind, scan_layers, tmp_path):
    """Written from 2 model shards, the experts split over them: one tensor per expert, as Transformers names them."""
    d, hf = checkpoints[kind]
    model = from_pretrained(d, redeqx.make_mesh(2), scan_layers=scan_layers)
    save_pretrained(model, tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again) is type(hf)
    ids = _ids(seed=1)
    np.testing.assert_allclose(_torch(again, ids).logits.numpy(), _torch(hf, ids).logits.numpy(), atol=1e-6, rtol=0)
    reloaded = from_pretrained(tmp_path, one_device())
    assert reloaded.config.to_hf() == model.config.to_hf()
    for a, b in zip(jax.tree.leaves(reloaded), jax.tree.leaves(model)):
        np.testing.assert_array_equal(a, b)


def _hf_greedy(hf, prompt, n):
    """Greedy tokens by Transformers' full forward at every step (no cache: the simplest reference;
    its cached generate() of a batch picks other tokens here where two logits are close)."""
    seq = torch.tensor(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, hf(seq).logits[:, -1:].argmax(-1)], dim=1)
    return seq[:, prompt.shape[1]:].numpy()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_cached_generate_and_beam_search(checkpoints, kind):
    """Greedy decoding with the cache gives Transformers' greedy tokens; beam search with one beam is greedy."""
    d, hf = checkpoints[kind]
    model = from_pretrained(d, one_device())
    prompt = _ids(batch=2, seq=5, seed=3)
    ours = np.asarray(jax.jit(lambda m, p: generate(m, p, max_new_tokens=6))(model, jnp.asarray(prompt)))
    np.testing.assert_array_equal(ours, _hf_greedy(hf, prompt, 6))
    beams = jax.jit(lambda m, p: beam_search(m, p, max_new_tokens=6, num_beams=1))(model, jnp.asarray(prompt))
    np.testing.assert_array_equal(np.asarray(beams).reshape(ours.shape), ours)


def _tiny(cls, **kw):
    if cls is MixtralConfig:
        return MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, num_local_experts=8, **kw)
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                          num_experts=8, num_experts_per_tok=2, **kw)


@pytest.mark.parametrize("model_cls,config_cls", [(MixtralForCausalLM, MixtralConfig),
                                                  (Qwen3MoeForCausalLM, Qwen3MoeConfig)])
@pytest.mark.slow
def test_init_model_puts_the_experts_on_model(model_cls, config_cls):
    mesh = redeqx.make_mesh(4)
    model = redeqx.init_model(lambda key: model_cls(_tiny(config_cls), key=key), mesh, key=jax.random.key(0))
    layer = model.model.layers
    block = layer.block_sparse_moe if model_cls is MixtralForCausalLM else layer.mlp
    assert block.experts.gate_proj.shape == (2, 8, 24, 32)
    for stack in (block.experts.gate_proj, block.experts.up_proj, block.experts.down_proj):
        assert stack.sharding.spec == P(None, "model", None, None)
        assert stack.addressable_shards[0].data.shape[1] == 2  # 8 experts over 4 shards
    assert block.gate.weight.sharding.spec in (P(), P(None, None, None))
    logits = jax.jit(jax.vmap(model))(jnp.asarray(_ids()))
    assert logits.shape == (2, 12, VOCAB) and bool(jnp.all(jnp.isfinite(logits)))


def test_configs_name_the_bad_value():
    with pytest.raises(ValueError, match="layers \\[1\\] are dense .* pass scan_layers=False"):
        _tiny(Qwen3MoeConfig, mlp_only_layers=(1,))
    assert _tiny(Qwen3MoeConfig, mlp_only_layers=(1,), scan_layers=False).sparse_layers == (True, False)
    with pytest.raises(ValueError, match="num_experts_per_tok=9 exceeds num_local_experts=8"):
        _tiny(MixtralConfig, num_experts_per_tok=9)
    with pytest.raises(TypeError, match="MixtralConfig"):
        MixtralForCausalLM(_tiny(Qwen3MoeConfig), key=jax.random.key(0))


def test_mixtral_sliding_window(tmp_path):
    """A window of 4: logits as Transformers' eager attention, greedy tokens as its greedy loop,
    and the window written back to config.json."""
    torch.manual_seed(0)
    config = _hf_config("mixtral")
    config.sliding_window = 4
    config._attn_implementation = "eager"
    hf = transformers.MixtralForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, one_device())
    assert model.config.sliding_window == 4
    ids = _ids()
    np.testing.assert_allclose(jax.jit(jax.vmap(model))(jnp.asarray(ids)), _torch(hf, ids).logits.numpy(), atol=1e-4, rtol=0)
    prompt = _ids(batch=1, seq=5, seed=3)
    ours = np.asarray(jax.jit(lambda m, p: generate(m, p, max_new_tokens=6))(model, jnp.asarray(prompt)))
    np.testing.assert_array_equal(ours, _hf_greedy(hf, prompt, 6))
    save_pretrained(model, tmp_path / "again")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "again").sliding_window == 4
