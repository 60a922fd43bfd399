"""The grouped matmul of `redeqx.models.mix_experts`: rows in consecutive
groups, each group multiplied by its own expert's weights, the one place that
chooses how.

On a TPU (the platform the step is traced for, `redeqx._mesh.traced_platform`)
it runs megablox's Pallas kernels (``jax.experimental.pallas.ops.tpu.megablox``,
what MaxText runs its dropless MoE with): ``gmm`` for the product and for its
input gradient, ``tgmm`` for the weight gradient (`_weight_grad`). Each walks
only the row tiles that hold some group's rows, and ``tgmm`` multiplies each
expert's weight gradient by that expert's rows only, where XLA's
``ragged_dot`` weight gradient is a product over every expert. Elsewhere it
is ``jax.lax.ragged_dot_general``, differentiated by JAX.

The kernels need the row count to be a multiple of their row tile, so the
rows are padded with zero rows at the end (`_gmm`, `_weight_grad`); padded
rows lie past ``sum(sizes)``, in no group, so no product reads them. ``gmm``
leaves every output row outside the groups unwritten (garbage on a TPU, NaN in
Pallas's interpreter): `_gmm` sets those rows to zero, as ``ragged_dot``
gives, since `mix_experts` reads rows past a device's own groups as zeros when
it splits the experts over ``model``. The contracted and output widths need
no padding: a tile is clipped to a width smaller than it, and the kernels mask
a last partial tile of the contracted width.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from .._mesh import traced_platform

# ragged_dot's dimension numbers for rows (N, in) against weights (E, out, in): contract `in`
# with the weights' last dim, the rows' dim 0 ragged over the weights' groups (dim 0).
_ROWS_BY_OUT_IN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)

# The kernels' (rows, contracted, output) tile: megablox's default, within every TPU generation's VMEM.
_TILES = (128, 128, 128)
# Tests set this to run the TPU kernels on any platform, in Pallas's interpreter (slow: tiny shapes only).
_interpret = False


@functools.cache
def _megablox():
    # the module, not the function of the same name that megablox's __init__ exports
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def grouped(rows: Float[Array, "n in"], w: Float[Array, "experts out in"],
            sizes: Int[Array, " experts"]) -> Float[Array, "n out"]:
    """The first ``sizes[0]`` rows times ``w[0].T``, the next ``sizes[1]``
    times ``w[1].T``, ...; rows past ``sum(sizes)`` come out zero. ``sizes``:
    int32, summing to at most ``n``; ``rows`` and ``w`` of one dtype."""
    if _interpret or (traced_platform() == "tpu" and _whole()):
        return _manual(_kernel)(rows, w, sizes)
    return jax.lax.ragged_dot_general(rows, w, sizes, _ROWS_BY_OUT_IN)


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


@jax.custom_vjp
def _kernel(rows, w, sizes):
    return _gmm(rows, w, sizes, transpose=True)


def _kernel_fwd(rows, w, sizes):
    return _kernel(rows, w, sizes), (rows, w, sizes)


def _kernel_bwd(res, ct):
    rows, w, sizes = res
    return _gmm(ct, w, sizes, transpose=False), _weight_grad(rows, ct, sizes, w.dtype), None


_kernel.defvjp(_kernel_fwd, _kernel_bwd)
