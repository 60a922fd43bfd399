r"""The zoo's families, one tiny config each: the table tests/test_family_contract.py
runs every family's contract over (and test_models_stacked.py, test_context_families.py
read). Adding a family is one entry in `FAMILIES`:

    "qwen2": Family(
        models.Qwen2ForCausalLM,
        models.Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2),
        megatron={  # every leaf's path (listed layers) matched by exactly one pattern, and its spec
            r"embed_tokens\.weight|lm_head\.weight|(q|k|v)_proj\.weight|(gate|up)_proj\.weight": COLUMNS,
            r"(q|k|v)_proj\.bias": SPLIT_BIAS,
            r"(o|down)_proj\.weight": ROWS,
            r"norm\.weight": REPLICATED,
        }),

``kind`` says how it is called: "causal" (``model(ids)``, generates from a prompt, splits
over a context axis), "moe" (causal, with ``model.with_aux``'s router statistics in its loss)
or "seq2seq" (``model(ids, decoder_ids, attention_mask=...)``, refuses a context axis).
Sizes: vocabulary `V`, width `H`, three layers (so a scan unrolled by 2 is not unrolled
whole); Transformers must load what ``save_pretrained`` writes from the config.
"""

import dataclasses
from typing import Literal

import jax

from redeqx import models

V, H = 96, 32

COLUMNS = "P('model', None)"  # column-parallel (and vocab-split) matrices: output features over 'model'
ROWS = "P(None, 'model')"  # row-parallel matrices: input features over 'model'
SPLIT_BIAS = "P('model',)"  # a column-parallel matrix's bias
REPLICATED = "P()"
EXPERTS = "P('model', None, None)"  # an expert stack (experts, out, in): experts over 'model'


@dataclasses.dataclass(frozen=True)
class Family:
    """A zoo family's model class, its tiny config, and its hand-written Megatron plan:
    ``{regex on a listed model's leaf path: the spec explain() shows for it}``."""

    model: type
    config: object
    megatron: dict[str, str]
    kind: Literal["causal", "moe", "seq2seq"] = "causal"

    def build(self, key=0, **changes):
        """The model, its config changed by ``changes`` (``scan_layers=False``, ...)."""
        return self.model(dataclasses.replace(self.config, **changes), key=jax.random.key(key))

    def logits(self, model, ids):
        """``model``'s logits for a batch of ids (a seq2seq model reads them and decodes their first 6)."""
        if self.kind == "seq2seq":
            return jax.vmap(lambda a: model(a, a[:6]))(ids)
        return jax.vmap(model)(ids)


_LLAMA_PLAN = {
    r"embed_tokens\.weight|lm_head\.weight|(q|k|v)_proj\.weight|(gate|up)_proj\.weight": COLUMNS,
    r"(q|k|v)_proj\.bias": SPLIT_BIAS,
    r"(o|down)_proj\.weight": ROWS,
    r"o_proj\.bias|norm\.weight": REPLICATED,
}
_MOE_PLAN = {
    r"embed_tokens\.weight|lm_head\.weight|(q|k|v)_proj\.weight": COLUMNS,
    r"o_proj\.weight": ROWS,
    r"experts\.(gate|up|down)_proj": EXPERTS,
    r"gate\.weight|norm\.weight": REPLICATED,  # the router: every device routes every token
}
_BART_LIKE_PLAN = {  # OPT and BART: learned positions, biases everywhere
    r"shared\.weight|embed_tokens\.weight|(q|k|v)_proj\.weight|fc1\.weight": COLUMNS,
    r"(q|k|v)_proj\.bias|fc1\.bias|^final_logits_bias": SPLIT_BIAS,  # BART's logit bias, with the split logits
    r"(out_proj|fc2)\.weight": ROWS,
    r"embed_positions\.weight|(out_proj|fc2)\.bias|(layer_norm|layernorm_embedding)\.(weight|bias)": REPLICATED,
}

FAMILIES = {
    "llama": Family(  # grouped-query attention, attention biases, llama3 RoPE scaling, untied head
        models.LlamaForCausalLM,
        models.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                           rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                         ("original_max_position_embeddings", 16), ("rope_type", "llama3")),
                           tie_word_embeddings=False),
        _LLAMA_PLAN),
    "gpt2": Family(
        models.GPT2LMHeadModel,
        models.GPT2Config(vocab_size=V, n_positions=32, n_embd=H, n_layer=3, n_head=4),
        {r"wte\.weight|(q|k|v)_proj\.weight|c_fc\.weight": COLUMNS,
         r"(q|k|v)_proj\.bias|c_fc\.bias": SPLIT_BIAS,
         r"c_proj\.weight": ROWS,
         r"wpe\.weight|c_proj\.bias|ln_(1|2|f)\.(weight|bias)": REPLICATED}),
    "gptj": Family(  # head_dim 8, of which the rotary embedding turns the first 4
        models.GPTJForCausalLM,
        models.GPTJConfig(vocab_size=V, n_positions=32, n_embd=H, n_layer=3, n_head=4, rotary_dim=4),
        {r"wte\.weight|lm_head\.weight|(q|k|v)_proj\.weight|fc_in\.weight": COLUMNS,
         r"lm_head\.bias|fc_in\.bias": SPLIT_BIAS,
         r"(out_proj|fc_out)\.weight": ROWS,
         r"fc_out\.bias|ln_(1|f)\.(weight|bias)": REPLICATED}),
    "opt": Family(
        models.OPTForCausalLM,
        models.OPTConfig(vocab_size=V, hidden_size=H, num_hidden_layers=3, ffn_dim=48, num_attention_heads=4,
                         max_position_embeddings=32),
        _BART_LIKE_PLAN),
    "bart": Family(  # the decoder two layers deep, the encoder three
        models.BartForConditionalGeneration,
        models.BartConfig(vocab_size=V, d_model=H, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=40,
                          max_position_embeddings=32, scale_embedding=True),
        _BART_LIKE_PLAN, kind="seq2seq"),
    "t5": Family(  # v1.1: gated GELU, its own LM head; 8 buckets up to distance 20
        models.T5ForConditionalGeneration,
        models.T5Config(vocab_size=V, d_model=H, d_kv=8, d_ff=48, num_layers=3, num_decoder_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, relative_attention_max_distance=20,
                        feed_forward_proj="gated-gelu", tie_word_embeddings=False),
        {r"^shared\.weight|^lm_head\.weight|Attention\.(q|k|v)\.weight|DenseReluDense\.(wi|wi_0|wi_1)\.weight": COLUMNS,
         r"Attention\.o\.weight|DenseReluDense\.wo\.weight": ROWS,
         r"relative_attention_bias\.weight": ROWS,  # (buckets, heads): heads, never buckets
         r"layer_norm\.weight": REPLICATED},
        kind="seq2seq"),
    "mixtral": Family(
        models.MixtralForCausalLM,
        models.MixtralConfig(vocab_size=V, hidden_size=H, intermediate_size=24, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                             num_experts_per_tok=2),
        _MOE_PLAN, kind="moe"),
    "qwen3_moe": Family(  # q/k norms, top-k weights renormalised, a tied head
        models.Qwen3MoeForCausalLM,
        models.Qwen3MoeConfig(vocab_size=V, hidden_size=H, intermediate_size=40, moe_intermediate_size=24,
                              head_dim=8, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                              num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True),
        _MOE_PLAN, kind="moe"),
    "qwen2": Family(  # LLaMA's blocks with q/k/v biases and no o_proj bias, a tied head
        models.Qwen2ForCausalLM,
        models.Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        _LLAMA_PLAN),
}
