"""The content hash a checkpoint keeps of each array: per leaf a word sum and a
64-bit hash of every word at its place, the same on any layout and process
count, computed on the devices (`fingerprints`), and the older checkpoints'
per-piece digests (`unmatched_pieces`). `_integrity.py` checks them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import xxhash
from jax.sharding import NamedSharding, PartitionSpec as P

from ._format import all_processes


# ----------------------------------------------------------------------------- checksums and content hashes
#
# Two per leaf, from one pass on the devices: a sum of the leaf's words
# (catches a flipped bit; the first format's check, still written for older
# readers) and a content hash that also catches two values swapped or two
# sign flips. The hash is a sum too, so it is the same on any layout and
# any number of processes (the partitioner adds the shards' parts with a
# collective), but of each word mixed with its place in the array:
# ``fmix32(word ^ (index * C + S))`` (murmur3's finaliser, in which every
# input bit reaches every output bit; ``C`` odd, so each place has its own
# key), in two lanes with their own ``C`` and ``S``, 64 bits in all. A change
# anywhere moves each lane by an unpredictable amount: a damaged array
# passes with odds of about 2**-64. Nothing leaves the devices but the
# numbers (no copy of the arrays to the host, as hashing there would
# need). The sums (and the finiteness test a manager's save asks for) are
# one reduction of several operands, so each shard is read once on every
# backend; on XLA:CPU the pass costs a few times a plain sum, on an
# accelerator it is bound by memory bandwidth. A restore compiles it while
# orbax reads.
#
# Checkpoints written before it hold an ``xxh3_128`` digest of each piece a
# saving device held instead, checked where this process holds the piece
# whole (`unmatched_pieces`).

HASH = "content_hash"
_LANES = ((0x9E3779B1, 0x7F4A7C15), (0x85EBCA77, 0xC2B2AE3D))  # (C, S) of each 32-bit lane


def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _bits(x):
    """``x``'s bits as the unsigned integers of its width (a bool as one byte)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))


# The pass runs on each device's own shard (`jax.shard_map`), one leaf after another, as one
# reduction that every backend fuses with the words' mixing: what it adds to a device's memory is a
# few sums, never a copy of the leaf or of the shard (checked by
# test_content_hash_reads_each_devices_own_shard). A loop over blocks of rows, as the pass once ran,
# made XLA:CPU widen a 16-bit float shard to a float32 copy to slice (twice the shard, and 2.4x the
# time). Each device sums its shard's terms at their places in the whole array; one copy of each
# replicated shard counts; the sums are added over the mesh. Equal, term for term, to the sum over
# the whole array, on any layout and process count.


def _place_index(shape, offsets, strides):
    """The row-major place in the whole array (mod 2**32) of each word of a shard of ``shape`` whose
    first word sits at ``offsets`` (per dim) of an array with row-major ``strides``."""
    index = jnp.zeros(shape, jnp.uint32)
    for d in range(len(shape)):
        at = jax.lax.broadcasted_iota(jnp.uint32, shape, d) + offsets[d].astype(jnp.uint32)
        index = index + at * jnp.uint32(strides[d] % 2**32)
    return index


def _shard_terms(x, offsets, strides, finite: bool):
    """(word sum, the two hash lanes' sums, all finite) of a device's shard ``x`` at ``offsets``: one
    reduction, so that every backend reads the shard once (libtpu fused separate sums into one pass
    and the finiteness test into a second; XLA:CPU made four). ``finite=False`` leaves the
    finiteness test out (a restore and `save_checkpoint` do not ask; the answer is then True)."""
    bits = _bits(x)
    low = bits.astype(jnp.uint32)  # a 64-bit word's checksum term is its low half
    if bits.dtype.itemsize > 4:  # two words per element, in a trailing axis
        words = jax.lax.bitcast_convert_type(bits, jnp.uint32)
    else:
        words = low
    check = finite and jnp.issubdtype(x.dtype, jnp.inexact)  # an integer or bool leaf is finite
    terms = [low, (~jnp.isfinite(x)).astype(jnp.uint32)] if check else [low]
    if words.ndim > bits.ndim:  # 64 bits: the element's checksum and finiteness terms sit on its first word
        first = jax.lax.broadcasted_iota(jnp.uint32, words.shape, words.ndim - 1) == 0
        terms = [jnp.where(first, t[..., None], jnp.uint32(0)) for t in terms]
    index = _place_index(words.shape, list(offsets) + [jnp.uint32(0)] * (words.ndim - len(offsets)), strides)
    lanes = [_fmix32(words ^ (index * jnp.uint32(c) + jnp.uint32(s))) for c, s in _LANES]
    dims = tuple(range(words.ndim))
    operands = (terms[0], *lanes, *terms[1:])
    sums = jax.lax.reduce(operands, (jnp.uint32(0),) * len(operands),
                          lambda a, b: tuple(u + v for u, v in zip(a, b)), dims)
    return sums[0], jnp.stack(sums[1:3]), sums[3] == 0 if check else jnp.bool_(True)


def _word_strides(shape, dtype) -> list[int]:
    """Row-major strides of the words of a leaf of ``shape`` (a trailing axis of two for 64 bits)."""
    words = list(shape) + ([2] if jnp.dtype(dtype).itemsize > 4 else [])
    strides, stride = [0] * len(words), 1
    for d in reversed(range(len(words))):
        strides[d], stride = stride, stride * words[d]
    return strides


def _leaf_terms(x, finite: bool, sharding: NamedSharding | None):
    """`_shard_terms` of every device's shard of ``x``, laid out by ``sharding`` (the array's own:
    inside ``jit`` on a mesh of Auto axes a tracer has none), added over the mesh."""
    strides = _word_strides(x.shape, x.dtype)
    if sharding is None or x.ndim == 0:
        return _shard_terms(x, [jnp.uint32(0)] * x.ndim, strides, finite)
    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    used = {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}

    def per_device(shard):
        offsets = []
        for d, entry in enumerate(spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            k = jnp.uint32(0)
            for a in axes:  # the shard's index along dim d: the axes in order, the first major
                k = k * jnp.uint32(mesh.shape[a]) + jax.lax.axis_index(a).astype(jnp.uint32)
            offsets.append(k * jnp.uint32(shard.shape[d]))
        checksum, lanes, ok = _shard_terms(shard, offsets, strides, finite)
        first = jnp.bool_(True)  # one copy of a shard that other axes replicate
        for a in mesh.axis_names:
            if a not in used:
                first = first & (jax.lax.axis_index(a) == 0)
        keep = first.astype(jnp.uint32)
        axes = tuple(mesh.axis_names)
        return (jax.lax.psum(checksum * keep, axes), jax.lax.psum(lanes * keep, axes),
                jax.lax.psum((~ok).astype(jnp.int32), axes) == 0)

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(*spec),), out_specs=(P(), P(), P()),
                         check_vma=False)(x)


def _hex(lanes) -> str:
    return "".join(f"{int(v):08x}" for v in lanes)


@functools.partial(jax.jit, static_argnames=("finite", "sharding"))
def _fingerprint(x, finite: bool = True, sharding: NamedSharding | None = None) -> tuple[jax.Array, ...]:
    """One leaf's ``uint32`` word sum (wrapping mod 2**32), the two lanes of
    its content hash, and whether every value is finite (True with
    ``finite=False``): one pass over each device's shards (`_leaf_terms`)
    as ``sharding`` lays them out. Without it the partitioner decides how to
    split a loop over the whole array, and gathered a leaf split on its
    first dim (a vocabulary-split embedding: 5 copies of each shard)."""
    return _leaf_terms(x, finite, sharding)


def _named(x) -> NamedSharding | None:
    sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def _signature(x) -> tuple:
    return tuple(x.shape), jnp.dtype(x.dtype), _named(x)


def compile_fingerprints(abstract: list[jax.ShapeDtypeStruct], finite: bool = True) -> dict:
    """`_fingerprint`'s programs for leaves shaped, typed and placed as ``abstract`` (one per kind
    of leaf), compiled ahead: a restore compiles them while orbax reads, off the restore's path,
    and passes them to `fingerprints`."""
    programs = {}
    for x in abstract:
        if _signature(x) not in programs:
            programs[_signature(x)] = _fingerprint.lower(x, finite=finite, sharding=_named(x)).compile()
    return programs


def fingerprints(leaves: list[jax.Array], finite: bool = True,
                 programs: dict | None = None) -> tuple[list[int], list[str], list[bool]]:
    """`_fingerprint` of each leaf on the host: word sums, content hashes as hex, finiteness.

    One leaf at a time, each fetched before the next starts: one program over every leaf made
    XLA:CPU hold each leaf's temporaries at once (a 1.7 GiB state: 8 GiB of host memory),
    and many programs in flight at once can stall its collectives. ``programs``: those of
    `compile_fingerprints` for these leaves."""
    sums, hashes, ok = [], [], []
    for x in leaves:
        run = (programs or {}).get(_signature(x)) or functools.partial(_fingerprint, finite=finite, sharding=_named(x))
        checksum, lanes, good = jax.device_get(run(x))
        sums.append(int(checksum))
        hashes.append(_hex(np.asarray(lanes)))
        ok.append(bool(good))
    return sums, hashes, ok


_PIECES = "xxh3_128"  # the older checkpoints' hashes, per saved piece


def _index_slices(key: str) -> tuple[slice, ...]:
    return tuple(slice(*map(int, part.split(":"))) for part in key.split(",")) if key else ()


def unmatched_pieces(leaves: list[jax.Array], saved: list[dict[str, str] | None]) -> list[bool]:
    """Per leaf, whether a piece hashed by an older redeqx that this process
    can see whole has another ``xxh3_128`` digest now, agreed over every
    process (leaves without such hashes pass)."""
    bad = []
    for x, want in zip(leaves, saved):
        wrong = False
        if want:
            held = {",".join(f"{sl.start or 0}:{n if sl.stop is None else sl.stop}"
                             for sl, n in zip(sh.index, x.shape)): sh for sh in x.addressable_shards}
            whole = None
            for key, digest in want.items():
                if key in held:
                    data = np.asarray(held[key].data)
                elif x.is_fully_addressable:
                    whole = np.asarray(x) if whole is None else whole
                    data = whole[_index_slices(key)]
                else:
                    continue  # spread over processes on this layout: the word sum checks it
                if xxhash.xxh3_128(np.ascontiguousarray(data).reshape(-1).view(np.uint8)).hexdigest() != digest:
                    wrong = True
                    break
        bad.append(wrong)
    if jax.process_count() > 1:
        return [any(column) for column in zip(*all_processes(bad))]
    return bad
