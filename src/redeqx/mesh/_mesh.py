"""Devices -> a ``("data", "model")`` mesh, ``("data", "context", "model")`` with sequences split, and a
``"stage"`` axis in front of either with the stacked layers pipelined."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from .._typing import typechecked

DATA = "data"
CONTEXT = "context"  # the sequence split (redeqx.context._context)
MODEL = "model"
STAGE = "stage"  # pipeline stages over the stacked layers (redeqx.steps._pipeline), outermost


@typechecked
def make_mesh(
    n_model_shards: int | Literal["auto"] = 1,
    *,
    n_context_shards: int | Literal["auto"] = 1,
    n_pipeline_stages: int = 1,
    devices: Sequence[jax.Device] | None = None,
    planner: Callable[[Mesh], Any] | None = None,
) -> Mesh:
    """Arrange devices in a ``("data", "model")`` mesh.

    ``model`` has ``n_model_shards`` devices (tensor parallelism: each weight is
    split into that many pieces); ``data`` has the rest (data parallelism: each
    row of the mesh gets its own slice of the batch). Devices that share a
    ``model`` group are adjacent in ``devices`` order, so on a GPU server the
    model's collectives stay inside fast links.

    ``n_model_shards="auto"`` picks the smallest that fits: ``planner(mesh)``
    (a `plan` with ``device_memory``, e.g. ``functools.partial(redeqx.plan,
    make_model, loss_fn, optimizer, batch, device_memory="40GB")``) is tried on
    each candidate mesh, 1, 2, 4, ... model shards, each compiled on
    abstract shapes, and the first whose plan fits is returned.

    ``n_context_shards > 1`` adds a ``"context"`` axis between the two
    (``("data", "context", "model")``, ``data`` the devices left): each
    sequence is split over that many devices (context parallelism, for
    sequences whose activations do not fit one device; see
    `redeqx.attention` and ``seq_keys`` in `redeqx.batches`). Without it the
    mesh is the 2-D one, exactly as before. ``n_context_shards="auto"``
    (with a ``planner`` whose `plan` has ``seq_keys``) searches it too: the
    candidates go by how many devices share one sequence (context x model:
    1, 2, 4, ...), at a tie the model split first (it also splits the
    weights), and the first that fits is returned; a model whose weights
    fit but whose sequence does not then gets a context axis.

    ``n_pipeline_stages > 1`` adds a ``"stage"`` axis in front (outermost:
    consecutive devices, so a host's devices share a stage and only the
    stage boundary's activations cross the link between hosts): stage ``s``
    holds layers ``[s L / S, (s + 1) L / S)`` of each stack of ``L`` layers,
    and the train and eval steps run the stack's ``lax.scan`` as a pipeline of
    ``microbatches`` (GPipe). Everything else (embedding, head, loss, every
    other weight) is on every stage, as on a mesh without stages; the batch
    is split over ``data`` only. ``data`` has the devices left:
    ``len(devices) / (S x context x model)``. See the guide, "Pipeline stages".

    Every axis is ``Auto``: the sharding rules only place parameters, and the
    partitioner's propagation (Shardy, this JAX's default) then decides the
    layout of every activation. ``Explicit``
    axes (this JAX's default for ``jax.make_mesh``) would make every user's
    ``loss_fn`` spell out ``out_sharding`` for each row-parallel matmul, which
    breaks the promise that any Equinox model works unchanged; the equivalence
    and collective tests in ``tests/`` show ``Auto`` gives single-device results
    and no parameter gathers. Meshes made otherwise are accepted everywhere
    (see `check_mesh`).

    **Example:**

    ```python
    mesh = redeqx.make_mesh(n_model_shards=2)   # 8 devices -> data=4, model=2
    mesh = redeqx.make_mesh(2, n_context_shards=2)   # 8 devices -> data=2, context=2, model=2
    mesh = redeqx.make_mesh(2, n_pipeline_stages=2)  # 8 devices -> stage=2, data=2, model=2
    ```
    """
    if devices is None:
        devices = jax.devices()
    devices = list(devices)
    if len(devices) == 0:
        raise ValueError("devices is empty: pass at least one device, or leave devices=None to use jax.devices().")
    if n_context_shards != "auto":
        n_context_shards = _positive(n_context_shards, "n_context_shards")
    n_stages = _positive(n_pipeline_stages, "n_pipeline_stages")
    if n_stages > 1:
        if len(devices) % n_stages:
            raise ValueError(
                f"n_pipeline_stages={n_stages} does not divide the {len(devices)} devices: pick one in "
                f"{[d for d in range(1, len(devices) + 1) if len(devices) % d == 0]}.")
        if "auto" in (n_model_shards, n_context_shards):
            raise ValueError(
                f"n_pipeline_stages={n_stages} with an 'auto' shard count: the search does not cover stages. Give "
                "n_model_shards and n_context_shards as numbers (redeqx.plan on each mesh compares them).")
        per_stage = len(devices) // n_stages
        inner = make_mesh(n_model_shards, n_context_shards=n_context_shards, devices=devices[:per_stage])
        grid = np.asarray(devices, dtype=object).reshape(n_stages, *inner.devices.shape)
        return Mesh(grid, (STAGE, *inner.axis_names), axis_types=(AxisType.Auto,) * grid.ndim)
    if "auto" in (n_model_shards, n_context_shards):
        return _auto_mesh(devices, planner, n_model_shards, n_context_shards)
    if isinstance(n_model_shards, bool) or not isinstance(n_model_shards, (int, np.integer)):
        raise TypeError(f"n_model_shards must be an int or 'auto', got {n_model_shards!r} ({type(n_model_shards).__name__}).")
    if n_model_shards < 1:
        raise ValueError(f"n_model_shards must be >= 1, got {n_model_shards}.")
    inner = int(n_model_shards) * n_context_shards
    if len(devices) % inner != 0:
        divisors = [d for d in range(1, len(devices) + 1) if len(devices) % d == 0]
        what = (f"n_model_shards={n_model_shards}" if n_context_shards == 1 else
                f"n_context_shards={n_context_shards} x n_model_shards={n_model_shards} = {inner}")
        raise ValueError(
            f"{what} does not divide the {len(devices)} devices: the mesh needs data * "
            f"{'' if n_context_shards == 1 else 'context * '}model = {len(devices)}. Pick "
            f"{'n_model_shards' if n_context_shards == 1 else 'a product'} in {divisors}."
        )
    n_data = len(devices) // inner
    if n_context_shards == 1:
        grid = np.asarray(devices, dtype=object).reshape(n_data, int(n_model_shards))
        return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))
    grid = np.asarray(devices, dtype=object).reshape(n_data, n_context_shards, int(n_model_shards))
    return Mesh(grid, (DATA, CONTEXT, MODEL), axis_types=(AxisType.Auto,) * 3)


def _positive(n, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}; 1 means not split.")
    return int(n)


def _candidates(n_devices: int, model, context) -> list[tuple[int, int]]:
    """(model, context) pairs to try, each ``"auto"`` over the divisors: fewest
    devices to a sequence first, at a tie the most model shards."""
    divisors = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
    pairs = [(m, c) for m in (divisors if model == "auto" else [int(model)])
             for c in (divisors if context == "auto" else [context]) if n_devices % (m * c) == 0]
    return sorted(pairs, key=lambda mc: (mc[0] * mc[1], -mc[0]))


def _auto_mesh(devices: list, planner, model, context) -> Mesh:
    what = " and ".join(f"n_{n}_shards" for n, v in (("model", model), ("context", context)) if v == "auto")
    if planner is None:
        raise ValueError(
            f'{what}="auto" needs planner=: e.g. planner=functools.partial(redeqx.plan, make_model, loss_fn, '
            'optimizer, batch, device_memory="40GB"), which make_mesh calls with each candidate mesh.'
        )
    # `plan` explores what would make a step fit (a dozen more compiles) when it does not: worth it
    # once, for the advice, not for every candidate of the search
    quiet = {"explore": False} if _takes(planner, "explore") else {}
    seen, last = [], None
    for m, c in _candidates(len(devices), model, context):
        mesh = make_mesh(m, n_context_shards=c, devices=devices)
        name = f"n_model_shards={m}" + (f", n_context_shards={c}" if context == "auto" or c > 1 else "")
        try:
            found = planner(mesh, **quiet)
        except ValueError as e:  # e.g. a global batch this data axis cannot split
            seen.append(f"{name}: {e}")
            continue
        fits = getattr(found, "fits", found)
        if fits is None:
            raise ValueError("the planner's plan has no device_memory to fit: pass device_memory= to redeqx.plan.")
        if fits:
            return mesh
        seen.append(f"{name}: peak {getattr(found, 'peak', '?')} bytes per device")
        last = mesh, name
    advice = ""
    if quiet and last is not None:  # the most devices to a sequence that could run: what else would make it fit
        advice = f"\nAt {last[1]}, what redeqx.plan tried:\n{planner(last[0])}"
    raise ValueError(
        f"no {what.replace(' and ', ' / ')} fits on these {len(devices)} devices:\n  " + "\n  ".join(seen) + advice
        + "\nTry fsdp=True, remat=True, compute_dtype=jnp.bfloat16 or accumulate in the planner, or more devices."
    )


def _takes(fn, name: str) -> bool:
    """Whether ``fn`` (a function or a ``functools.partial`` of one) takes the keyword ``name``."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


_MESH_FIX = (
    "build it with redeqx.make_mesh(n_model_shards), or name your own mesh's axes "
    "jax.make_mesh((n_data, n_model), ('data', 'model'), axis_types=(AxisType.Auto, AxisType.Auto)) "
    "(or ('data', 'context', 'model') for sequences split over devices, with 'stage' in front for pipeline stages)"
)
_AXES = ((DATA, MODEL), (DATA, CONTEXT, MODEL), (STAGE, DATA, MODEL), (STAGE, DATA, CONTEXT, MODEL))


@typechecked
def check_mesh(mesh, name: str = "mesh") -> Mesh:
    """The mesh redeqx works with: ``mesh`` itself when it has ``Auto`` axes
    ``("data", "model")`` or ``("data", "context", "model")`` (either with
    ``"stage"`` in front); the same devices and axes with ``Auto`` types when
    it has ``Explicit`` ones (``jax.make_mesh``'s default in this JAX); an
    error naming the axes and the fix for anything else."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{name} must be a jax.sharding.Mesh, got {type(mesh).__name__}; {_MESH_FIX}.")
    if sorted(mesh.axis_names) not in [sorted(a) for a in _AXES]:
        raise ValueError(
            f"{name} has axes {tuple(mesh.axis_names)}, but redeqx needs ('data', 'model') or "
            f"('data', 'context', 'model'), either with 'stage' in front; {_MESH_FIX}.")
    types = tuple(getattr(mesh, "axis_types", ()) or ())
    if types and any(t != AxisType.Auto for t in types):
        # Explicit (or Manual) axes put shardings into array types, which users' loss
        # functions would then have to spell out; redeqx's rules rely on propagation (Auto axes, Shardy).
        return _auto(mesh)
    return mesh


def traced_platform() -> str:
    """The platform ("cpu", "gpu", "tpu") of the computation being built: that
    of the mesh in context (a redeqx step traces under its mesh, which may
    describe an accelerator this machine lacks), else of JAX's default
    devices."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.devices()[0].platform


def same_devices(a: Mesh, b: Mesh) -> bool:
    """Whether two meshes hold the same devices in the same grid (whatever
    their axis names or types)."""
    return a.devices.shape == b.devices.shape and all(
        x.id == y.id for x, y in zip(a.devices.flat, b.devices.flat))


def mesh_text(mesh: Mesh) -> str:
    """``{data: 4, model: 2}``."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in mesh.shape.items()) + "}"


_AUTO_CACHE: dict = {}


def _auto(mesh: Mesh) -> Mesh:
    # one Auto twin per mesh, so compiled steps keyed by the mesh are reused
    key = (mesh.axis_names, mesh.devices.shape, tuple(d.id for d in mesh.devices.flat))
    twin = _AUTO_CACHE.get(key)
    if twin is None:
        twin = _AUTO_CACHE[key] = Mesh(mesh.devices, mesh.axis_names,
                                       axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return twin
