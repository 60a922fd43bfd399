"""The context axis: sequences split over devices, `attention` over them, and the checks a split step runs."""

from ._context import (
    IMPLS as IMPLS,
    attention as attention,
    batch_spec as batch_spec,
    check_per_token_keys as check_per_token_keys,
    check_seq_keys as check_seq_keys,
    check_whole_keys as check_whole_keys,
    context_axis as context_axis,
    context_order as context_order,
    context_shards as context_shards,
    fused_attention as fused_attention,
    mesh_context as mesh_context,
    order_sequences as order_sequences,
    restore_order as restore_order,
    sequence_positions as sequence_positions,
    split_lengths as split_lengths,
    splitting as splitting,
)
from ._blockwise import masked_attention as masked_attention
from ._context_checks import check_split_program as check_split_program
