"""Equinox models that load and save Hugging Face checkpoints, laid out so
that `redeqx.sharding_rules` gives the Megatron-LM plan with no overrides."""

from ._bart import BartConfig as BartConfig, BartForConditionalGeneration as BartForConditionalGeneration
from ._generate import (
    Decoder as Decoder,
    Recomputing as Recomputing,
    beam_search as beam_search,
    generate as generate,
    greedy as greedy,
    sample as sample,
)
from ._gpt2 import GPT2Config as GPT2Config, GPT2LMHeadModel as GPT2LMHeadModel
from ._gptj import GPTJConfig as GPTJConfig, GPTJForCausalLM as GPTJForCausalLM
from ._llama import LlamaConfig as LlamaConfig, LlamaForCausalLM as LlamaForCausalLM
from ._losses import cross_entropy as cross_entropy
from ._lora import LoRALinear as LoRALinear, lora as lora, lora_trainable as lora_trainable, merge_lora as merge_lora
from ._mixtral import MixtralConfig as MixtralConfig, MixtralForCausalLM as MixtralForCausalLM
from ._moe import (
    Experts as Experts,
    LoRAExperts as LoRAExperts,
    MoE as MoE,
    RouterStats as RouterStats,
    mix_experts as mix_experts,
    route as route,
    router_stats as router_stats,
)
from ._opt import OPTConfig as OPTConfig, OPTForCausalLM as OPTForCausalLM
from ._qwen2 import Qwen2Config as Qwen2Config, Qwen2ForCausalLM as Qwen2ForCausalLM
from ._qwen3_moe import Qwen3MoeConfig as Qwen3MoeConfig, Qwen3MoeForCausalLM as Qwen3MoeForCausalLM
from ._pretrained import from_pretrained as from_pretrained, save_pretrained as save_pretrained
from ._seq2seq import shift_right as shift_right
from ._t5 import T5Config as T5Config, T5ForConditionalGeneration as T5ForConditionalGeneration
from ._moe import RECOMPUTE as RECOMPUTE
