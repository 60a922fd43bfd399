"""Plan a training run before running it: compile the real step on abstract
shapes and read memory, communication and FLOPs off the compiled program.

Nothing is allocated: the model is ``eqx.filter_eval_shape``'d, the state
built by `init_state` on it is ``jax.ShapeDtypeStruct``\\ s with their
shardings, and the train step is lowered and compiled for those. The figures
are the compiler's own (its buffer assignment, its collectives, its cost
model) for the devices of ``mesh``: on simulated CPU devices they are XLA:CPU's,
on GPUs XLA:GPU's, on a TPU slice that ``jax.experimental.topologies``
describes (no TPU attached) libtpu's. An accelerator's compiler refuses a step
that cannot fit its device; the plan then says so (``refused``, fits False).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..context import batch_spec, check_per_token_keys, check_seq_keys, check_whole_keys
from ._explore import explore_options
from ._grouped_flops import overcount
from ._hlo import Collective, collectives, estimated_flops, loop_factor, summarise
from ._timing import crosses, parse_bytes, refused_temporaries, seconds, wire_bytes
from ..mesh import DATA, MODEL, STAGE, check_mesh, check_specs, check_specs_match, sharding_of
from ..state import abstract_model, init_state, is_constructor, with_opt_state_dtype
from ..sharding import program_facts, specs_from
from .._trees import human_bytes, is_spec, named_leaves, per_device_shape
from ..steps import ScanResiduals, check_microbatches, make_train_step, remat as remat_loss
from .._typing import short_repr, typechecked, warn_user


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one compiled training step needs, per device. Print it.

    ``peak`` is what the step holds at its highest point: its arguments
    (parameters, optimizer state, batch), its temporaries (gradients,
    activations, the update) and whatever outputs do not reuse a donated
    input. ``gradients`` is the trainable parameters' size, which the
    temporaries include."""

    mesh: dict[str, int]
    settings: dict[str, Any]
    global_batch: int
    parameters: int
    optimizer: int
    batch: int
    gradients: int
    temporaries: int
    peak: int
    collectives: dict[str, dict[str, int]]
    flops: float
    device_memory: int | None = None
    tried: tuple = ()
    refused: str | None = None  # the compiler's own out-of-memory error, when it would not build the step
    note: str | None = None  # how the FLOPs were counted, where that differs from the compiler's own figure
    compiler: str = ""  # whose figures these are: "XLA:CPU (cpu)", "XLA:GPU (NVIDIA H100 80GB HBM3)", ...
    warnings: tuple[str, ...] = ()  # what the plan found wrong with its own specs (printed, and warned once)
    # every collective one step runs, with its device groups (for `stage_bytes` and `timing`)
    found: tuple[Collective, ...] = dataclasses.field(default=(), repr=False)

    @property
    def stages(self) -> int:
        return self.mesh.get(STAGE, 1)

    @property
    def bubble(self) -> float:
        """The share of the stack's time each stage idles: ``(S - 1) / (M + S - 1)`` (0 without stages)."""
        m = self.settings.get("microbatches")
        return 0.0 if self.stages == 1 or not m else (self.stages - 1) / (m + self.stages - 1)

    @property
    def stage_bytes(self) -> int:
        """Bytes one device sends a step to devices of other stages (on the wire: a ring's, see
        `wire_bytes`): what crosses the slow link when stages are hosts."""
        n = math.prod(self.mesh.values())
        return int(sum(wire_bytes(c, n) for c in self.found if crosses(c, n // self.stages)))

    def timing(self, *, flops_per_second: Any, devices_per_host: int, within_host: Any = "450GB/s",
               between_hosts: Any = "25GB/s") -> dict[str, float]:
        """A step's seconds from its compiled FLOPs and bytes: ``compute`` (FLOPs / the device's
        rate), ``within`` and ``between`` (each collective's bytes on the wire over the links of its
        groups: between hosts when a group spans two, hosts being runs of ``devices_per_host``
        consecutive devices of the mesh), ``serial`` (their sum: nothing overlaps) and ``overlapped``
        (the largest: everything does). Rates as numbers (per second) or text ("25GB/s", "989TFLOP/s")."""
        return seconds(self, flops_per_second=flops_per_second, devices_per_host=devices_per_host,
                       within_host=within_host, between_hosts=between_hosts)

    @property
    def fits(self) -> bool | None:
        if self.refused is not None:
            return False
        return None if self.device_memory is None else self.peak <= self.device_memory

    @property
    def margin(self) -> int | None:
        """Bytes to spare per device (negative: missing)."""
        return None if self.device_memory is None else self.device_memory - self.peak

    def describe(self) -> str:
        s = self.settings
        parts = [" x ".join(f"{k}={v}" for k, v in self.mesh.items())]
        parts += [k for k in ("fsdp", "remat") if s.get(k)]
        if s.get("compute_dtype"):
            parts.append(f"{np.dtype(s['compute_dtype']).name} compute")
        if s.get("fp8"):
            parts.append("fp8 products")
        if s.get("opt_state_dtype"):
            parts.append(f"{np.dtype(s['opt_state_dtype']).name} optimizer state")
        if s.get("accumulate", 1) > 1:
            parts.append(f"accumulate={s['accumulate']}")
        if s.get("scan_residuals", "products") != "products":
            parts.append(f"scan_residuals={s['scan_residuals']!r}")
        if self.stages > 1 and s.get("microbatches"):
            parts.append(f"microbatches={s['microbatches']}")
        return ", ".join(parts)

    def __str__(self) -> str:
        lines = [f"plan: {self.describe()}; global batch {self.global_batch}",
                 f"figures from {self.compiler}, compiling for these devices", "per device:"]
        rows = [("parameters", self.parameters), ("optimizer state", self.optimizer), ("batch", self.batch),
                ("temporaries", self.temporaries), ("  of which gradients", self.gradients),
                ("peak", self.peak)]
        lines += [f"  {name:22s} {human_bytes(v):>12s}" for name, v in rows]
        if self.device_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {'device memory':22s} {human_bytes(self.device_memory):>12s}  -> {verdict}, "
                         f"{human_bytes(abs(self.margin))} {'to spare' if self.fits else 'short'}")
        if self.refused is not None:
            lines.append(f"  the compiler refused the step (temporaries as it counts them): {self.refused}")
        comm = ", ".join(f"{k} {v['count']} x = {human_bytes(v['bytes'])}" for k, v in self.collectives.items()) or "none"
        lines.append(f"collectives per step: {comm}")
        lines.append(f"FLOPs per step per device: {self.flops:.3e}")
        if self.stages > 1:
            lines.append(f"pipeline: {self.stages} stages x {self.settings.get('microbatches')} microbatches, each "
                         f"stage idle {self.bubble:.1%} of the stack's time (the bubble); "
                         f"{human_bytes(self.stage_bytes)} a step cross from each device to other stages")
        if self.note:
            lines.append(f"  ({self.note})")
        if self.tried:
            lines.append("tried:")
            width = max(len(label) for label, _ in self.tried)
            for label, other in self.tried:
                verdict = "" if other.fits is None else (" fits" if other.fits else " does not fit")
                lines.append(f"  {label:{width}s} peak {human_bytes(other.peak):>12s}{verdict}")
            good = sorted(((label, other) for label, other in self.tried if other.fits),
                          key=lambda lp: (_collective_bytes(lp[1]), lp[1].flops, lp[1].peak))
            if good:  # fewest bytes first; what bytes cost against FLOPs is the links' (compare_plans)
                lines.append(f"would fit with: {good[0][0]}" + (
                    " (of those that fit, the fewest collective bytes, then FLOPs: "
                    + "; ".join(f"{label}: {human_bytes(_collective_bytes(o))}, {o.flops:.2e} FLOPs"
                                for label, o in good) + "; redeqx.compare_plans weighs them at your links' rates)"
                    if len(good) > 1 else ""))
            elif self.fits is False:
                lines.append("nothing tried fits (each change alone, those that help together, with accumulation down "
                             "to one row per micro-batch; up to the most model shards these devices allow): more "
                             "devices are needed (or a shorter sequence)")
        lines += [f"warning: {text}" for text in self.warnings]
        bf16 = [p for p in (self, *(other for _, other in self.tried)) if p.settings.get("compute_dtype") is not None]
        if self.compiler.startswith("XLA:CPU") and bf16:
            lines.append(CPU_BF16)
        gaps = [p for p in (self, *(other for _, other in self.tried))
                if p.settings.get("accumulate", 1) > 1 or p.settings.get("fsdp")]
        if self.compiler.startswith("XLA:CPU") and gaps:
            lines.append(CPU_BYTES)
        return "\n".join(lines)


CPU_BF16 = ("note: XLA:CPU computes bfloat16 math through float32 temporaries, so its peak with bfloat16 compute "
            "is not a GPU's or a TPU's (which falls; XLA:CPU's may even rise above float32's): plan for the "
            "accelerator's compiler to count bfloat16 compute (see redeqx.plan's docstring)")


CPU_BYTES = ("note: collective bytes here are XLA:CPU's. XLA:GPU and libtpu move fewer with fsdp (an all-reduce "
             "then a slice is a reduce-scatter there: 1.4-1.8x fewer bytes on small models) and with accumulate=k "
             "(they all-reduce the gradients once, after the micro-batches' loop; XLA:CPU does once per micro-batch, "
             "k times the bytes)")


def compiler_of(mesh: Mesh) -> str:
    """Whose figures a plan on ``mesh`` gives: the compiler of its devices, and their kind."""
    device = mesh.devices.flat[0]
    name = {"cpu": "XLA:CPU", "gpu": "XLA:GPU", "cuda": "XLA:GPU", "rocm": "XLA:GPU", "tpu": "libtpu (XLA:TPU)"}
    return f"{name.get(device.platform, 'XLA:' + device.platform.upper())} ({device.device_kind})"


def _leaf_bytes(tree) -> int:
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.ShapeDtypeStruct):
            sh = x.sharding
            shape = per_device_shape(x.shape, sh.spec, sh.mesh) if isinstance(sh, NamedSharding) else x.shape
            total += math.prod(shape) * x.dtype.itemsize  # (a threefry key's: 8, its two words)
    return total


def _abstract_batch(batch, mesh: Mesh, seq_keys: tuple[str, ...] = ()):
    n_data = mesh.shape[DATA]

    def one(kp, x):
        shape, dtype = tuple(np.shape(x)), x.dtype
        seq = bool(kp) and getattr(kp[0], "key", None) in seq_keys
        spec = batch_spec(len(shape), mesh, seq) if shape and shape[0] % n_data == 0 else P()
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_of(spec, mesh))

    return jax.tree_util.tree_map_with_path(one, batch)


def _flops(compiled) -> float:
    """XLA's own FLOP count, which counts a while loop's body once."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def _one_plan(abstract, loss_fn, optimizer, batch, mesh, key, settings, device_memory) -> Plan:
    specs = settings["specs"]
    if specs is None:
        specs = specs_from(abstract, mesh, settings["facts"], settings["overrides"], settings["fsdp"])
    if settings["opt_state_dtype"] is not None:
        optimizer = with_opt_state_dtype(optimizer, settings["opt_state_dtype"])
    trainable = settings["trainable"]
    state = init_state(abstract, optimizer, mesh, specs, key=key, trainable=trainable,
                       model_state=settings.get("model_state"))
    step = make_train_step(remat_loss(loss_fn) if settings["remat"] else loss_fn, optimizer, mesh, specs,
                           accumulate=settings["accumulate"], compute_dtype=settings["compute_dtype"],
                           trainable=trainable, scan_residuals=settings["scan_residuals"],
                           microbatches=settings.get("microbatches"), fp8=settings.get("fp8", False))
    batch = _abstract_batch(batch, mesh, settings["seq_keys"])
    params = _leaf_bytes(state.model)
    trainable_params = _leaf_bytes(eqx.filter(state.model, trainable)) if trainable is not None else params
    common = dict(
        mesh=dict(mesh.shape),
        settings={k: v for k, v in settings.items()
                  if k not in ("overrides", "trainable", "facts", "seq_keys", "specs", "model_state")},
        global_batch=int(jax.tree.leaves(batch)[0].shape[0]),
        parameters=params,
        optimizer=_leaf_bytes(state.opt_state),
        batch=_leaf_bytes(batch),
        gradients=trainable_params,
        device_memory=device_memory,
        compiler=compiler_of(mesh),
    )
    traced = step.trace(state, batch)
    with jax.set_mesh(mesh):
        lowered = traced.lower()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        # An accelerator's compiler (libtpu) knows its device's memory and refuses a step that
        # cannot fit it; XLA:CPU never does. That is this plan's answer, not a failure to plan.
        message = str(e)
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        temporaries = refused_temporaries(message)
        return Plan(**common, temporaries=temporaries,
                    peak=common["parameters"] + common["optimizer"] + common["batch"] + temporaries,
                    collectives={}, flops=0.0, refused=message.strip().splitlines()[0])
    stats = compiled.memory_analysis()
    peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes)
    flops, note = _counted_flops(compiled, lowered, traced, mesh)
    found = tuple(collectives(compiled.as_text()))
    return Plan(**common, temporaries=stats.temp_size_in_bytes, peak=peak,
                collectives=summarise(list(found)), flops=flops, note=note, found=found)


def _counted_flops(compiled, lowered, traced, mesh: Mesh) -> tuple[float, str | None]:
    """The step's FLOPs per device and, where they are not the compiler's own figure, why."""
    # XLA counts a loop's body once: scaled by the loops of the compiled program itself, whose shapes are
    # each device's (the lowered text mixes the global shapes with a shard_map body's per-device ones,
    # which undercounted a context-split attention by up to 40%)
    flops = _flops(compiled) * loop_factor(compiled.as_text())
    by_rows, extra = overcount(traced.jaxpr)
    if not (extra and mesh.devices.flat[0].platform == "cpu"):
        return flops, None
    # the program as written, every grouped matmul counted by its rows instead of over every group
    note = (f"XLA:CPU lowers jax.lax.ragged_dot densely, a masked product over every expert: its compiled "
            f"figure {flops:.3e} overstates what a grouped-matmul kernel spends. Counted here from the program's ops "
            f"with each grouped matmul by its rows and once ({by_rows:.3e} FLOPs of them; XLA merges the "
            "backward pass's recompute of the experts' forward with the forward)")
    return estimated_flops(lowered.as_text(dialect="hlo")) - extra, note


@typechecked
def plan(
    model: Any,
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    batch: Any,
    mesh: Mesh,
    *,
    key: Any = None,
    overrides: Sequence = (),
    fsdp: bool = False,
    remat: bool = False,
    accumulate: int = 1,
    compute_dtype: Any = None,
    opt_state_dtype: Any = None,
    trainable: Any = None,
    device_memory: Any = None,
    explore: bool = True,
    scan_residuals: ScanResiduals = "products",
    seq_keys: Sequence[str] = (),
    whole_keys: Sequence[str] = (),
    specs: Any = None,
    microbatches: int | None = None,
    fp8: bool = False,
    model_state: Any = None,
) -> Plan:
    """Compile the training step for ``model`` on ``mesh`` without allocating
    anything, and report per device: parameters, optimizer state, batch,
    temporaries (gradients included), peak; the collectives (kind, count,
    bytes); FLOPs per step; and, given ``device_memory`` (bytes, or "40GB"),
    whether it fits and with what margin.

    - ``model``: a constructor ``make_model(key)``, an abstract model
      (``eqx.filter_eval_shape``), or a model (only its shapes are used).
    - ``batch``: one global batch, as arrays or ``jax.ShapeDtypeStruct``\\ s
      (``per_device_batch_size * data`` rows).
    - ``fsdp``, ``overrides``: as in `sharding_rules`; ``remat``: the loss
      through `redeqx.remat`; ``accumulate``, ``compute_dtype``, ``trainable``,
      ``scan_residuals``: as in `make_train_step`; ``opt_state_dtype``: the
      optimizer state kept in that dtype (`with_opt_state_dtype`);
      ``seq_keys``, ``whole_keys``: as in `batches`, the batch keys whose
      dim 1 a mesh's ``context`` axis splits, and those it keeps whole.
    - ``microbatches``: on a mesh with pipeline stages, as in
      `make_train_step`; the plan then says the bubble and the bytes that
      cross from each device to other stages (``stage_bytes``).
      ``plan.timing(flops_per_second=..., devices_per_host=...,
      within_host="450GB/s", between_hosts="25GB/s")`` turns a plan's
      compiled FLOPs and bytes into seconds, and `compare_plans` sets plans
      (stages over the hosts against FSDP over them, say) side by side.
    - ``fp8``: the linear layers' products in float8, as in `make_train_step`.
    - ``model_state``: the model's ``eqx.nn.State`` (BatchNorm's statistics,
      spectral normalisation's power iteration), for a ``loss_fn(model, batch,
      key, model_state)``, as in `init_state` and `sharding_rules`.
    - ``specs``: a spec tree to plan instead of the rules' (`sharding_rules`,
      `specs_from_overrides`: a hand plan); then ``fsdp`` and ``overrides``
      are not taken, and the exploration keeps these specs and this mesh.

    At ``n_model_shards > 1`` the specs planned (the program's, from
    `sharding_rules` with ``loss_fn`` and ``batch``, or ``specs``) are
    checked against the names' plan (`sharding_rules` without a program, the
    same ``overrides`` and ``fsdp``), which costs nothing when the two agree.
    Where they differ, the step is compiled once more with the names' specs
    (one extra compile, only then), and if the planned specs move more than
    1.05x the names' collective bytes per step, the plan warns (a
    ``UserWarning``, and a ``warning:`` line in the printed plan, kept in
    ``warnings``) with both byte counts and the leaves whose specs differ.

    A mixture of experts' grouped matmuls (``jax.lax.ragged_dot``, as
    `redeqx.models.MoE` computes) count by their rows, as a grouped-matmul
    kernel (a TPU's) runs them. On a CPU, where JAX lowers them as a masked product over every
    expert, the compiled figure overstates them E-fold: there the FLOPs are
    counted from the program's ops with each grouped matmul by its rows, and
    ``note`` says so, with the compiled figure.

    When it does not fit and ``explore`` is true, each of fsdp, remat,
    bfloat16 compute, a bfloat16 optimizer state, a smaller micro-batch
    (``accumulate``) and more model shards is compiled too; then those that
    lowered the peak are added one by one (the best first) until it fits, and
    the combination's micro-batch is halved while it divides the per-device
    batch, down to one row, stopping at the first that fits (at most
    log2(per-device batch) more compiles). The printed plan lists each with
    its peak and names the first that fits; only when none does does it say
    more devices are needed.

    The plan names the compiler whose figures it gives (``compiler``, e.g.
    ``"XLA:CPU (cpu)"``). XLA:CPU computes bfloat16 math through float32
    temporaries: its peak with bfloat16 compute is not an accelerator's (it
    can rise above float32's where a GPU's falls), and the printed plan says
    so.

    **Example:**

    ```python
    config = models.LlamaConfig()                                   # LLaMA-7B
    batch = {"ids": jax.ShapeDtypeStruct((4, 1025), jnp.int32)}
    p = redeqx.plan(lambda key: models.LlamaForCausalLM(config, key=key), loss_fn, optax.adamw(1e-5),
                    batch, redeqx.make_mesh(4), device_memory="40GB")
    print(p)
    ```

    The figures are those of the compiler of ``mesh``'s devices. To plan for
    an accelerator this machine does not have, build the mesh from devices
    that only describe it. For a TPU slice (libtpu installed, no TPU
    needed), pass ``jax.experimental.topologies.get_topology_desc(
    platform="tpu", topology_name="v4:4x4x4", chip_config_name="megacore",
    chips_per_host_bounds=(2, 2, 1)).devices`` as `make_mesh`'s ``devices``:
    the plan is then the TPU compiler's own (benchmarks/table1.py plans
    redco's TPU rows this way).
    """
    mesh = check_mesh(mesh)
    seq_keys = check_seq_keys(seq_keys, mesh, "redeqx.plan")
    check_per_token_keys(batch, seq_keys, check_whole_keys(whole_keys, seq_keys), mesh)
    key = jax.random.key(0) if key is None else key
    if is_constructor(model):
        abstract = abstract_model(model, key)
    else:
        abstract = eqx.filter_eval_shape(lambda: model)
    device_memory = parse_bytes(device_memory)
    if not any(isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) for x in jax.tree.leaves(abstract)):
        raise ValueError(f"redeqx.plan: model ({short_repr(model)}) holds no array: there is nothing to place or "
                         "train. Pass the model (an eqx.Module or a tree of arrays), or a function making it.")
    if specs is not None:
        _check_specs_given(specs, abstract, mesh, fsdp, overrides)
    settings = dict(fsdp=fsdp, remat=remat, accumulate=accumulate, compute_dtype=compute_dtype,
                    microbatches=check_microbatches(microbatches, mesh), fp8=fp8,
                    opt_state_dtype=opt_state_dtype, overrides=tuple(overrides), trainable=trainable,
                    scan_residuals=scan_residuals, facts=program_facts(abstract, loss_fn, batch, model_state),
                    seq_keys=seq_keys, specs=specs, model_state=model_state)
    first = _one_plan(abstract, loss_fn, optimizer, batch, mesh, key, settings, device_memory)
    text = _versus_names(abstract, loss_fn, optimizer, batch, mesh, key, settings, first)
    if text is not None:
        warn_user(f"redeqx.plan: {text}")
        first = dataclasses.replace(first, warnings=(*first.warnings, text))
    if first.fits is not False or not explore:
        return first

    def attempt(mesh, settings):
        return _one_plan(abstract, loss_fn, optimizer, batch, mesh, key, settings, device_memory)

    return dataclasses.replace(first, tried=tuple(explore_options(first, settings, mesh, attempt)))


def _check_specs_given(specs, abstract, mesh: Mesh, fsdp: bool, overrides: Sequence) -> None:
    if fsdp or tuple(overrides):
        given = "fsdp=True" if fsdp else f"overrides={list(overrides)!r}"
        raise ValueError(f"redeqx.plan got specs= and {given}: the specs are final. Build them with the "
                         "overrides and fsdp instead (redeqx.sharding_rules(model, mesh, overrides=..., "
                         "fsdp=...)), or leave specs out and pass overrides and fsdp here.")
    check_specs(specs, mesh)
    check_specs_match(abstract, specs, "model")


def _collective_bytes(p: Plan) -> int:
    return sum(v["bytes"] for v in p.collectives.values())


def _differing(planned, names) -> list[str]:
    """The paths of the leaves whose specs differ (``P("model", None)`` is ``P("model")``)."""
    def norm(spec):
        spec = tuple(spec) if spec is not None else ()
        while spec and spec[-1] is None:
            spec = spec[:-1]
        return spec

    return [path for (path, a), (_, b) in zip(named_leaves(planned, is_spec), named_leaves(names, is_spec))
            if norm(a) != norm(b)]


def _versus_names(abstract, loss_fn, optimizer, batch, mesh, key, settings, planned: Plan) -> str | None:
    """A warning when the specs planned move more bytes per step than the names' plan
    (`sharding_rules` without a program, the same overrides and fsdp), or None. The names'
    step is compiled only where its specs differ from the planned ones."""
    if mesh.shape[MODEL] == 1 or planned.refused is not None:
        return None
    with warnings.catch_warnings():  # the rules' own warnings were said when the planned specs were made
        warnings.simplefilter("ignore")
        names = specs_from(abstract, mesh, None, settings["overrides"], settings["fsdp"])
        ours = settings["specs"]
        if ours is None:
            ours = specs_from(abstract, mesh, settings["facts"], settings["overrides"], settings["fsdp"])
    differ = _differing(ours, names)
    if not differ:
        return None
    by_names = _one_plan(abstract, loss_fn, optimizer, batch, mesh, key, {**settings, "specs": names}, None)
    moved, names_moved = _collective_bytes(planned), _collective_bytes(by_names)
    if by_names.refused is not None or moved <= 1.05 * names_moved:
        return None
    which = ("the specs given move" if settings["specs"] is not None
             else "the program's plan (sharding_rules with loss_fn and batch) moves")
    ratio = f"{moved / names_moved:.2f}x" if names_moved else "where it moves none"
    shown = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
    return (f"{which} {human_bytes(moved)} of collectives per step per device, {ratio} the names' plan "
            f"(sharding_rules(model, mesh), {human_bytes(names_moved)}); they differ at {shown}. Compare the two with "
            "redeqx.explain; to train with the names' layout pass its specs, or pin these leaves with "
            "overrides=[(regex, spec)].")
