"""The Megatron-LM plan's analytic collective bytes for one training step,
and a train step at n_model_shards=4 checked against one device.

Steps are held to the bytes a GPU or TPU moves (tests/accelerator_count.py):
XLA:CPU all-reduces each of several partial sums that are added (Q, K and V's
input gradients) where the accelerators' compilers reduce their sum once
(libtpu's own programs agree: benchmarks/RESULTS.md, History: "XLA:CPU
rewrites on libtpu")."""

import jax
import jax.numpy as jnp
import numpy as np
import redeqx
from accelerator_count import accelerator_collectives
from jax.sharding import NamedSharding, PartitionSpec as P


def step_at_4_shards_vs_one_device(model, optimizer, loss_fn, batch):
    """One train step at n_model_shards=4 and on one device: checks they give
    the same loss and parameters, and returns ``(mesh, sharded state,
    the sharded step's collectives as an accelerator moves them)``."""

    def run(n_model, devices):
        mesh = redeqx.make_mesh(n_model, devices=devices)
        specs = redeqx.sharding_rules(model, mesh)
        fresh = jax.tree.map(lambda x: jnp.array(x, copy=True), model)  # the step donates its input
        state = redeqx.init_state(fresh, optimizer, mesh, specs, key=jax.random.key(0))
        placed = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, NamedSharding(mesh, P("data")))
        step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
        summary = accelerator_collectives(step, state, placed)
        state, metrics = step(state, placed)
        return mesh, state, metrics, summary

    mesh, state4, metrics4, summary = run(4, None)
    _, state1, metrics1, _ = run(1, jax.devices()[:1])
    np.testing.assert_allclose(metrics4["loss"], metrics1["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state4.model), jax.tree.leaves(state1.model)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    return mesh, state4, summary


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


def megatron_bytes_encoder_decoder(
    hidden: int, n_encoder: int, n_decoder: int, local_batch: int, src: int, tgt: int, grad_bytes: int
) -> int:
    """The same count for a T5-style encoder-decoder with a vocab-split embedding
    shared by both stacks and the (tied or untied) vocab-split LM head.

    With ``enc = local_batch * src * hidden * 4`` and ``dec = local_batch * tgt * hidden * 4``
    bytes per activation, Megatron-LM's encoder-decoder plan all-reduces:
    - forward: each stack's embedding lookup (1 ``enc`` + 1 ``dec``); per encoder
      block the self-attention output and the FF output (2 ``enc``); per decoder
      block the self-attention, cross-attention and FF outputs (3 ``dec``);
    - backward: per encoder block the input gradients of Q/K/V and of the FF's
      first projection(s) (2 ``enc``); per decoder block those of the self Q/K/V,
      the cross-attention Q and the FF (3 ``dec``) plus the cross-attention K/V
      projection of the encoder output, whose input gradient is a partial sum
      over ``model`` (1 ``enc`` per decoder block); the LM head's input gradient (1 ``dec``);
    - the vocab-split cross-entropy: 3 reductions of ``local_batch * tgt`` floats;
    - the data-parallel gradient all-reduce (``grad_bytes``).
    The relative position bias table is split on its heads, as the scores are,
    so it adds nothing.
    """
    enc = local_batch * src * hidden * 4
    dec = local_batch * tgt * hidden * 4
    forward = (1 + 2 * n_encoder) * enc + (1 + 3 * n_decoder) * dec
    backward = (2 * n_encoder + n_decoder) * enc + (3 * n_decoder + 1) * dec
    loss = 3 * local_batch * tgt * 4
    return forward + backward + loss + grad_bytes


def gradient_bytes(model) -> int:
    """The bytes one device holds of ``model``'s arrays: what its data-parallel gradient all-reduce carries."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(model))


def near_megatron(summary: dict, analytic: int, name: str, slack: float = 1.15) -> float:
    """Asserts a train step's collectives (``accelerator_collectives``'s summary) are all-reduces
    only (no activation gathers) moving at most ``slack`` x Megatron's ``analytic`` bytes; prints
    and returns the ratio."""
    moved = sum(v["bytes"] for v in summary.values())
    assert set(summary) == {"all-reduce"}, summary
    assert moved <= slack * analytic, (moved, analytic, summary)
    print(f"{name} train step at n_model_shards=4: {moved} bytes, {moved / analytic:.3f}x Megatron's {analytic}")
    return moved / analytic
