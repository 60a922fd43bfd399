"""The grouped matmul of `redeqx.models.mix_experts`: rows in consecutive
groups, each group multiplied by its own expert's weights, the one place that
chooses how. `choose` decides from the device, the dtypes and the shapes:

- on a TPU, megablox's Pallas kernels (``jax.experimental.pallas.ops.tpu.megablox``,
  what MaxText runs its dropless MoE with): ``gmm`` for the product and for its
  input gradient, ``tgmm`` for the weight gradient (`_weight_grad`). Each walks
  only the row tiles that hold some group's rows, and ``tgmm`` multiplies each
  expert's weight gradient by that expert's rows only, where XLA's
  ``ragged_dot`` weight gradient is a product over every expert;
- on an NVIDIA Hopper GPU (sm_90: H100, H200), JAX's Mosaic GPU kernels
  (``jax.experimental.pallas.ops.gpu``): ``ragged_dot_mgpu.ragged_dot`` for
  the product and its input gradient, ``transposed_ragged_dot_mgpu`` for the
  weight gradient (`_hopper`), where XLA's GPU backend rewrites ``ragged_dot``
  into a dense product over every expert (E times the FLOPs and temporaries);
- elsewhere, and wherever a kernel's constraint fails, ``jax.lax.ragged_dot_general``,
  differentiated by JAX; on a GPU once per reason with a warning that names it;
  but for fewer rows than experts (a decoding step's few tokens), each row by
  its own expert's weights, gathered (`_gathered`): ``ragged_dot`` reads every
  expert (and XLA's GPU backend transposes every expert's weights for it).

Either kernel runs only where every device holds its operands whole (`_whole`:
XLA cannot split a Mosaic kernel over a mesh axis). Under expert parallelism
that holds inside `mix_experts`' ``shard_map`` over ``model``, so each device
runs the kernels on its own experts' rows only.

megablox needs the row count to be a multiple of its row tile, so the rows
are padded with zero rows at the end (`_gmm`, `_weight_grad`); padded rows lie
past ``sum(sizes)``, in no group, so no product reads them. ``gmm`` leaves
every output row outside the groups unwritten (garbage on a TPU, NaN in
Pallas's interpreter): `_gmm` sets those rows to zero, as ``ragged_dot``
gives, since `mix_experts` reads rows past a device's own groups as zeros when
it splits the experts over ``model``. Its contracted and output widths need
no padding: a tile is clipped to a width smaller than it, and the kernels mask
a last partial tile of the contracted width.

The Hopper kernels are stricter (`_ragged_mgpu`, `_transposed_mgpu`): both
operands of one 16-bit dtype, the contracted width a multiple of ``block_k``,
and the weight gradient's widths multiples of ``block_m`` and ``block_n``; so
rows and widths are zero-padded to their blocks and the results sliced back,
and ``ragged_dot`` too leaves the rows past ``sum(sizes)`` unwritten (zeroed
here as for megablox). The blocks come from `BLOCKS`, a small table by product
and shape measured on an H200. ``ragged_dot_mgpu`` launches one program per
SM for 132 SMs (H100 SXM, H200: hard-coded in JAX 0.10-0.11), so `choose`
keeps other SM counts (an H100 PCIe has 114) on ``ragged_dot``. Both kernels
unroll a loop over the experts in every tile: compile time grows with the
expert count (Qwen3-MoE's 128; measured by ``benchmarks/moe_gpu.py``).

Mosaic GPU kernels do not run on a CPU: tests set `_stand_ins` to run the
Hopper path with XLA's products in the kernels' place (`_StandIns`: the same
signatures and constraints, rows past the groups left NaN), on a device that
`_device` then describes as an H100.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from ..mesh import traced_platform

# ragged_dot's dimension numbers for rows (N, in) against weights (E, out, in): contract `in`
# with the weights' last dim, the rows' dim 0 ragged over the weights' groups (dim 0).
_ROWS_BY_OUT_IN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)

# The kernels' (rows, contracted, output) tile: megablox's default, within every TPU generation's VMEM.
_TILES = (128, 128, 128)
# Tests set this to run the TPU kernels on any platform, in Pallas's interpreter (slow: tiny shapes only).
_interpret = False
# Tests set this to run the Hopper path on any platform, XLA's products standing in for the kernels.
_stand_ins = False

MEGABLOX, HOPPER, RAGGED_DOT, GATHERED = "megablox", "hopper", "ragged_dot", "gathered"


class Device(NamedTuple):
    """What `choose` reads of the device a step runs on."""

    platform: str  # "cpu", "gpu", "tpu"
    kind: str = ""  # its device_kind, e.g. "NVIDIA H200"
    capability: str | None = None  # a CUDA GPU's compute capability, "9.0" on Hopper; None elsewhere or unknown
    cores: int | None = None  # a GPU's streaming multiprocessors


# What the Hopper kernels were written for: sm_90 (wgmma), one program per SM of 132 (ragged_dot_mgpu
# hard-codes it), 16-bit operands (wgmma's; JAX tests them in float16, redeqx measured bfloat16).
_HOPPER = Device("gpu", "", "9.0", 132)
_HOPPER_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MIN_WIDTH = 128  # below one 128-wide tile, padding to it costs more than the dense product saves
# The device `_stand_ins` pretends to run on.
STAND_IN = Device("gpu", "NVIDIA H100 (XLA's products standing in for the kernels)", "9.0", 132)
_SPLIT = "a mesh axis splits the operands outside a shard_map (XLA cannot split a Mosaic kernel)"
# True while JAX traces a body that a batching rule may replace unrun (`provisional`): there, a mesh axis
# splitting the operands is no reason to tell (the rule's shard_map makes them whole where it runs).
_provisional = contextvars.ContextVar("redeqx_grouped_provisional", default=False)


def choose(device: Device, rows, w, *, whole: bool = True) -> tuple[str, str]:
    """``(path, reason)``: which grouped matmul runs `grouped`'s ``rows`` ``(n, in)``
    by ``w`` ``(E, out, in)`` (anything with ``.shape`` and ``.dtype``) on
    ``device``, where ``whole`` says whether every device holds the operands
    whole (`_whole`), and why: `MEGABLOX`, `HOPPER`, `RAGGED_DOT`, or where no
    kernel runs and there are fewer rows than experts (a decoding step's few
    tokens), `GATHERED`.

    >>> rows, w = jax.ShapeDtypeStruct((4096, 2048), "bfloat16"), jax.ShapeDtypeStruct((8, 2816, 2048), "bfloat16")
    >>> choose(Device("gpu", "NVIDIA H200", "9.0", 132), rows, w)[0]
    'hopper'
    >>> choose(Device("gpu", "NVIDIA H100 PCIe", "9.0", 114), rows, w)
    ('ragged_dot', 'the GPU has 114 SMs: ragged_dot_mgpu is written for 132 (H100 SXM, H200)')
    >>> choose(Device("gpu", "NVIDIA A100-SXM4-80GB", "8.0", 108), jax.ShapeDtypeStruct((2, 2048), "bfloat16"), w)[0]
    'gathered'
    """
    path, reason = _kernel_or_ragged_dot(device, rows, w, whole)
    m, e = rows.shape[0], w.shape[0]
    if path == RAGGED_DOT and 0 < m < e:
        return GATHERED, (f"{m} rows for {e} experts: each row by its own expert's weights, gathered, where "
                          f"ragged_dot reads every expert ({reason})")
    return path, reason


def _kernel_or_ragged_dot(device: Device, rows, w, whole: bool) -> tuple[str, str]:
    (m, k), (_, n, _) = rows.shape, w.shape
    if device.platform == "tpu":
        if not whole:
            return RAGGED_DOT, _SPLIT
        return MEGABLOX, "a TPU: megablox's gmm and tgmm"
    if device.platform != "gpu":
        return RAGGED_DOT, f"platform {device.platform}: the grouped-matmul kernels are for TPUs and Hopper GPUs"
    if device.capability != _HOPPER.capability:
        what = "unknown" if device.capability is None else device.capability
        return RAGGED_DOT, (f"GPU {device.kind!r} of compute capability {what}: the Hopper kernels need sm_90 "
                            "(H100, H200; Blackwell's blackwell_ragged_dot_mgpu is not wired in)")
    if device.cores != _HOPPER.cores:
        return RAGGED_DOT, (f"the GPU has {device.cores} SMs: ragged_dot_mgpu is written for {_HOPPER.cores} "
                            "(H100 SXM, H200)")
    if jnp.dtype(rows.dtype) != jnp.dtype(w.dtype):
        return RAGGED_DOT, (f"rows of {jnp.dtype(rows.dtype)} and weights of {jnp.dtype(w.dtype)}: the kernels "
                            "need one dtype")
    if jnp.dtype(rows.dtype) not in _HOPPER_DTYPES:
        return RAGGED_DOT, (f"dtype {jnp.dtype(rows.dtype)}: the Hopper kernels multiply bfloat16 or float16 "
                            "(compute_dtype=jnp.bfloat16 selects them)")
    if m == 0 or min(k, n) < _MIN_WIDTH:
        return RAGGED_DOT, (f"{m} rows of width {k} into {n}: narrower than the kernels' {_MIN_WIDTH}-wide "
                            "tiles, where padding would cost more than it saves")
    if not whole:
        return RAGGED_DOT, _SPLIT
    return HOPPER, "a Hopper GPU: ragged_dot_mgpu and transposed_ragged_dot_mgpu"


def grouped(rows: Float[Array, "n in"], w: Float[Array, "experts out in"],
            sizes: Int[Array, " experts"]) -> Float[Array, "n out"]:
    """The first ``sizes[0]`` rows times ``w[0].T``, the next ``sizes[1]``
    times ``w[1].T``, ...; rows past ``sum(sizes)`` come out zero. ``sizes``:
    int32, summing to at most ``n``; ``rows`` and ``w`` of one dtype."""
    device = _device()
    path, reason = (MEGABLOX, "") if _interpret else choose(device, rows, w, whole=_whole())
    if path == HOPPER and _kernels() is None:
        path, reason = RAGGED_DOT, f"jax {jax.__version__} does not ship {_MGPU}ragged_dot_mgpu"
    if path == MEGABLOX:
        return _manual(_kernel)(rows, w, sizes)
    if path == HOPPER:
        return _manual(_hopper)(rows, w, sizes)
    if path == GATHERED:
        return _gathered(rows, w, sizes)
    if device.platform == "gpu" and not (reason == _SPLIT and _provisional.get()):
        _tell(reason)
    return jax.lax.ragged_dot_general(rows, w, sizes, _ROWS_BY_OUT_IN)


def _gathered(rows, w, sizes):
    """`grouped` as each row times its own group's expert, those experts' weights gathered
    (``(n, out, in)``): for fewer rows than experts, where XLA's ``ragged_dot`` multiplies by every
    expert. Compiled for an A100, a decoding token of the 1B-active Mixtral-style model read all
    8 experts of each layer and transposed them (10.0 GiB a token, where its active weights are
    2.0; gathered, 2.0 GiB: `benchmarks.gpu_compile`'s ``moe_decode``). Rows past the groups come
    out zero."""
    e = w.shape[0]
    expert = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows.shape[0]), side="right")  # e past the groups
    out = jnp.einsum("ni,noi->no", rows, jnp.take(w, jnp.minimum(expert, e - 1), axis=0))
    return jnp.where((expert < e)[:, None], out, jnp.zeros((), out.dtype))


def _device() -> Device:
    """The device the computation is built for (`redeqx.mesh._mesh.traced_platform`):
    this process's first of that platform, else the mesh's abstract device (its
    compute capability unknown); `STAND_IN` under `_stand_ins`."""
    if _stand_ins:
        return STAND_IN
    platform = traced_platform()
    try:
        d = jax.devices(platform)[0]
    except RuntimeError:  # traced for a platform this process does not hold (an ahead-of-time plan)
        mesh = _concrete_mesh()  # its devices, where they are in context (a compile for a described GPU)
        if mesh is None or mesh.empty or mesh.devices.flat[0].platform != platform:
            d = jax.sharding.get_abstract_mesh().abstract_device
            return Device(platform, d.device_kind, None, getattr(d, "num_cores", None))
        d = mesh.devices.flat[0]
    return Device(platform, d.device_kind, getattr(d, "compute_capability", None), getattr(d, "core_count", None))


def _concrete_mesh():
    """The mesh set by ``jax.set_mesh`` with its devices, inside a trace too, where the public
    ``jax.sharding.get_mesh`` refuses; None where this JAX keeps no such mesh. A described GPU
    (an ahead-of-time compile with none attached) tells its compute capability only there: the
    abstract mesh's device holds its kind and cores. A JAX that keeps it elsewhere, or refuses it
    here, leaves the abstract device's description (the kernels' test says which this JAX does)."""
    try:
        from jax._src.mesh import get_concrete_mesh

        return get_concrete_mesh()
    except (ImportError, AttributeError, TypeError, ValueError, RuntimeError):
        return None


@contextlib.contextmanager
def provisional(value: bool = True):
    """Within: JAX traces a body that may not run (``custom_vmap`` traces its
    function before its batching rule replaces it), so `grouped` tells no
    operands split by a mesh axis; ``value=False`` inside the rule that runs."""
    token = _provisional.set(value)
    try:
        yield
    finally:
        _provisional.reset(token)


@functools.cache
def _tell(reason: str) -> None:
    """One warning per reason and process: a GPU's grouped matmuls on ``ragged_dot``."""
    warnings.warn(f"redeqx.models.MoE: the grouped matmuls run jax.lax.ragged_dot, which XLA's GPU backend "
                  f"expands into a product over every expert, not the Hopper kernels: {reason}.", stacklevel=2)


@functools.cache
def _megablox():
    # the module, not the function of the same name that megablox's __init__ exports
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _whole() -> bool:
    """Whether every device holds the operands whole: no axis of the mesh in
    context splits them, each manual (inside a ``shard_map``) or of size 1.
    XLA cannot split a Pallas kernel over a mesh axis ("Mosaic kernels cannot
    be automatically partitioned"), so elsewhere ``ragged_dot`` runs, which it can."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or all(n == 1 or a in mesh.manual_axes for a, n in mesh.shape.items())


def _manual(f):
    """``f`` in a ``shard_map`` over the mesh axes not manual yet (of size 1:
    `_whole`), since Mosaic lowers a kernel only where every axis is manual."""
    mesh = jax.sharding.get_abstract_mesh()
    auto = set() if mesh.empty else set(mesh.axis_names) - set(mesh.manual_axes)
    return jax.shard_map(f, in_specs=P(), out_specs=P(), axis_names=auto, check_vma=False) if auto else f


def _tiles(m: int, k: int, n: int) -> tuple[int, int, int]:
    """The tile for ``m`` rows of ``k`` times ``k x n``: `_TILES`, the row tile
    no taller than the rows rounded up to 16 (bfloat16's sublane tile), the
    others clipped to the widths."""
    tm, tk, tn = _TILES
    return min(tm, -(-m // 16) * 16), min(tk, k), min(tn, n)


def _padded(a, tm: int):
    """``a`` with zero rows appended up to a multiple of ``tm``."""
    return jnp.pad(a, ((0, -a.shape[0] % tm), (0, 0)))


def _gmm(rows, w, sizes, *, transpose: bool):
    """megablox's ``gmm``: rows ``(m, k)`` by ``w[e].T`` (``transpose``, ``w``
    ``(E, n, k)``) or by ``w[e]`` (``w`` ``(E, k, n)``); rows outside the groups zero."""
    m, k = rows.shape
    tiles = _tiles(m, k, w.shape[1] if transpose else w.shape[2])
    padded = _padded(rows, tiles[0])
    out = _megablox().gmm(padded, w, sizes, rows.dtype, tiles, transpose_rhs=transpose, interpret=_interpret)
    in_groups = jnp.arange(padded.shape[0])[:, None] < jnp.sum(sizes)
    return jnp.where(in_groups, out, jnp.zeros((), out.dtype))[:m]


def _weight_grad(rows, ct, sizes, dtype):
    """megablox's ``tgmm``: ``ct[g].T @ rows[g]`` for each group ``g``, the
    gradient of `grouped`'s ``w`` ``(E, out, in)``; an empty group's is zero."""
    tiles = _tiles(rows.shape[0], ct.shape[1], rows.shape[1])
    return _megablox().tgmm(_padded(ct, tiles[0]).T, _padded(rows, tiles[0]), sizes, dtype, tiles,
                            interpret=_interpret)


def _with_vjp(product, weight_grad):
    """`grouped` by a kernel pair under a ``custom_vjp``: ``product(rows, w, sizes,
    transpose=True)`` the forward (``w`` ``(E, out, in)``), ``transpose=False`` the
    input gradient, ``weight_grad(rows, ct, sizes, dtype)`` the weights' gradient."""

    @jax.custom_vjp
    def f(rows, w, sizes):
        return product(rows, w, sizes, transpose=True)

    def fwd(rows, w, sizes):
        return f(rows, w, sizes), (rows, w, sizes)

    def bwd(res, ct):
        rows, w, sizes = res
        return product(ct, w, sizes, transpose=False), weight_grad(rows, ct, sizes, w.dtype), None

    f.defvjp(fwd, bwd)
    return f


_kernel = _with_vjp(_gmm, _weight_grad)  # TPUs: megablox's gmm and tgmm


# ----------------------------------------------------------------------------- the Hopper kernels


class Blocks(NamedTuple):
    """A Hopper kernel's block config (its keyword arguments)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


# The block config of each product, by (product, layer): "forward" (rows by w[e].T), "input_grad"
# (ct by w[e]), "weight_grad" (transposed_ragged_dot); "up" a layer that widens (out >= in: gate and
# up projections), "down" one that narrows. Measured on an H200 (jax 0.11.2) at MoE-1B's shapes
# (32,768 rows, 8 uneven groups, hidden 2048, expert width 2816, bf16; issue 41): forward 343-508
# TFLOP/s against XLA's 93-96, weight gradient 468-478 against 73-74. A product or layer not here
# takes `DEFAULT_BLOCKS`; `benchmarks.moe_gpu.block_sweep()` measures candidates for this table.
DEFAULT_BLOCKS = Blocks()
BLOCKS: dict[tuple[str, str], Blocks] = {
    ("forward", "up"): Blocks(),
    ("forward", "down"): Blocks(grid_block_n=4),
    ("weight_grad", "up"): Blocks(),
    ("weight_grad", "down"): Blocks(),
}


def _blocks(product: str, out: int, inp: int, n: int) -> Blocks:
    """`BLOCKS`' config for ``product`` of a layer ``inp -> out`` whose kernel
    output is ``n`` wide, its ``grid_block_n`` 1 unless it divides ``n``'s blocks."""
    b = BLOCKS.get((product, "up" if out >= inp else "down"), DEFAULT_BLOCKS)
    return b if -(-n // b.block_n) % b.grid_block_n == 0 else b._replace(grid_block_n=1)


def _padded_to(a, multiples: tuple[int, ...]):
    """``a`` with zeros appended to each dim up to a multiple of ``multiples``
    (itself where every dim is one already)."""
    pad = [(0, -d % m) for d, m in zip(a.shape, multiples)]
    return jnp.pad(a, pad) if any(p for _, p in pad) else a


_MGPU = "jax.experimental.pallas.ops.gpu."


@functools.cache
def _hopper_kernels():
    """``(ragged_dot, transposed_ragged_dot)`` of JAX's Mosaic GPU kernels
    (imported on first use: they pull in Mosaic GPU), or None where this JAX
    lacks them."""
    try:
        return (importlib.import_module(_MGPU + "ragged_dot_mgpu").ragged_dot,
                importlib.import_module(_MGPU + "transposed_ragged_dot_mgpu").transposed_ragged_dot)
    except ImportError:
        return None


class _StandIns:
    """XLA's products in the kernels' place (`_stand_ins`), with their
    signatures and the constraints they check, and rows past the groups left
    NaN where ``ragged_dot_mgpu`` leaves them unwritten."""

    @staticmethod
    def _check(lhs, rhs, **dims):
        if lhs.dtype != rhs.dtype:
            raise NotImplementedError(f"lhs and rhs must have the same dtype, got {lhs.dtype} and {rhs.dtype}")
        for name, (size, block) in dims.items():
            if size % block:
                raise ValueError(f"{name}={size} must be a multiple of block_{name}={block}")

    @staticmethod
    def ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps, grid_block_n,
                   transpose_rhs=False):
        _StandIns._check(lhs, rhs, k=(lhs.shape[1], block_k))
        rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
        out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)
        unwritten = jnp.arange(lhs.shape[0])[:, None] >= jnp.sum(group_sizes)
        return jnp.where(unwritten, jnp.nan, out).astype(lhs.dtype)

    @staticmethod
    def transposed_ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps,
                              grid_block_n):
        _StandIns._check(lhs, rhs, m=(lhs.shape[1], block_m), n=(rhs.shape[1], block_n))
        numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                    lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
        return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, numbers,
                                          preferred_element_type=jnp.float32).astype(lhs.dtype)


def _kernels():
    """The Hopper kernels, or `_StandIns`' under `_stand_ins`; None where JAX lacks them."""
    return (_StandIns.ragged_dot, _StandIns.transposed_ragged_dot) if _stand_ins else _hopper_kernels()


def _ragged_mgpu(lhs, w, sizes, *, transpose: bool):
    """``ragged_dot_mgpu``: ``lhs`` ``(m, k)`` by ``w[e].T`` (``transpose``, the
    forward: ``w`` ``(E, n, k)``) or by ``w[e]`` (the input gradient: ``w``
    ``(E, k, n)``), operands zero-padded to the blocks and the result sliced
    back; rows outside the groups zero (the kernel leaves them unwritten)."""
    m = lhs.shape[0]
    out_w, in_w = w.shape[1:]
    n = out_w if transpose else in_w
    b = _blocks("forward" if transpose else "input_grad", out_w, in_w, n)
    padded = _padded_to(lhs, (b.block_m, b.block_k))
    w = _padded_to(w, (1, b.block_n, b.block_k) if transpose else (1, b.block_k, b.block_n))
    kernel = _kernels()[0]
    if "transpose_rhs" in inspect.signature(kernel).parameters:
        out = kernel(padded, w, group_sizes=sizes, transpose_rhs=transpose, **b._asdict())
    else:  # a JAX whose kernel reads (E, k, n) only: the forward's weights transposed once per call
        out = kernel(padded, jnp.swapaxes(w, 1, 2) if transpose else w, group_sizes=sizes, **b._asdict())
    in_groups = jnp.arange(padded.shape[0])[:, None] < jnp.sum(sizes)
    return jnp.where(in_groups, out, jnp.zeros((), out.dtype))[:m, :n]


def _transposed_mgpu(ct, rows, sizes):
    """``transposed_ragged_dot_mgpu``: ``ct[g].T @ rows[g]`` for each group
    ``g``, the gradient of `grouped`'s ``w`` ``(E, out, in)``, its widths
    zero-padded to the blocks (and the rows to ``block_k``, the kernel's row
    block) and sliced back; an empty group's is zero."""
    out_w, in_w = ct.shape[1], rows.shape[1]
    b = _blocks("weight_grad", out_w, in_w, in_w)
    grads = _kernels()[1](_padded_to(ct, (b.block_k, b.block_m)), _padded_to(rows, (b.block_k, b.block_n)),
                          group_sizes=sizes, **b._asdict())
    return grads[:, :out_w, :in_w]


# Hopper GPUs: the forward and input gradient by ragged_dot_mgpu, the weight gradient by transposed_ragged_dot_mgpu
_hopper = _with_vjp(_ragged_mgpu, lambda rows, ct, sizes, dtype: _transposed_mgpu(ct, rows, sizes).astype(dtype))
