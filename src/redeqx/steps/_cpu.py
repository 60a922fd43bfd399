"""Everything redeqx does differently when the devices are CPUs, in one place.

Nothing here runs on GPUs or TPUs: each entry is applied behind `on_cpu`.

| what | why | evidence | delete when |
|---|---|---|---|
| `wait_for_program` | XLA:CPU's collectives deadlock when two compiled programs overlap on a process driving several CPU devices: a correctness fix | README, "Many hosts"; tests/test_multihost.py | the multi-host tests pass ten runs in a row without it |
| `ordered_collectives_check` | XLA:CPU's concurrency-optimized scheduler lets each CPU device run two independent loops that hold collectives over different device groups in its own order; a pipelined step with fp8 products (the weights' scales, hoisted into a loop of their own, beside the stages' permutes) then waits out XLA's 40 s rendezvous and aborts the process, every run. XLA reads the flag that turns the scheduler off once per process, so the step refuses to start without it, naming it: a correctness fix | tests/test_fp8.py, the pipeline cases | a pipelined fp8 step runs on CPU devices without the flag |
| `tied_checkpoint` | XLA:CPU drops `jax.checkpoint`'s optimization barriers and merges the recomputation back into the forward pass, so remat would save nothing in a CPU step or plan | benchmarks/RESULTS.md, History: "XLA:CPU rewrites on libtpu" | tests/test_remat.py's temporaries checks pass with plain `jax.checkpoint` on CPU |
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ..mesh import traced_platform
from .._trees import is_array, is_floating


def on_cpu() -> bool:
    """Whether the computation being built runs on CPUs (`traced_platform`)."""
    return traced_platform() == "cpu"


# ----------------------------------------------------------------------------- one program at a time


@functools.cache
def _devices_share_a_cpu_process() -> bool:
    return jax.local_device_count() > 1 and jax.devices()[0].platform == "cpu"


def wait_for_program(outputs):
    """``outputs`` once computed, when this process drives several CPU
    devices; at once elsewhere (GPUs and TPUs keep asynchronous dispatch).

    XLA:CPU's collectives (jax 0.10) can deadlock when two compiled programs
    overlap: across processes a gloo all-reduce waits forever on a receive,
    within one the in-process rendezvous waits for device threads busy with
    the other program. Steps call this on their outputs."""
    if _devices_share_a_cpu_process():
        jax.block_until_ready(outputs)
    return outputs


# ----------------------------------------------------------------------------- collectives in one order

ORDERED_COLLECTIVES = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def ordered_collectives_check(mesh) -> Callable[..., None] | None:
    """For a pipelined step with fp8 products on CPU devices, a first-call
    check that refuses to run it unless ``XLA_FLAGS`` holds
    `ORDERED_COLLECTIVES` (see the table above): the hang is certain, the
    flag must be set before JAX starts. None elsewhere."""
    if mesh.devices.flat[0].platform != "cpu" or ORDERED_COLLECTIVES in os.environ.get("XLA_FLAGS", ""):
        return None

    def check(*_):
        raise RuntimeError(
            "fp8=True with pipeline stages on CPU devices: XLA:CPU (jax 0.10) runs this step's collectives in a "
            "different order on different devices, and the step hangs until XLA aborts the process. Start Python "
            f"with {ORDERED_COLLECTIVES} in XLA_FLAGS (XLA reads it once, when JAX starts: "
            f"XLA_FLAGS=\"$XLA_FLAGS {ORDERED_COLLECTIVES}\" python train.py), or drop fp8=True on CPU, where fp8 "
            "products are computed in float32 and buy nothing.")

    return check


# ----------------------------------------------------------------------------- remat that survives XLA:CPU


def _finite_zero(x):
    return jnp.where(jnp.isfinite(x), x, 0) * 0


def _tie(tree, cotangent):
    """``tree`` with an exact zero computed from ``cotangent`` added to its
    floating arrays: what depends on the result can run only once the
    gradient exists, and no compiler can merge it with the same computation
    on ``tree``. An array shaped like a leaf of ``cotangent`` gets that leaf
    times zero (elementwise: no communication whatever the layout); if none
    is, the first floating array gets a zero from one element of it. Adding
    a zero changes no value (but the sign of a zero: -0.0 + 0.0 = +0.0)."""
    cts = [c for c in jax.tree.leaves(cotangent) if is_floating(c) and c.size]
    if not cts:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    by_shape = {c.shape: c for c in cts}
    out, tied = [], False
    for x in leaves:
        if is_floating(x) and x.shape in by_shape:
            x, tied = x + _finite_zero(by_shape[x.shape]).astype(x.dtype), True
        out.append(x)
    if not tied:
        first = next((i for i, x in enumerate(out) if is_floating(x)), None)
        if first is not None:
            probe = cts[0][(0,) * cts[0].ndim].astype(jnp.float32)
            out[first] = out[first] + _finite_zero(probe).astype(out[first].dtype)
    return jax.tree.unflatten(treedef, out)


def tied_checkpoint(fn: Callable) -> Callable:
    """``fn`` recomputed in the backward pass from its array inputs, the
    recomputation tied to the incoming gradient (`_tie`) so that XLA:CPU can
    neither merge it with the forward pass nor run it early. ``fn``'s own
    arrays (a module's weights) are inputs too, but not tied, so no weight is
    copied."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        own, own_def = jax.tree.flatten(fn)
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dynamic = [is_array(x) for x in own + leaves]
        static = [None if d else x for x, d in zip(own + leaves, dynamic)]
        n_own = sum(dynamic[:len(own)])

        def run(arrays):
            it = iter(arrays)
            full = [next(it) if d else s for d, s in zip(dynamic, static)]
            f = jax.tree.unflatten(own_def, full[:len(own)])
            a, k = jax.tree.unflatten(treedef, full[len(own):])
            return f(*a, **k)

        @jax.custom_vjp
        def call(arrays):
            return run(arrays)

        def forward(arrays):
            return run(arrays), arrays

        def backward(arrays, cotangent):
            arrays = list(arrays[:n_own]) + _tie(list(arrays[n_own:]), cotangent)
            _, vjp = jax.vjp(run, arrays)
            return vjp(cotangent)

        call.defvjp(forward, backward)
        return call([x for x, d in zip(own + leaves, dynamic) if d])

    return wrapped
