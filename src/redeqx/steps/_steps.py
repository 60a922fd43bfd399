"""Compiled, sharded steps: `make_step` for a step you write, and the train,
eval and predict steps made from a ``loss_fn`` or ``pred_fn``.

Each is a `CompiledStep`: one ``jax.jit`` per structure of its first
argument, whose array leaves are placed before the call (by ``specs`` for
the train, eval and predict steps, where they are for `make_step`). The
train step's gradients come from the composable gradient functions of
`redeqx.steps._loss` (and `redeqx.steps._shard_mean`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from ._batch_pins import on_mesh
from ._conv_grads import products_for_batch_grouped_convs
from ._cpu import ordered_collectives_check
from ._per_shard import per_data_shard
from ._pipeline import check_microbatches
from ._compiled import CompiledStep, StepFunction, stay_in_place, where_it_is
from ._loss import accumulated, call_loss, cast_floats, check_user_fn, loss_and_grads
from ._remat import ScanResiduals
from ._accumulate_check import accumulation_check
from ._rows_check import rows_check
from ._shard_mean import by_shard
from ..data import batch_size, check_batch
from ..mesh import DATA, check_mesh, check_specs, check_specs_match, sharding_of
from ..state import Optimizer, TrainState, as_optimizer, mirror_specs, optimizer_update, split_trainable
from .._rewrite import rewritten
from .._trees import is_array_like, leaves_with_specs
from .._typing import (
    LOSS_CALL, LOSS_EXAMPLE, check_signature, floating_dtype, fn_name, positive_int, short_repr, typechecked,
)

# ----------------------------------------------------------------------------- make_step


@typechecked
def make_step(step_fn: Callable, mesh: Mesh, *, donate: bool = True) -> Callable:
    """Compile a pure step ``step_fn(state, *args) -> (new_state, outputs)``.

    ``state`` is any pytree (one model or several, `TrainState`\\ s, optimizer
    states, a replay buffer...). Every array leaf of the new state keeps the
    sharding of the same leaf in the input state (leaves not yet on a mesh,
    such as NumPy arrays, are replicated; a leaf on another mesh is an
    error), so the step can be called in a loop with no re-layout and no
    retrace. ``donate=True`` reuses the old state's buffers for the new one:
    do not use the old state after the call (`init_state`, `init_opt_state`
    and `shard` copy, so the arrays you built it from stay yours). Non-array
    leaves are compile-time constants and must come back unchanged.
    ``outputs`` stay on the device, laid out as the compiler chooses.
    Arguments are passed as they are (a batch from `batches` is already split
    over ``data``; split one made inside the step with
    ``redeqx.constrain(batch, P("data"))``); with several processes they must
    be global arrays. `apply_gradients` is one model's optimizer update
    inside such a step. Gradients of grouped and depthwise convolutions come
    out as on one device (`exact_conv_grads`: the step's program computes
    their weight gradients by matrix products); FFTs, ``top_k`` and grouped
    convolutions that ``args[0]``'s rows reach run on each data shard's rows,
    and so do per-example gradients of convolutions (DP-SGD's), which XLA's
    partitioner aborted on, on a mesh with ``model`` shards.

    **Example** (two models and two optimizers, as in a GAN or actor-critic):

    ```python
    state = {"g": redeqx.init_state(gen, opt_g, mesh, g_specs, key=k1),
             "d": redeqx.init_state(disc, opt_d, mesh, d_specs, key=k2)}

    def gan_step(state, batch):
        ...  # gradients of each model, optimizer.update for each
        return {"g": new_g, "d": new_d}, {"g_loss": g_loss, "d_loss": d_loss}

    step = redeqx.make_step(gan_step, mesh)
    state, losses = step(state, batch)
    ```
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be a function (state, *args) -> (state, outputs), got {short_repr(step_fn)}.")
    mesh = check_mesh(mesh)
    # the weight gradients of grouped convolutions, which XLA's partitioner gets n_model_shards times too
    # large on redeqx's batch layout, computed by matrix products (as make_train_step's loss_and_grads does)
    # and FFTs, top_k and grouped convolutions run on each data shard's rows, which XLA's partitioner
    # runs on the whole batch on every device (as every step maker does: `per_data_shard`)
    exact = rewritten(per_data_shard(step_fn, mesh), products_for_batch_grouped_convs)
    step = CompiledStep(exact, mesh, placement=stay_in_place(mesh), what="state", donate=donate,
                        returns_state=True, warn_moves=False)
    return _named_like(step_fn, StepFunction(step))


def splits_over(specs, axis: str) -> bool:
    """Whether some spec in ``specs`` names mesh axis ``axis``."""
    found = [s for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)) if isinstance(s, P)]
    return any(axis in (e if isinstance(e, tuple) else (e,)) for spec in found for e in spec if e is not None)


def _named_like(fn, step):
    """``step`` with ``fn``'s name and docstring (what ``functools.wraps`` copies)."""
    return functools.update_wrapper(step, fn, updated=())


# ----------------------------------------------------------------------------- shared by the three steps


def _check_step_args(fn, role: str, call: str, example: str, mesh, specs, compute_dtype) -> Mesh:
    """The arguments every ``make_*_step`` takes: the user's function, the
    mesh, the specs and the compute dtype."""
    floating_dtype(compute_dtype, "compute_dtype")
    check_user_fn(fn, role, call, example)
    mesh = check_mesh(mesh)
    check_specs(specs, mesh)
    return mesh


def _model_placement(mesh: Mesh, specs):
    """A model (the eval and predict steps' first argument) laid out by ``specs``."""

    def placement(model, paths, leaves):
        check_specs_match(model, specs, "model")
        return [sharding_of(spec, mesh) for _, _, spec in leaves_with_specs(model, specs)]

    return placement


def _train_state_placement(mesh: Mesh, specs):
    """A TrainState: the model by ``specs``, the optimizer state like the
    parameters it mirrors, ``step`` and ``key`` replicated, a model state
    where it is."""

    def placement(state, paths, leaves):
        if not isinstance(state, TrainState):
            raise TypeError(
                f"state must be a redeqx.TrainState from redeqx.init_state, got {type(state).__name__}; for a "
                "step over another kind of state, write it with redeqx.make_step."
            )
        check_specs_match(state.model, specs, "model")
        model_state_specs = jax.tree.map(
            lambda x: where_it_is("model_state", x, mesh).spec if is_array_like(x) else None, state.model_state)
        spec_state = TrainState(model=specs, opt_state=mirror_specs(state.opt_state, state.model, specs, mesh), step=P(),
                                key=P(), model_state=model_state_specs)
        return [sharding_of(spec, mesh) for _, _, spec in leaves_with_specs(state, spec_state)]

    return placement


def _inference(model, compute_dtype):
    return cast_floats(eqx.nn.inference_mode(model, True), compute_dtype)


# ----------------------------------------------------------------------------- train


@typechecked
def make_train_step(
    loss_fn: Callable,
    optimizer: Optimizer,
    mesh: Mesh,
    specs: Any,
    *,
    accumulate: int = 1,
    compute_dtype: Any = None,
    trainable: Any = None,
    shard_mean_loss: bool = False,
    scan_residuals: ScanResiduals = "products",
    microbatches: int | None = None,
    fp8: bool = False,
) -> Callable[..., tuple[TrainState, dict]]:
    """The training step: ``(state, batch) -> (new_state, metrics)``.

    One compiled, sharded step, donating ``state``: gradients of
    ``loss_fn(model, batch, key)``, an ``optimizer`` update, ``step + 1``.
    ``metrics`` holds ``loss``, ``grad_norm`` (the gradients' global L2 norm)
    and ``loss_fn``'s aux dict, all on the device (no host sync). The model
    enters and leaves laid out by ``specs``, the optimizer state like the
    parameters it mirrors; a state laid out otherwise is moved there, with a
    warning naming the leaves. FFTs, ``top_k`` and grouped convolutions in
    ``loss_fn`` run on each data shard's own rows (XLA's partitioner would
    gather the whole batch onto every device for each: `per_data_shard`, as
    in every step maker; docs/guides/troubleshooting.md).

    - ``accumulate=k``: the batch is split into ``k`` micro-batches run one
      after another, their gradients averaged: one update per batch with the
      activation memory of a micro-batch (a loss that is a mean over rows
      gets exactly the whole batch's update; a mean over the batch's
      non-padding tokens does not: each micro-batch's tokens are weighed by
      its own count, and the first call warns, having compared on the
      batch's first rows the loss with its micro-batches' mean,
      `redeqx.steps._accumulate_check`). The aux metrics are the
      micro-batches' mean too: a mean stays the batch's, a count or a sum
      comes out ``1 / k`` of the batch's (return rates, not counts). For
      an update every ``k``
      batches instead (a batch larger than one step's), wrap the optimizer in
      ``optax.MultiSteps(optimizer, k)``.
    - ``compute_dtype=jnp.bfloat16``: forward and backward in that dtype;
      parameters, gradients and the optimizer state keep theirs.
    - ``trainable`` (an Equinox filter spec): the rest gets no gradient and
      comes out bit-identical; pass the same to `init_state`.
    - ``shard_mean_loss=True``: the promise that ``loss_fn`` is a mean over
      the batch's rows; each data shard's gradients come from its own rows
      and are averaged with one all-reduce (`redeqx.steps._shard_mean`). The first
      call checks the promise on its batch and raises if it does not hold.
      Not with ``fsdp`` or a ``model_state``.
    - ``scan_residuals``: what a ``jax.lax.scan`` in ``loss_fn`` (a stack of
      layers) keeps for its backward pass. ``"products"`` (the default): the
      results of matrix products, reductions and other non-elementwise
      operations; the elementwise ones (activations, norms' scalings,
      softmax's exponentials) are recomputed from them in the backward pass,
      as a compiler does by fusion for the same layers unrolled. ``"all"``:
      every intermediate, JAX's own choice: for a transformer stack
      1.06-3.7x the temporaries of its layers unrolled, against 0.42-1.15x
      (benchmarks/RESULTS.md, History: "`scan_residuals`").
      A scan whose body runs ``jax.checkpoint`` (`redeqx.remat`, or the
      user's own) keeps what that says. Losses and gradients are the same
      either way.
    - ``microbatches=M`` (on a mesh with ``n_pipeline_stages = S``, see
      `make_mesh`): the stacked layers' ``lax.scan`` runs as a pipeline,
      the batch cut into ``M >= S`` microbatches that flow stage to stage;
      each stage idles ``(S - 1) / (M + S - 1)`` of the stack's time (the
      bubble). The default is ``4 S``. Each microbatch's rows ``j, j + M,
      ...`` go through the layers on their own, then the rest of the loss
      runs on the whole batch: the loss and gradients are those of the
      unpipelined step for layers that treat rows independently. Composes
      with ``accumulate`` (a pipeline per accumulated micro-batch).
    - ``fp8=True``: every product of a weight and an activation (the
      linear layers; not attention scores, not grouped expert products,
      not the output layer, whose result feeds no other weight product)
      runs with float8_e4m3fn operands scaled by their current absolute
      maximum, the output gradient in float8_e5m2: the form a Hopper GPU's
      compiler runs as fp8 GEMMs (`redeqx.steps._fp8`). No scale state: the
      optimizer state is as without it. XLA:CPU computes the same
      values by converting the fp8 operands to float32.
    - An optimizer that takes extra arguments (optax's
      ``GradientTransformationExtraArgs``, e.g. ``reduce_on_plateau``) gets
      ``value=loss``; for others, write the step with `make_step`.
    - A model with state (``eqx.nn.State``, given to `init_state` as
      ``model_state``): ``loss_fn(model, batch, key, model_state)`` returns
      ``(loss, new_model_state)`` or ``(loss, aux, new_model_state)``.

    **Example:**

    ```python
    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    state, metrics = train_step(state, batch)
    ```
    """
    mesh = _check_step_args(loss_fn, "loss_fn", LOSS_CALL, LOSS_EXAMPLE, mesh, specs, compute_dtype)
    accumulate = positive_int(accumulate, "accumulate")
    microbatches = check_microbatches(microbatches, mesh)
    placement = _train_state_placement(mesh, specs)
    grads_of, check = loss_and_grads(loss_fn, compute_dtype, scan_residuals=scan_residuals, mesh=mesh,
                                     microbatches=microbatches, weights_over_data=splits_over(specs, DATA),
                                     specs=specs, fp8=fp8), None
    if shard_mean_loss and microbatches is not None:
        raise ValueError(
            "shard_mean_loss=True with pipeline stages: each data shard's own step cannot hold the stages' "
            "pipeline. Drop shard_mean_loss (the pipelined step averages gradients over data itself).")
    if fp8 and microbatches is not None:
        check = ordered_collectives_check(mesh)
    if shard_mean_loss:
        grads_of, check = by_shard(grads_of, loss_fn, accumulate, mesh, specs, trainable, placement)
    else:
        grads_of = accumulated(grads_of, accumulate, mesh)
        if microbatches is None:  # a pipelined step's loss runs over stages: not measured
            check = accumulation_check(loss_fn, accumulate, mesh, placement)
    step = CompiledStep(_train_step(grads_of, as_optimizer(optimizer), mesh, trainable), mesh, placement=placement,
                        what="state", donate=True, returns_state=True, batch_args=(0,))
    return _named_like(loss_fn, StepFunction(step, first_call_check=check))


def _train_step(grads_of, optimizer, mesh: Mesh, trainable):
    """``(state, batch) -> (new_state, metrics)``: ``grads_of`` the trainable
    parameters, one `redeqx.state.optimizer_update` (given the loss as
    ``value``), ``step + 1``."""

    def train_step(state: TrainState, batch):
        check_batch(batch, mesh)
        key, step_key = jax.random.split(state.key)
        params, static = split_trainable(state.model, trainable)
        loss, aux, grads, model_state = grads_of(params, static, batch, step_key, state.model_state)
        model, opt_state = optimizer_update(optimizer, params, static, grads, state.opt_state, value=loss)
        new_state = TrainState(model=model, opt_state=opt_state, step=state.step + 1, key=key, model_state=model_state)
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}

    return train_step


# ----------------------------------------------------------------------------- eval and predict


class EvalStep:
    """Compiled evaluation: ``eval_step(model, batch, key, *, model_state=None)
    -> metrics`` (example means). `evaluate` also uses ``eval_step.sums`` to
    weight examples exactly across a padded last batch."""

    def __init__(self, loss_fn, mesh: Mesh, specs, compute_dtype, microbatches=None):
        def per_example(model, batch, key, model_state):
            check_batch(batch, mesh)
            return laid_out(model, batch, key, model_state)

        def examples(model, batch, key, model_state):
            model = _inference(model, compute_dtype)
            batch = cast_floats(batch, compute_dtype)
            keys = jax.random.split(key, batch_size(batch))

            def one(example, k):
                loss, aux, _ = call_loss(loss_fn, model, jax.tree.map(lambda x: x[None], example), k, model_state)
                return {"loss": loss, **aux}

            return jax.vmap(one)(batch, keys)

        laid_out = on_mesh(per_data_shard(examples, mesh), mesh, microbatches,
                           weights_over_data=splits_over(specs, DATA), specs=specs)

        def means(model, batch, key, model_state):
            return jax.tree.map(lambda v: v.mean(0), per_example(model, batch, key, model_state))

        def sums(model, batch, key, weights, model_state):
            return jax.tree.map(lambda v: jnp.tensordot(weights, v, axes=1), per_example(model, batch, key, model_state))

        placement = _model_placement(mesh, specs)
        self._means = CompiledStep(means, mesh, placement=placement, what="model", batch_args=(0,))
        self._sums = CompiledStep(sums, mesh, placement=placement, what="model", batch_args=(0, 2))
        self.mesh, self.specs, self._check = mesh, specs, rows_check(loss_fn)

    def _first_call(self, model, batch, key, model_state) -> None:
        if self._check is not None:
            self._check, check = None, self._check
            check(model, batch, key, model_state)

    def __call__(self, model, batch, key, *, model_state=None):
        self._first_call(model, batch, key, model_state)
        return self._means(model, batch, key, model_state)

    def sums(self, model, batch, key, weights, *, model_state=None):
        self._first_call(model, batch, key, model_state)
        return self._sums(model, batch, key, weights, model_state)

    def lower(self, model, batch, key, *, model_state=None):
        return self._means.lower(model, batch, key, model_state)


@typechecked
def make_eval_step(loss_fn: Callable, mesh: Mesh, specs: Any, *, compute_dtype: Any = None,
                   microbatches: int | None = None) -> EvalStep:
    """Compiled evaluation: ``(model, batch, key) -> metrics``, the example
    mean of ``loss`` and ``loss_fn``'s aux, with the model in inference mode
    (``eqx.nn.inference_mode``: dropout off) and laid out by ``specs``. Each
    example's loss is computed on its own (``loss_fn`` on a batch of one,
    vmapped), so means are exact however the batch was padded; ``loss_fn``
    must treat rows independently (BatchNorm in inference mode reads its
    running statistics from ``model_state=``, passed to the call). The first
    call warns when ``loss_fn`` compares rows (in-batch negatives: a value
    growing as rows x rows), which a row alone cannot (evaluate such a loss
    with `make_step`). A mean over a batch's tokens becomes the mean of each
    example's token mean. On a mesh
    with pipeline stages the stacked layers run as a pipeline of
    ``microbatches`` (as in `make_train_step`; the batch's rows must then be
    a multiple of it). A ``loss_fn`` that takes a convolution's weight
    gradient inside itself cannot run per example on a mesh that splits
    both the batch and the model: XLA aborts while compiling it
    (docs/guides/troubleshooting.md has the workarounds).

    **Example:**

    ```python
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)
    metrics = redeqx.evaluate(eval_step, state.model, test, collate_fn, 64, mesh, key=key)
    ```
    """
    mesh = _check_step_args(loss_fn, "loss_fn", LOSS_CALL, LOSS_EXAMPLE, mesh, specs, compute_dtype)
    return EvalStep(loss_fn, mesh, specs, compute_dtype, check_microbatches(microbatches, mesh))


class PredictStep:
    """Compiled prediction: ``predict_step(model, batch, key, *,
    model_state=None) -> preds``."""

    def __init__(self, pred_fn, mesh: Mesh, specs, compute_dtype):
        name = fn_name(pred_fn)

        def predict_step(model, batch, key, model_state):
            b = batch_size(batch)  # any number of rows: those the data axis does not divide run on every shard
            model, batch = _inference(model, compute_dtype), cast_floats(batch, compute_dtype)
            if model_state is None:
                out = pred_fn(model, batch, key)
            else:
                check_signature(pred_fn, "pred_fn", 4, "(model, batch, key, model_state)",
                                "def pred_fn(model, batch, key, model_state): ...")
                out = pred_fn(model, batch, key, model_state)
            for x in jax.tree.leaves(out):
                if jnp.ndim(x) == 0 or jnp.shape(x)[0] != b:
                    raise ValueError(
                        f"pred_fn {name!r} must return arrays with the batch ({b} rows) as leading dim, got shape "
                        f"{jnp.shape(x)}."
                    )
            return out

        self._step = CompiledStep(per_data_shard(predict_step, mesh), mesh, placement=_model_placement(mesh, specs),
                                  what="model", batch_args=(0,))
        self.mesh, self.specs = mesh, specs
        _named_like(pred_fn, self)

    def __call__(self, model, batch, key, *, model_state=None):
        return self._step(model, batch, key, model_state)

    def lower(self, model, batch, key, *, model_state=None):
        return self._step.lower(model, batch, key, model_state)


@typechecked
def make_predict_step(pred_fn: Callable, mesh: Mesh, specs: Any, *, compute_dtype: Any = None) -> PredictStep:
    """Compiled prediction: ``(model, batch, key) -> preds``, with the model in
    inference mode and laid out by ``specs`` (moved there, with a warning,
    if it is not). Every array in ``preds`` has the batch as its leading dim
    (one row per example), which `predict` relies on. A batch of any size
    works (rows the ``data`` axis does not divide, such as a few
    environments' observations, are computed on every data shard).
    ``compute_dtype`` is as in `make_train_step`.

    **Example:**

    ```python
    def pred_fn(model, batch, key):
        return jnp.argmax(jax.vmap(model)(batch["x"]), -1)

    predict_step = redeqx.make_predict_step(pred_fn, mesh, specs)
    preds = redeqx.predict(predict_step, state.model, test, collate_fn, 64, mesh, key=key)
    ```
    """
    mesh = _check_step_args(pred_fn, "pred_fn", "(model, batch, key)", "def pred_fn(model, batch, key): ...",
                            mesh, specs, compute_dtype)
    return PredictStep(pred_fn, mesh, specs, compute_dtype)
