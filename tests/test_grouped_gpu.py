"""The Hopper GPU path of the MoE's grouped matmul (redeqx.models._grouped:
JAX's Mosaic GPU kernels ragged_dot_mgpu and transposed_ragged_dot_mgpu under a
custom_vjp), run here with XLA's products standing in for the kernels (same
signatures and constraints, rows past the groups left NaN as the kernel leaves
them unwritten): against jax.lax.ragged_dot_general and its JAX gradient; the
dispatch (`choose`) per device, dtype and shape; an MoE train step split over
two expert shards against one device. The kernels themselves run on a GPU:
``python -m benchmarks.moe_gpu``."""

import importlib
import warnings
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import grouped_operands, ragged, values_and_grads
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redeqx
from redeqx.models import MoE, _grouped
from redeqx.models._grouped import GATHERED, HOPPER, MEGABLOX, RAGGED_DOT, Blocks, Device, choose


@pytest.fixture
def calls(monkeypatch):
    """The stand-ins switched on, each call's (kernel, operand shapes, group count) recorded at trace time."""
    seen = []
    ragged, transposed = _grouped._StandIns.ragged_dot, _grouped._StandIns.transposed_ragged_dot

    def spy(name, f):
        def run(lhs, rhs, **kw):
            seen.append((name, lhs.shape, rhs.shape, kw["group_sizes"].shape[0]))
            return f(lhs, rhs, **kw)
        return staticmethod(run)

    monkeypatch.setattr(_grouped, "_stand_ins", True)
    monkeypatch.setattr(_grouped._StandIns, "ragged_dot", spy("ragged_dot", ragged))
    monkeypatch.setattr(_grouped._StandIns, "transposed_ragged_dot", spy("transposed", transposed))
    return seen


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("blocks", [Blocks(16, 16, 8, 2, 1), Blocks(32, 16, 16, 2, 2), Blocks()])
@pytest.mark.parametrize("sizes", [(9, 0, 14, 0, 7), (0, 21, 3, 13, 0)])  # 30 of 40 rows; all 37
def test_custom_vjp_matches_ragged_dot(calls, monkeypatch, dtype, tol, blocks, sizes):
    """Forward, input and weight gradients equal ragged_dot's and JAX's gradient of it: uneven and empty
    groups, rows past the groups (zero out, whatever the kernel left there), rows and widths (24 in,
    20 out) padded to blocks that do not divide them (the stand-ins raise on unaligned operands)."""
    monkeypatch.setattr(_grouped, "DEFAULT_BLOCKS", blocks)
    monkeypatch.setattr(_grouped, "BLOCKS", {})
    rows, w, ct, sizes = grouped_operands(sizes, dtype)
    got = values_and_grads(jax.jit(lambda *a: _grouped._hopper(*a)), rows, w, sizes, ct)  # traced anew: blocks
    want = values_and_grads(ragged, rows, w, sizes, ct)
    for name, a, b in zip(("out", "d rows", "d w"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype, name
        scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol * scale, rtol=0,
                                   err_msg=name)
    np.testing.assert_array_equal(got[0][int(sum(sizes)):], 0)  # rows past the groups: zero, as ragged_dot's
    np.testing.assert_array_equal(got[1][int(sum(sizes)):], 0)
    assert {c[0] for c in calls} == {"ragged_dot", "transposed"}


def test_a_kernel_without_transpose_rhs_gets_the_weights_transposed(calls, monkeypatch):
    """A JAX whose ragged_dot_mgpu has no ``transpose_rhs`` (it reads ``(E, k, n)`` only): the forward
    hands it the weights transposed and still equals ragged_dot."""
    stand_in = _grouped._StandIns.ragged_dot

    def without(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps, grid_block_n):
        return stand_in(lhs, rhs, group_sizes=group_sizes, block_m=block_m, block_n=block_n, block_k=block_k,
                      max_concurrent_steps=max_concurrent_steps, grid_block_n=grid_block_n)

    monkeypatch.setattr(_grouped._StandIns, "ragged_dot", staticmethod(without))
    ks = jax.random.split(jax.random.key(1), 2)
    rows, w = jax.random.normal(ks[0], (40, 24)), jax.random.normal(ks[1], (3, 20, 24))
    sizes = jnp.asarray([10, 0, 25], jnp.int32)
    np.testing.assert_allclose(_grouped._hopper(rows, w, sizes), ragged(rows, w, sizes), atol=1e-5)


H200 = Device("gpu", "NVIDIA H200", "9.0", 132)
BF16 = jnp.bfloat16


def _shapes(m=4096, k=2048, n=2816, experts=8, rows_dtype=BF16, w_dtype=BF16):
    return jax.ShapeDtypeStruct((m, k), rows_dtype), jax.ShapeDtypeStruct((experts, n, k), w_dtype)


@pytest.mark.parametrize("device,shapes,whole,path,why", [
    (H200, _shapes(), True, HOPPER, "Hopper"),
    (Device("gpu", "NVIDIA H100 80GB HBM3", "9.0", 132), _shapes(m=5, k=2816, n=2048, experts=128), True, HOPPER, ""),
    (Device("cpu", "cpu"), _shapes(), True, RAGGED_DOT, "platform cpu"),
    (Device("tpu", "TPU v4"), _shapes(), True, MEGABLOX, "TPU"),
    (Device("tpu", "TPU v4"), _shapes(), False, RAGGED_DOT, "splits the operands"),
    (Device("gpu", "NVIDIA A100-SXM4-80GB", "8.0", 108), _shapes(), True, RAGGED_DOT, "compute capability 8.0"),
    (Device("gpu", "NVIDIA B200", "10.0", 148), _shapes(), True, RAGGED_DOT, "compute capability 10.0"),
    (Device("gpu", "NVIDIA H200"), _shapes(), True, RAGGED_DOT, "compute capability unknown"),
    (Device("gpu", "NVIDIA H100 PCIe", "9.0", 114), _shapes(), True, RAGGED_DOT, "114 SMs"),
    (H200, _shapes(w_dtype=jnp.float32), True, RAGGED_DOT, "rows of bfloat16 and weights of float32"),
    (H200, _shapes(rows_dtype=jnp.float32, w_dtype=jnp.float32), True, RAGGED_DOT, "dtype float32"),
    (H200, _shapes(k=64), True, RAGGED_DOT, "width 64 into 2816"),
    (H200, _shapes(n=32), True, RAGGED_DOT, "into 32"),
    (H200, _shapes(m=0), True, RAGGED_DOT, "0 rows"),
    (H200, _shapes(), False, RAGGED_DOT, "splits the operands"),
    # a decoding step's few rows: gathered where ragged_dot would read every expert, the kernels elsewhere
    (Device("gpu", "NVIDIA A100-SXM4-80GB", "8.0", 108), _shapes(m=2), True, GATHERED, "compute capability 8.0"),
    (Device("cpu", "cpu"), _shapes(m=7), True, GATHERED, "7 rows for 8 experts"),
    (Device("cpu", "cpu"), _shapes(m=8), True, RAGGED_DOT, "platform cpu"),
    (H200, _shapes(m=2), True, HOPPER, "Hopper"),
    (Device("tpu", "TPU v4"), _shapes(m=2), True, MEGABLOX, "TPU"),
])
def test_choose_takes_the_kernels_only_where_they_apply(device, shapes, whole, path, why):
    got, reason = choose(device, *shapes, whole=whole)
    assert got == path and why in reason, (got, reason)


def test_grouped_runs_what_choose_names_and_says_why_once(calls):
    """Through `grouped` on the stand-in H100: bfloat16 takes the kernels; float32 takes ragged_dot
    with one warning naming the reason, however often it is traced."""
    _grouped._tell.cache_clear()
    rows, w = jnp.ones((8, 128), BF16), jnp.ones((2, 128, 128), BF16)
    sizes = jnp.array([3, 5], jnp.int32)
    np.testing.assert_array_equal(_grouped.grouped(rows, w, sizes), ragged(rows, w, sizes))
    assert [c[0] for c in calls] == ["ragged_dot"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _grouped.grouped(rows.astype(jnp.float32), w.astype(jnp.float32), sizes)
    assert len(calls) == 1 and len(caught) == 1
    assert "ragged_dot" in str(caught[0].message) and "dtype float32" in str(caught[0].message)


@pytest.mark.parametrize("sizes", [(1, 0, 2, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0, 0, 4), (2, 0, 0, 1, 0, 0, 1, 0)])
def test_fewer_rows_than_experts_are_gathered_with_ragged_dots_values_and_gradients(sizes):
    """A decoding step's 2-8 rows through 8 experts: each row by its own expert's weights (rows past
    the groups zero), where XLA's ragged_dot reads every expert; the same values and gradients."""
    rows, w, ct, sizes = grouped_operands(sizes, jnp.float32)
    rows, ct = rows[:4], ct[:4]  # fewer rows than the 8 experts
    assert choose(Device("cpu", "cpu"), rows, w)[0] == GATHERED
    got, want = values_and_grads(_grouped.grouped, rows, w, sizes, ct), values_and_grads(ragged, rows, w, sizes, ct)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[0])[int(sizes.sum()):].any()
    assert "ragged_dot" not in str(jax.make_jaxpr(_grouped.grouped)(rows, w, sizes))


def test_a_compile_for_a_described_hopper_gpu_takes_its_kernels(monkeypatch):
    """Compiled ahead of time for H100s none of which is attached (`benchmarks.gpu_compile`, a
    plan made on a CPU host), the grouped matmuls read the GPU's compute capability off the mesh's
    devices, as a step traced under that mesh sees them; the abstract mesh names only the kind, and
    left the plan on ragged_dot, a program the GPU would never run."""
    mesh, seen = redeqx.make_mesh(1), []
    with jax.set_mesh(mesh):
        jax.jit(lambda x: seen.append(_grouped._concrete_mesh()) or x)(1.0)  # inside a trace
    assert seen[0].devices.tolist() == mesh.devices.tolist()

    class H100:
        platform, device_kind, compute_capability, core_count = "gpu", "NVIDIA H100 80GB HBM3", "9.0", 132

    def devices(platform=None):
        if platform == "gpu":
            raise RuntimeError("no gpu here")
        return [H100()]

    monkeypatch.setattr(_grouped, "traced_platform", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", devices)
    monkeypatch.setattr(_grouped, "_concrete_mesh", lambda: type("M", (), {"empty": False, "devices": np.array([H100()])}))
    assert _grouped._device() == Device("gpu", "NVIDIA H100 80GB HBM3", "9.0", 132)
    assert choose(_grouped._device(), *_shapes())[0] == HOPPER


def test_a_jax_without_the_kernels_is_told(calls, monkeypatch):
    _grouped._tell.cache_clear()
    monkeypatch.setattr(_grouped, "_kernels", lambda: None)
    rows, w, sizes = jnp.ones((8, 128), BF16), jnp.ones((2, 128, 128), BF16), jnp.array([3, 5], jnp.int32)
    with pytest.warns(UserWarning, match="does not ship jax.experimental.pallas.ops.gpu.ragged_dot_mgpu"):
        np.testing.assert_array_equal(_grouped.grouped(rows, w, sizes), ragged(rows, w, sizes))
    assert not calls


def test_real_kernels_trace_with_the_arguments_passed(monkeypatch):
    """JAX's own Mosaic GPU kernels accept what the wiring passes them (traced, not run: no GPU here)."""
    rows, w = jax.ShapeDtypeStruct((300, 256), BF16), jax.ShapeDtypeStruct((4, 384, 256), BF16)
    sizes, ct = jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((300, 384), BF16)
    assert jax.make_jaxpr(lambda r, w, s: _grouped._ragged_mgpu(r, w, s, transpose=True))(
        rows, w, sizes).out_avals[0].shape == (300, 384)
    assert jax.make_jaxpr(lambda c, w, s: _grouped._ragged_mgpu(c, w, s, transpose=False))(
        ct, w, sizes).out_avals[0].shape == (300, 256)

    class H100:  # transposed_ragged_dot_mgpu reads jax.devices()[0].core_count when traced
        core_count = 132

    monkeypatch.setattr(jax, "devices", lambda *a: [H100()])
    assert jax.make_jaxpr(_grouped._transposed_mgpu)(ct, rows, sizes).out_avals[0].shape == (4, 384, 256)


def _moe_step_grads(n_model):
    """An MoE layer's gradient from one SGD step (lr 1) in bfloat16 compute on ``n_model`` expert
    shards (the rules split the stacks on E), and the stacks' spec."""
    model = MoE(hidden=128, intermediate=128, n_experts=4, k=2, key=jax.random.key(0))
    model = eqx.tree_at(lambda m: m.gate.weight, model, model.gate.weight * 8)  # a router that decides

    def loss_fn(model, batch, key):
        y, stats = jax.vmap(model)(batch["x"].astype(model.gate.weight.dtype))
        return jnp.mean(y.astype(jnp.float32) ** 2) + 0.01 * stats.load_balancing_loss()

    mesh = redeqx.make_mesh(n_model, devices=jax.devices()[:n_model])
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.sgd(1.0), mesh, specs, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (2, 24, 128))
    step = redeqx.make_train_step(loss_fn, optax.sgd(1.0), mesh, specs, compute_dtype=jnp.bfloat16)
    state, _ = step(state, {"x": jax.device_put(x, NamedSharding(mesh, P("data")))})
    params = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    return [np.asarray(a) - np.asarray(b) for a, b in zip(params(model), params(state.model))], specs


@pytest.mark.slow
def test_expert_parallel_step_through_the_kernels_matches_one_device(calls):
    """One train step over 2 expert shards through the Hopper path gives one device's gradients, and
    each device's kernels see only its own 2 of the 4 experts."""
    want, _ = _moe_step_grads(1)
    assert {c[0] for c in calls} == {"ragged_dot", "transposed"} and {c[3] for c in calls} == {4}
    calls.clear()
    got, specs = _moe_step_grads(2)
    assert specs.experts.gate_proj == P("model", None, None)
    assert {c[0] for c in calls} == {"ragged_dot", "transposed"} and {c[3] for c in calls} == {2}
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-2 * np.abs(b).max(), rtol=0)


@pytest.mark.parametrize("n_experts,split", [(4, False), (3, True)])
def test_a_mesh_axis_that_splits_the_operands_is_told_once(calls, n_experts, split):
    """On data 2 x model 2: 4 experts run the kernels inside mix_experts' shard_map (no warning, though
    custom_vmap first traces its unbatched body where `model` is not manual); 3 experts, which `model`
    does not divide, leave `model` splitting the operands: ragged_dot, and a warning that says so."""
    _grouped._tell.cache_clear()
    ks = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(ks[0], (4, 6, 128), BF16)
    weights, index = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[1], (4, 6, n_experts))), 2)
    stacks = [jax.random.normal(k, s, BF16) for k, s in zip(ks[2:], [(n_experts, 128, 128)] * 3)]

    def loss(x, *stacks):
        y = jax.vmap(lambda x, i, w: redeqx.models.mix_experts(x, i, w, *stacks))(x, index, weights.astype(BF16))
        return jnp.sum(y.astype(jnp.float32) ** 2)

    with warnings.catch_warnings(record=True) as caught, jax.set_mesh(redeqx.make_mesh(2, devices=jax.devices()[:4])):
        warnings.simplefilter("always")
        jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(x, *stacks)
    told = [str(w.message) for w in caught if "redeqx.models.MoE" in str(w.message)]
    message = ("redeqx.models.MoE: the grouped matmuls run jax.lax.ragged_dot, which XLA's GPU backend expands into "
               f"a product over every expert, not the Hopper kernels: {_grouped._SPLIT}.")
    assert (told == [message]) == split, told
    assert bool(calls) != split


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    return importlib.import_module("benchmarks.moe_gpu")


def test_the_benchmark_names_why_it_cannot_run_here(bench):
    with pytest.raises(RuntimeError, match="platform cpu.*--cpu-smoke"):
        bench.grouped_matmul_bench(rows=64, hidden=128, width=128, experts=2)


@pytest.mark.slow
def test_the_benchmark_runs_on_the_stand_ins(calls, bench):
    """benchmarks/moe_gpu.py's FFN timing and block sweep at tiny shapes (--cpu-smoke's path)."""
    r = bench.grouped_matmul_bench(rows=256, hidden=128, width=128, experts=3, rounds=1, steps=1)
    assert r["equal"] and r["path"] == HOPPER and set(r["forward_backward_ms"]) == {"kernels", "xla", "dense"}
    s = bench.block_sweep(rows=256, hidden=128, width=128, experts=3, configs=(Blocks(),), rounds=1, steps=1)
    assert s["table"].count("Blocks(") == 6 and s["forward/down"]["max_rel_err"] < 2e-2
