"""One batch's checks and placement, shared by the input pipelines and the
steps: its size (`batch_size`), that the data axis divides it
(`check_batch`), 64-bit integers narrowed as JAX would hold them
(`narrow_64bit`), and its arrays laid out over ``data`` (`place_batch`)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..mesh import DATA


def batch_size(batch) -> int:
    sizes = {x.shape[0] for x in jax.tree.leaves(batch) if hasattr(x, "shape") and x.ndim > 0}
    if len(sizes) != 1:
        leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
        said = ", ".join(f"batch{jax.tree_util.keystr(path)}: {list(x.shape)}" for path, x in leaves[:12]
                         if hasattr(x, "shape"))
        raise ValueError(
            f"every batch array needs the same leading (batch) dim, got sizes {sorted(sizes) or 'none'} ({said}). "
            "Give each example's features one row per example; a value shared by every example belongs outside "
            "the batch (a constant in loss_fn, or the model).")
    return sizes.pop()


def _refuse_python_sequences(batch) -> None:
    """A list or tuple of numbers in a batch is a subtree to JAX, one replicated leaf per number,
    which no data axis splits: where it holds a value per example (as many as the arrays' rows, or
    there are no arrays), name it and ask for an array. A few numbers shared by the batch pass."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    rows = {x.shape[0] for _, x in leaves if np.ndim(x) > 0}
    lengths: dict = {}
    for path, x in leaves:
        at = next((i for i, k in enumerate(path) if isinstance(k, jax.tree_util.SequenceKey)), None)
        if at is not None and np.ndim(x) == 0:
            lengths[path[:at]] = max(lengths.get(path[:at], 0), path[at].idx + 1)
    for prefix, length in lengths.items():
        if not rows or length in rows:
            raise TypeError(
                f"batch{jax.tree_util.keystr(prefix)} is a Python list or tuple of numbers, {length} long; a batch "
                "holds arrays, one row per example. Make it one in collate_fn, e.g. `np.asarray(...)` (or "
                "`np.stack` of the examples' arrays).")


def check_batch(batch, mesh: Mesh) -> None:
    _refuse_python_sequences(batch)
    b, n_data = batch_size(batch), mesh.shape[DATA]
    if b % n_data:
        raise ValueError(
            f"a batch of {b} rows cannot be split over the data axis of {n_data} devices: use a batch size "
            f"that is a multiple of {n_data}, e.g. build batches with redeqx.batches(..., per_device_batch_size, mesh)."
        )


def narrow_64bit(arr: np.ndarray, where: str) -> np.ndarray:
    """``arr`` as JAX will hold it: with 64-bit types off (JAX's default),
    ``jnp.asarray`` turns int64 into int32 by dropping the high bits, so
    ``2**32 + 5`` arrives as ``5``. A 64-bit integer array whose values all
    fit 32 bits is narrowed here (what JAX would do, said); one that does not
    is refused, naming ``where`` and the values' range."""
    if jax.config.jax_enable_x64 or arr.dtype not in (np.int64, np.uint64) or arr.size == 0:
        return arr
    narrow = np.dtype(np.int32 if arr.dtype == np.int64 else np.uint32)
    lo, hi = arr.min(), arr.max()
    info = np.iinfo(narrow)
    if lo < info.min or hi > info.max:
        raise ValueError(
            f"{where} is {arr.dtype} with values from {lo} to {hi}, outside {narrow}'s range [{info.min}, {info.max}]; "
            f"JAX (64-bit types off, its default) would keep only the low 32 bits, so {hi} would arrive as "
            f"{int(np.asarray(hi).astype(narrow))}. Map the values into {narrow}'s range in collate_fn (e.g. ids "
            "modulo the vocabulary, a hash bucket, or two int32 columns), or turn 64-bit types on with "
            "jax.config.update('jax_enable_x64', True) before building anything."
        )
    return arr.astype(narrow)


def place_batch(batch, mesh: Mesh):
    """Batch arrays onto ``mesh``: arrays on it stay; arrays on the same
    devices under another mesh object (an ``Explicit`` twin) keep their
    layout; NumPy or single-device arrays are split over ``data``: with one
    process such an array is the whole global batch, with several each
    process's array is its own rows of it (as `batches` makes them)."""
    n_data = mesh.shape[DATA]
    one_process = jax.process_count() == 1

    def one(kp, x):
        if isinstance(x, np.ndarray):  # a NumPy batch made without redeqx.batches: same 64-bit check
            x = narrow_64bit(x, f"batch{jax.tree_util.keystr(kp)}")
        sh = getattr(x, "sharding", None)
        if isinstance(x, jax.ShapeDtypeStruct) and sh is None:  # an abstract batch, for lowering
            spec = P(DATA, *([None] * (x.ndim - 1))) if x.ndim and x.shape[0] % n_data == 0 else P()
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        if isinstance(sh, NamedSharding):
            if sh.mesh == mesh or sh.mesh.axis_names != mesh.axis_names or sh.mesh.devices.shape != mesh.devices.shape:
                return x
            return jax.device_put(x, NamedSharding(mesh, sh.spec))
        if isinstance(x, (np.ndarray, jax.Array)) and x.ndim >= 1:
            sharding = NamedSharding(mesh, P(DATA, *([None] * (x.ndim - 1))))
            if not one_process:
                return jax.make_array_from_process_local_data(sharding, np.asarray(x))
            if x.shape[0] % n_data == 0:
                return jax.device_put(x, sharding)
        return x

    return jax.tree_util.tree_map_with_path(one, batch)
