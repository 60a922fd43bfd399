"""The TPU's attention kernel: JAX's Pallas splash attention, where `redeqx.attention` and the zoo
would otherwise form a sequence's ``(T, T)`` scores on a TPU, wherever no mesh axis of more than one
device is left to the partitioner (one chip; the heads split over a mesh of ``context`` alone).
Elsewhere the scores are formed as before (the zoo, `redeqx.attention` without a ``context`` axis)
or attended a block at a time (the heads split): wiring the kernel under data and model splits needs
partitioning rules for it, which it does not have.

Splash attention walks blocks of queries and keys, skips the blocks a mask hides whole (a causal
mask's upper triangle, what a sliding window leaves behind, read from the mask once when the kernel
is built), takes grouped-query heads and segment ids, and differentiates by its own backward
kernels. Its values and gradients are checked against the exact scores on CPU in Pallas's
interpreter (`INTERPRET`, what the tests set); a TPU runs the compiled kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..mesh import traced_platform
from ._blockwise import Span

INTERPRET = False  # Pallas's interpreter instead of Mosaic: the same kernel, run by XLA (tests on CPU)
BLOCKS = (512, 256, 128)  # queries and keys a block: the largest that divides the sequence


def _nothing_to_partition() -> bool:
    """Whether the program being traced has no device axis left to the partitioner: a Mosaic kernel
    cannot be split by it ("Mosaic kernels cannot be automatically partitioned", libtpu), so the
    kernel serves a mesh of one device, or a ``shard_map`` manual over every axis (the heads split
    on a mesh of ``context`` alone, which takes the other axes, of one device, as manual too)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return jax.device_count() == 1
    manual = set(getattr(mesh, "manual_axes", ()))
    return mesh.size == 1 or manual == set(mesh.axis_names)  # an automatic axis of one device trips it too


def kernel_runs(q, k, span: Span) -> bool:
    """Whether `splash` serves attention of ``q`` (T, Hq, D) over ``k`` (T, Hkv, D): traced for a TPU
    (or in the interpreter), nothing left for the partitioner to split (`_nothing_to_partition`),
    queries and keys of the same length, a multiple of 128 tokens, and a head size of 64 or a
    multiple of 128 (the vector lanes); not a window counted by segment (``span.by_segment``: the
    kernel's window counts places, padding inside a sequence included)."""
    platform_ok = INTERPRET or traced_platform() == "tpu"
    return (platform_ok and not span.by_segment and q.shape[0] == k.shape[0] and q.shape[0] % BLOCKS[-1] == 0
            and (q.shape[-1] == 64 or q.shape[-1] % 128 == 0) and jnp.issubdtype(q.dtype, jnp.floating)
            and _nothing_to_partition())


def _kernel(n: int, heads: int, causal: bool, window: int | None, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if window is not None:  # a query sees itself and the window - 1 keys before it
        mask = sm.LocalMask((n, n), window_size=(window - 1, 0), offset=0)
    else:
        mask = sm.CausalMask((n, n)) if causal else sm.FullMask((n, n))
    b = next(b for b in BLOCKS if n % b == 0)
    sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    # built inside each trace (its mask tables become that trace's constants; the kernel holds them, so
    # a kernel kept across traces leaks one trace's values into the next); the numpy work of reading
    # the mask into block tables is cached by JAX
    return sk.make_splash_mha_single_device(sm.MultiHeadMask([mask] * heads), block_sizes=sizes,
                                             interpret=interpret)


def splash(q, k, v, seg, span: Span, scale: float):
    """Exact attention of one sequence (``q`` (T, Hq, D), ``k``/``v`` (T, Hkv, D), ``seg`` (T,) or
    None) by the splash kernel; ``kernel_runs`` must hold. The kernel does not scale the scores:
    ``q`` is scaled first, in its own dtype (in bfloat16 one more rounding of each query element,
    2^-9 relative, than scaling the float32 scores)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    kernel = _kernel(q.shape[0], q.shape[1], span.causal, span.window, INTERPRET)
    ids = None if seg is None else sk.SegmentIds(q=seg, kv=seg)
    heads_first = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731  (the kernel's (heads, T, D))
    out = kernel(heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k), heads_first(v), segment_ids=ids)
    return heads_first(out).astype(q.dtype)
