"""The GPU profile's reader (`benchmarks._profile`), on a program compiled here: which instruction
each kernel ran, and so its kind, is what issue 51's split of a step's device time rests on."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

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
    # the time outside matmuls and attention, by the function each kernel's code came from
    split = {(r["kind"], r["function"]): r["ms"] for r in out["by_source"]}
    assert sum(split.values()) == pytest.approx(sum(v for k, v in ms.items() if k not in ("matmuls", "attention")))
    assert [f for k, f in split if k == "optimizer update"] == ["_step_text.<locals>.optimizer_update"], split
    assert {k for k, _ in split} >= {"loss", "optimizer update"} and all(r["kernels"] >= 1 for r in out["by_source"])


# An XLA:GPU program's text, cut down to what the static reader looks at: a fusion that only
# slices one parameter, one that writes a slice in place, a cuBLAS fp8 call with its workspace,
# a Triton GEMM on fp8 parameters, all inside a loop of 64 trips.
_GPU_TEXT = """HloModule m

%sliced (p0: bf16[22,1024,256]) -> bf16[1,1024,256] {
  %p0 = bf16[22,1024,256]{2,1,0} parameter(0)
  ROOT %s = bf16[1,1024,256]{2,1,0} slice(%p0), slice={[3:4], [0:1024], [0:256]}
}

%in_place (p0: f32[8,128], p1: f32[1,128], p2: s32[]) -> f32[8,128] {
  %p0 = f32[8,128]{1,0} parameter(0)
  %p1 = f32[1,128]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f32[8,128]{1,0} dynamic-update-slice(%p0, %p1, %p2, %z)
}

%gemm (p0: f8e4m3fn[16,256], p1: f8e4m3fn[256,64]) -> bf16[16,64] {
  %p0 = f8e4m3fn[16,256]{1,0} parameter(0)
  %p1 = f8e4m3fn[256,64]{1,0} parameter(1)
  ROOT %d = bf16[16,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (bf16[22,1024,256], f32[8,128], f32[1,128], s32[], f8e4m3fn[16,256], f8e4m3fn[256,64])) -> (bf16[22,1024,256], f32[8,128], f32[1,128], s32[], f8e4m3fn[16,256], f8e4m3fn[256,64]) {
  %t = (bf16[22,1024,256], f32[8,128], f32[1,128], s32[], f8e4m3fn[16,256], f8e4m3fn[256,64]) parameter(0)
  %w = bf16[22,1024,256]{2,1,0} get-tuple-element(%t), index=0
  %c = f32[8,128]{1,0} get-tuple-element(%t), index=1
  %n = f32[1,128]{1,0} get-tuple-element(%t), index=2
  %i = s32[] get-tuple-element(%t), index=3
  %a = f8e4m3fn[16,256]{1,0} get-tuple-element(%t), index=4
  %b = f8e4m3fn[256,64]{1,0} get-tuple-element(%t), index=5
  %wrapped_slice = bf16[1,1024,256]{2,1,0} fusion(%w), kind=kLoop, calls=%sliced
  %loop_dynamic_update_slice_fusion = f32[8,128]{1,0} fusion(%c, %n, %i), kind=kLoop, calls=%in_place
  %cublas-gemm = (bf16[16,64]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"
  %gemm_fusion = bf16[16,64]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %r = (bf16[22,1024,256], f32[8,128], f32[1,128], s32[], f8e4m3fn[16,256], f8e4m3fn[256,64]) tuple(%w, %loop_dynamic_update_slice_fusion, %n, %i, %a, %b)
}

%cond (c: (bf16[22,1024,256], f32[8,128], f32[1,128], s32[], f8e4m3fn[16,256], f8e4m3fn[256,64])) -> pred[] {
  %c = (bf16[22,1024,256], f32[8,128], f32[1,128], s32[], f8e4m3fn[16,256], f8e4m3fn[256,64]) parameter(0)
  ROOT %go = pred[] constant(true)
}

ENTRY %main (t: (bf16[22,1024,256], f32[8,128], f32[1,128], s32[], f8e4m3fn[16,256], f8e4m3fn[256,64])) -> (bf16[22,1024,256], f32[8,128], f32[1,128], s32[], f8e4m3fn[16,256], f8e4m3fn[256,64]) {
  %t = (bf16[22,1024,256], f32[8,128], f32[1,128], s32[], f8e4m3fn[16,256], f8e4m3fn[256,64]) parameter(0)
  ROOT %loop = (bf16[22,1024,256], f32[8,128], f32[1,128], s32[], f8e4m3fn[16,256], f8e4m3fn[256,64]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"64"}}
}
"""


def test_the_static_reader_counts_what_each_kernel_moves():
    """`static_tally`'s bytes, the ground the H100 compile's split of a step rests on: a parameter
    only sliced is read as its slice (one layer, not the stack), a buffer written in place as the
    slice written, a cuBLAS call's workspace not at all, and a loop's body once per trip."""
    moved = {k["name"]: (k["bytes"], k["times"]) for k in _profile.kernels(_GPU_TEXT)}
    layer = 1024 * 256 * 2
    assert moved["wrapped_slice"] == (2 * layer, 64)  # read one layer, write it: not the 22-layer stack
    assert moved["loop_dynamic_update_slice_fusion"] == (2 * 128 * 4 + 4, 64)  # the row read and written, the index
    assert moved["cublas-gemm"] == (16 * 256 + 256 * 64 + 16 * 64 * 2, 64)  # no workspace
    assert _profile.gemms(_GPU_TEXT) == {"gemms": 2, "fp8_gemms": 2}
    assert _profile.longest_loop(_GPU_TEXT) == ("body", 64)
    assert _profile.loop_copies(_GPU_TEXT) == {"copies_per_token": 1, "copied_bytes_per_token": 2 * layer}
    tally = _profile.static_tally(_GPU_TEXT, bandwidth=1e12)
    assert tally["kernels"]["copies"] == 64 and tally["gb"]["copies"] == round(64 * 2 * layer / 1e9, 3)
    assert sum(r["gb"] for r in tally["by_source"] if r["kind"] == "copies") == tally["gb"]["copies"]


# A batched cache written at each sequence's slot (a scatter, in place), an embedding table read at
# a few rows (a gather), and an asynchronous copy: what a batched token's step runs.
_WRITES_TEXT = """HloModule w

%scatter_add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  ROOT %b = bf16[] parameter(1)
}

%fused_scatter (p0: bf16[8,4096,64], p1: s32[8,2], p2: bf16[8,1,64]) -> bf16[8,4096,64] {
  %p0 = bf16[8,4096,64]{2,1,0} parameter(0)
  %p1 = s32[8,2]{1,0} parameter(1)
  %p2 = bf16[8,1,64]{2,1,0} parameter(2)
  ROOT %s = bf16[8,4096,64]{2,1,0} scatter(%p0, %p1, %p2), update_window_dims={1,2}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0,1}, index_vector_dim=1, to_apply=%scatter_add
}

%fused_gather (p0: bf16[32000,2048], p1: s32[8,1]) -> bf16[8,2048] {
  %p0 = bf16[32000,2048]{1,0} parameter(0)
  %p1 = s32[8,1]{1,0} parameter(1)
  ROOT %g = bf16[8,2048]{1,0} gather(%p0, %p1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,2048}
}

ENTRY %main (c: bf16[8,4096,64], i: s32[8,2], u: bf16[8,1,64], t: bf16[32000,2048], r: s32[8,1]) -> (bf16[8,4096,64], bf16[8,2048], bf16[8,4096,64], bf16[32000,2048]) {
  %c = bf16[8,4096,64]{2,1,0} parameter(0)
  %i = s32[8,2]{1,0} parameter(1)
  %u = bf16[8,1,64]{2,1,0} parameter(2)
  %t = bf16[32000,2048]{1,0} parameter(3)
  %r = s32[8,1]{1,0} parameter(4)
  %input_scatter_fusion = bf16[8,4096,64]{2,1,0} fusion(%c, %i, %u), kind=kInput, calls=%fused_scatter
  %loop_gather_fusion = bf16[8,2048]{1,0} fusion(%t, %r), kind=kLoop, calls=%fused_gather
  %copy-start = (bf16[8,4096,64]{2,1,0}, bf16[8,4096,64]{2,1,0}, u32[]) copy-start(%input_scatter_fusion)
  %copy-done = bf16[8,4096,64]{2,1,0} copy-done(%copy-start)
  %prefetch-start = (bf16[32000,2048]{1,0}, bf16[32000,2048]{1,0:T(8,128)(2,1)S(3)}, u32[]) copy-start(%t)
  %prefetch-done = bf16[32000,2048]{1,0:T(8,128)(2,1)S(3)} copy-done(%prefetch-start)
  ROOT %out = (bf16[8,4096,64], bf16[8,2048], bf16[8,4096,64], bf16[32000,2048]) tuple(%input_scatter_fusion, %loop_gather_fusion, %copy-done, %prefetch-done)
}
"""


def test_the_static_reader_counts_in_place_scatters_gathered_rows_and_async_copies_once():
    """A token's step writes each sequence's new keys into the cache (a scatter XLA does in place)
    and reads the embedding table at its tokens: counted whole, the 1B's batched token seemed to
    move 1.4 GiB of cache and 125 MiB of table it does not touch. An asynchronous copy moves its
    operand once (read and written), not its start's and done's tuples; one into another memory
    (libtpu's prefetch of a weight, 636 MiB a token of the listed 1B) is how the chip reads it."""
    kernels = _profile.kernels(_WRITES_TEXT)
    moved = {k["name"]: k["bytes"] for k in kernels}
    update, cache = 8 * 64 * 2, 8 * 4096 * 64 * 2
    assert moved["input_scatter_fusion"] == 8 * 2 * 4 + 2 * update  # the indices, the update read and written
    assert moved["loop_gather_fusion"] == 8 * 4 + 2 * 8 * 2048 * 2  # the row ids, 8 rows read and written
    assert moved["copy-start"] + moved["copy-done"] == 2 * cache
    assert {k["name"] for k in kernels if k["between_memories"]} == {"prefetch-start", "prefetch-done"}


# Two float32 stacks of 22 layers cast to bf16 and sliced at one layer, then stacked (a stacked
# model's gate and up weights joined into one product, as XLA:GPU fuses them), and one stack cast
# whole.
_CAST_TEXT = """HloModule c

%fused_joined (p0: f32[22,512,256], p1: f32[22,512,256]) -> bf16[2,512,256] {
  %p0 = f32[22,512,256]{2,1,0} parameter(0)
  %c0 = bf16[22,512,256]{2,1,0} convert(%p0)
  %s0 = bf16[1,512,256]{2,1,0} slice(%c0), slice={[19:20], [0:512], [0:256]}
  %p1 = f32[22,512,256]{2,1,0} parameter(1)
  %c1 = bf16[22,512,256]{2,1,0} convert(%p1)
  %s1 = bf16[1,512,256]{2,1,0} slice(%c1), slice={[19:20], [0:512], [0:256]}
  ROOT %j = bf16[2,512,256]{2,1,0} concatenate(%s0, %s1), dimensions={0}
}

%fused_cast (p0: f32[22,512,256]) -> bf16[22,512,256] {
  %p0 = f32[22,512,256]{2,1,0} parameter(0)
  ROOT %c = bf16[22,512,256]{2,1,0} convert(%p0)
}

ENTRY %main (a: f32[22,512,256], b: f32[22,512,256]) -> (bf16[2,512,256], bf16[22,512,256]) {
  %a = f32[22,512,256]{2,1,0} parameter(0)
  %b = f32[22,512,256]{2,1,0} parameter(1)
  %input_concatenate_fusion = bf16[2,512,256]{2,1,0} fusion(%a, %b), kind=kInput, calls=%fused_joined
  %loop_convert_fusion = bf16[22,512,256]{2,1,0} fusion(%a), kind=kLoop, calls=%fused_cast
  ROOT %out = (bf16[2,512,256], bf16[22,512,256]) tuple(%input_concatenate_fusion, %loop_convert_fusion)
}
"""


def test_a_stack_cast_then_sliced_is_read_at_its_slice():
    """XLA:GPU casts a layer's weights out of a float32 stack inside the fusion that slices them: the
    kernel reads the layer, not the stack (counted whole, the 1B step's joined gate and up weights
    seemed to read 45.7 GB a step where they move 3.0)."""
    moved = {k["name"]: k["bytes"] for k in _profile.kernels(_CAST_TEXT)}
    layer = 512 * 256
    assert moved["input_concatenate_fusion"] == 2 * layer * 4 + 2 * layer * 2  # two f32 layers in, bf16 out
    assert moved["loop_convert_fusion"] == 22 * layer * (4 + 2)  # a cast of the whole stack reads it whole


def test_the_gpu_report_sets_each_functions_time_beside_its_bytes():
    """`benchmarks.gpu`'s train section joins the profile's time by function with the bytes the
    program's text says the same kernels move: the share of the measured bandwidth each reaches."""
    from benchmarks.gpu import _by_source_rows

    prof = {"by_source": [{"kind": "norms and elementwise", "function": "RMSNorm.__call__", "ms": 12.0, "kernels": 315},
                          {"kind": "loss", "function": "cross_entropy", "ms": 2.0, "kernels": 9}],
            "static": {"by_source": [{"kind": "norms and elementwise", "function": "RMSNorm.__call__", "gb": 36.0,
                                      "kernels": 315}]}}
    rows = _by_source_rows(prof, bandwidth=4.8e12)
    assert rows[-2] == "| `RMSNorm.__call__` | norms and elementwise | 12.00 | 315 | 36.00 | 62% |"  # 7.5 ms of 12
    assert rows[-1] == "| `cross_entropy` | loss | 2.00 | 9 |  |  |"  # no bytes read for it: no share
    assert _by_source_rows({"static": {}}, bandwidth=4.8e12) == []


def test_the_losses_own_derivative_rules_are_booked_as_the_loss():
    """`redeqx.models.cross_entropy`'s derivative rule names only itself in the metadata
    (``_tangent``, from its module): booked as the loss by its file, not as elementwise work (the
    hand-written 1B step's loss read 0.4 GB of its 4.6 before)."""
    op = {"opcode": "fusion", "target": "", "inner": ["exponential", "subtract"],
          "frames": [("/site-packages/redeqx/models/_losses.py", "_tangent")]}
    assert _profile.kind_of(op) == "loss"
    assert _profile.kind_of({**op, "frames": [("/site-packages/redeqx/models/_layers.py", "_tangent")]}) == \
        "norms and elementwise"
