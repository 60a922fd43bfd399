"""`per_data_shard`: the operations XLA's partitioner copies onto every device, run on each data
shard's own rows.

XLA's SPMD partitioner (JAX 0.10.2, under Shardy and under GSPMD) has no rule for three operations
whose operand is split along a dim they do not work across:

- an FFT (``jnp.fft.*``: a Fourier neural operator, FNet, an FFT long convolution; openxla/xla#24,
  jax-ml/jax#15680),
- ``lax.top_k`` (an MoE router choosing each token's experts, the zoo's Mixtral and Qwen3-MoE
  included; ``models.sample(top_k=...)`` cutting each new token's logits in ``models.generate``),
- a grouped convolution that is not depthwise (``groups`` between 1 and the input channels:
  ResNeXt, RegNet; openxla/xla#47945),
- a convolution grouped by example: what ``jax.vmap`` makes of a convolution's weight gradient
  taken per example (DP-SGD, per-example gradient norms, a loss that differentiates inside itself,
  which the eval step runs per example). For a 1 x 1 kernel on a mesh of ``data`` and another axis,
  XLA:CPU's and XLA:GPU's partitioner abort the process compiling it (``free(): invalid
  pointer``); libtpu compiles it, gathering the batch (`_grouped_by_rows`).

For the first three, it all-gathers the operand over the devices that split it (the whole global
batch, on every device), runs the operation on all of it everywhere, and slices each device's rows
back out of the result: an activation's bytes moved, and the global batch's FLOPs and memory, per use.
Compiled for 8 H100s (and on 8 CPU devices), a data-parallel train step of a 1-D Fourier neural
operator moved 256 MiB a step this way, of 0.10 MiB of gradients; a ResNeXt step 65 MiB, of 0.66
(benchmarks/per_shard_ops.py). libtpu partitions grouped convolutions itself, and an FFT on a mesh
of ``data`` alone (it compiles FFTs as matrix products), but gathered the FNO's batch on data x model.

So the train, eval and predict steps and `make_step` evaluate the function they run (``loss_fn``,
``pred_fn``, ``step_fn``) with each such operation that the batch reaches inside a ``jax.shard_map``:
each device runs it on its data shard's rows, whole in every other dim. Values do not change: the
operation treats rows independently. Grouped convolutions are left to libtpu, where the
``shard_map`` raised the step's peak memory (1.8x at data 8, 2.9x at data 4 x model 2) for no bytes;
those grouped by example are moved on every platform.

The ``shard_map`` is manual over every mesh axis, not ``data`` alone: left to the partitioner inside
one manual over ``data`` only, an FFT got a memory layout (frequencies major) that XLA:CPU's FFT then
refused at run time (a ``RET_CHECK`` in ``fft_thunk.cc``, a Fourier neural operator at data 4 x
model 2). Its varying axes are checked (``check_vma``): unchecked, its transpose summed every
cotangent over ``model`` too, an activation-sized all-reduce per use. The other operands (a
convolution's weights) are cast to varying over ``data``, so their cotangent is summed over ``data``
alone, as a weight's gradient is.

Which dim carries the rows is read from the function traced a second time on half the batch (the
dim that halves, as `redeqx.steps._batch_pins` finds it). On CPU, where something is to move, both
are traced with `redeqx.remat`'s blocks as plain ``jax.checkpoint``s, whose recomputation the
rewrite then covers (the CPU's tied ``custom_vjp`` would trace them again as written). A dim the
operation works across, or one ``data`` does not divide, is left to the partitioner. So are a program already manual over ``data``,
a batch of one row or of an odd number of rows, and a mesh with pipeline stages (whose stacked
layers run on microbatches). A grouped convolution's weight gradient inside the ``shard_map`` comes
out as on one device (XLA's own, outside it, is ``n_model_shards`` times too large:
`redeqx.exact_conv_grads`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.extend.core as jex
from jax.sharding import PartitionSpec as P

from ..data import batch_size
from ..mesh import DATA, STAGE
from .._rewrite import call_in_place, inner_jaxprs, rewritten_by_rows, rows_dim, source_of
from ._conv_grads import batch_grouped_conv
from ._remat import plain_checkpoints


def _across(eqn, platform: str) -> tuple[int, ...] | None:
    """The dims of ``eqn``'s first operand that it works across, where it is one of the operations
    the partitioner copies whole onto every device of ``platform`` (the module's text); else None."""
    name = eqn.primitive.name
    if name not in ("fft", "top_k", "conv_general_dilated"):
        return None
    shape = eqn.invars[0].aval.shape
    if name == "fft":
        return tuple(range(len(shape) - len(eqn.params["fft_lengths"]), len(shape)))
    if name == "top_k":
        return (eqn.params.get("axis", len(shape) - 1) % len(shape),)
    if name == "conv_general_dilated" and eqn.params["batch_group_count"] == 1 and platform != "tpu":
        spec = eqn.params["dimension_numbers"].lhs_spec
        if 1 < eqn.params["feature_group_count"] < shape[spec[1]]:  # depthwise convolutions are split well
            return tuple(spec[1:])
    return None


def _groups(eqn) -> int:
    """A convolution's group count (of features or of the batch), which may be the batch's rows:
    what ``jax.vmap`` makes of a weight gradient taken per example (`_grouped_by_rows`); 1 otherwise."""
    if eqn.primitive.name != "conv_general_dilated":
        return 1
    return max(eqn.params["feature_group_count"], eqn.params["batch_group_count"])


def _found(jaxpr: jex.Jaxpr, platform: str, rows: int) -> bool:
    """Whether ``jaxpr`` (or a program it calls, outside a ``shard_map``) holds such an operation: a
    convolution grouped by example has a multiple of the ``rows`` groups (a depthwise one seldom, so
    its program is seldom traced again)."""
    return any(_across(eqn, platform) is not None or (_groups(eqn) > 1 and _groups(eqn) % rows == 0) or (
        eqn.primitive.name != "shard_map" and any(_found(inner, platform, rows) for inner in inner_jaxprs(eqn)))
        for eqn in jaxpr.eqns)


def _rows(v, twin) -> int | None:
    d = rows_dim(tuple(v.aval.shape), tuple(twin.aval.shape), 2)
    return None if d is None or d is False else d


def _on_shards(eqn, twin, n_data: int, platform: str):
    """``eqn`` inside a ``shard_map`` manual over every axis, its first operand and its results split
    over ``data`` on the dim that carries the rows, whole otherwise; None where no dim it does not
    work across carries them."""
    if _groups(eqn) > 1 and (grouped := _grouped_by_rows(eqn, twin, n_data)) is not None:
        return grouped
    across = _across(eqn, platform)
    if across is None:
        return None
    d = _rows(eqn.invars[0], twin.invars[0])
    outs = [_rows(v, t) for v, t in zip(eqn.outvars, twin.outvars)]
    if d is None or d in across or eqn.invars[0].aval.shape[d] % n_data or None in outs:
        return None
    if eqn.primitive.name == "conv_general_dilated":
        numbers = eqn.params["dimension_numbers"]
        if d != numbers.lhs_spec[0] or outs != [numbers.out_spec[0]]:
            return None
    elif outs != [d] * len(outs):
        return None

    def split(ndim: int, dim: int) -> P:
        return P(*[DATA if i == dim else None for i in range(ndim)])

    def run(first, *rest):  # the other operands (weights) varying over data as the rows are (module text)
        with source_of(eqn):  # in the manual mesh: not eqn's own context (`bind`), whose mesh is auto
            out = eqn.primitive.bind(first, *(jax.lax.pcast(x, DATA, to="varying") for x in rest), **eqn.params)
        return tuple(out) if eqn.primitive.multiple_results else out

    in_specs = (split(eqn.invars[0].aval.ndim, d), *[P()] * (len(eqn.invars) - 1))
    out_specs = tuple(split(v.aval.ndim, o) for v, o in zip(eqn.outvars, outs))
    local = jax.shard_map(run, in_specs=in_specs,
                          out_specs=out_specs if eqn.primitive.multiple_results else out_specs[0])
    return call_in_place(eqn, local)


def _grouped_by_rows(eqn, twin, n_data: int):
    """A convolution whose groups are the batch's rows, inside a ``shard_map`` over ``data`` that
    gives each device its rows' groups; None for any other convolution.

    ``jax.vmap`` of a convolution's weight gradient (DP-SGD's per-example gradients, a loss that
    differentiates inside itself run per example by the eval step) makes it one convolution grouped
    by example: ``feature_group_count`` = the examples, read along the input's feature dim, and its
    own transpose one with ``batch_group_count`` = the examples. On a mesh of ``data`` and another
    axis of more than one device, XLA's partitioner aborts the process compiling the first for a 1 x 1
    kernel (``free(): invalid pointer``; XLA:CPU and XLA:GPU, JAX 0.10.2); libtpu compiles it, but
    all-gathers the batch onto every device for it. The groups are the rows where traced on half the
    rows the count halves; each device then convolves its own groups: the input split on the grouped
    dim, the other operand and the result on their output features (the groups' blocks, in order),
    the count divided by the data shards. Any contiguous run of whole groups is such a convolution of
    its own, so the values are one device's wherever the data shards divide the count."""
    numbers = eqn.params["dimension_numbers"]
    for count, grouped in (("feature_group_count", numbers.lhs_spec[1]), ("batch_group_count", numbers.lhs_spec[0])):
        groups = eqn.params[count]
        if groups > 1 and groups % n_data == 0 and 2 * twin.params[count] == groups:
            break
    else:
        return None
    dims = (grouped, numbers.rhs_spec[0], numbers.out_spec[1])
    found = (_rows(eqn.invars[0], twin.invars[0]), _rows(eqn.invars[1], twin.invars[1]),
             _rows(eqn.outvars[0], twin.outvars[0]))
    if found != dims:
        return None
    lhs, rhs, out = (P(*[DATA if i == d else None for i in range(v.aval.ndim)])
                     for d, v in zip(dims, (*eqn.invars, eqn.outvars[0])))
    params = {**eqn.params, count: groups // n_data}

    def run(x, w):  # a batch-grouped one by products, as every step computes those (`batch_grouped_conv`)
        with source_of(eqn):
            if count == "batch_group_count":
                return batch_grouped_conv(x, w, params)
            return eqn.primitive.bind(x, w, **params)

    return call_in_place(eqn, jax.shard_map(run, in_specs=(lhs, rhs), out_specs=out))


def per_data_shard(fn: Callable, mesh, *, batch_arg: int = 1) -> Callable:
    """``fn(..., batch, ...)`` (the batch its ``batch_arg``-th argument) evaluated with each FFT,
    ``top_k`` and non-depthwise grouped convolution the batch reaches run on each data shard's own
    rows, and each convolution grouped by the batch's examples on each device's own examples (the
    module's text). ``fn`` itself on a mesh of one data shard or with pipeline stages."""
    n_data, platform = dict(mesh.shape).get(DATA, 1), mesh.devices.flat[0].platform
    if n_data == 1 or dict(mesh.shape).get(STAGE, 1) > 1:
        return fn

    @functools.wraps(fn)
    def run(*args):
        rows = _rows_of(args, batch_arg)
        if not rows or DATA in jax.sharding.get_abstract_mesh().manual_axes:
            return fn(*args)
        return rewritten_by_rows(fn, args, batch_arg, rows, lambda eqn, twin: _on_shards(eqn, twin, n_data, platform),
                                 enter=lambda eqn: eqn.primitive.name != "shard_map",
                                 needed=lambda jaxpr: _found(jaxpr, platform, rows),
                                 retrace_in=plain_checkpoints if platform == "cpu" else None)

    return run


def _rows_of(args: tuple, batch_arg: int) -> int | None:
    """The rows of ``args[batch_arg]`` (None where there is no such argument or it is no batch: a
    `make_step` whose step takes none)."""
    if len(args) <= batch_arg:
        return None
    try:
        return batch_size(args[batch_arg])
    except ValueError:
        return None
