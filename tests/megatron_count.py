"""The Megatron-LM plan's analytic collective bytes for one training step."""


def megatron_bytes(hidden: int, n_layers: int, local_batch: int, seq: int, grad_bytes: int) -> int:
    """Per-device bytes of the collectives of one Megatron-LM training step (float32).

    An activation is ``local_batch * seq * hidden`` floats, and:
    - forward: the vocab-split embedding lookup is summed over ``model`` (1
      all-reduce), and each layer all-reduces the outputs of its two
      row-parallel matmuls, attention output and MLP down projection (2 per layer);
    - backward: each layer all-reduces the input gradients of its two
      column-parallel groups, Q/K/V and the MLP up projection(s) (2 per
      layer), and the vocab-split LM head all-reduces its input gradient (1);
    - the cross-entropy over vocab-split logits reduces a max, a sum of
      exponentials and the target logit, ``local_batch * seq`` floats each (3);
    - data parallelism all-reduces each device's shard of the gradients
      (``grad_bytes``: the parameter bytes one device holds).
    """
    act = local_batch * seq * hidden * 4
    forward = (1 + 2 * n_layers) * act
    backward = (2 * n_layers + 1) * act
    loss = 3 * local_batch * seq * 4
    return forward + backward + loss + grad_bytes
