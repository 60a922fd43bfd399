"""The GPU profile's reader (`benchmarks._profile`), on a program compiled here: which instruction
each kernel ran, and so its kind, is what issue 51's split of a step's device time rests on."""

import re

import jax
import jax.numpy as jnp
import optax

from benchmarks import _profile


def _step_text() -> str:
    def loss_fn(w, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(jnp.tanh(x @ w) @ w.T, y).mean()

    def optimizer_update(w, g):
        return w - 0.1 * jnp.sign(g) * jnp.sqrt(jnp.abs(g) + 1e-8)

    def step(w, x, y):
        return optimizer_update(w, jax.grad(loss_fn)(w, x, y))

    return jax.jit(step).lower(jnp.ones((8, 8)), jnp.ones((4, 8)), jnp.zeros(4, jnp.int32)).compile().as_text()


def test_kernels_inside_a_command_buffer_are_found_by_the_names_xla_gives_them():
    """Inside a CUDA command buffer every kernel's ``hlo_op`` is the buffer; the kernel itself is
    named after its fusion with '.' made '_' (``%loop_slice_fusion.26`` runs as
    ``loop_slice_fusion_26``). Read by the raw name, every fusion fell into "other" (40.5 ms of
    the H200's 1B step)."""
    text = _step_text()
    ops = _profile.hlo_ops(text)
    fusions = [n for n, o in ops.items() if o["opcode"] == "fusion"]
    assert any("." in n for n in fusions)  # the names the raw kernel name missed
    kernels = [re.sub(r"[^A-Za-z0-9_$]", "_", n) for n in fusions] + ["nvjet_tst_64x8_64x16_4x1_v_bz_TNN"]
    events = [(k, "command_buffer.1", 100 * i, 10_000) for i, k in enumerate(kernels)]
    out = _profile.tally(events, text, steps=1)
    ms = out["ms_per_step"]
    assert ms["other"] == 0, out["top"]
    assert ms["matmuls"] >= 0.01 and ms["optimizer update"] > 0 and ms["loss"] > 0
    assert {t["op"] for t in out["top"]} == set(fusions) | {kernels[-1]}  # each kernel booked to its instruction
