"""`evaluate` and `predict`: a compiled step over every example once, in
order, the last batch padded (its padding weighted 0, its outputs dropped).

They sit above both the host pipeline (``_data.py``, which makes the
batches) and the steps (``_steps.py``, which make ``eval_step`` and
``predict_step``); neither of those imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ._data import DEFAULT_PREFETCH, _every_example, _fn_name, _global_batch_size, local_rows, to_global, to_host
from ._mesh import check_mesh
from ._steps import EvalStep
from ._typing import typechecked


@typechecked
def evaluate(
    eval_step: EvalStep,
    model,
    examples: Any,
    collate_fn: Callable,
    per_device_batch_size: int,
    mesh: Mesh,
    *,
    key,
    desc: str | None = None,
    prefetch: int = DEFAULT_PREFETCH,
    model_state=None,
) -> dict[str, float]:
    """The example-weighted mean of ``eval_step``'s metrics over every example
    (the last batch is padded and the padding gets weight 0). ``examples``
    (a sequence or a stream), ``desc`` and ``prefetch`` are as in `batches`;
    ``model_state`` is the model's ``eqx.nn.State`` (``state.model_state``)
    for a model that has one.

    **Example:**

    ```python
    metrics = redeqx.evaluate(eval_step, state.model, test, collate_fn, 64, mesh, key=key)
    print(metrics["loss"])
    ```
    """
    if not isinstance(eval_step, EvalStep):
        raise TypeError(f"eval_step must come from redeqx.make_eval_step, got {type(eval_step).__name__}.")
    mesh = check_mesh(mesh)
    size = _global_batch_size(per_device_batch_size, mesh)
    totals, n = None, 0
    for i, (batch, n_real) in enumerate(_every_example(examples, collate_fn, per_device_batch_size, mesh, desc,
                                                       prefetch)):
        weights = np.zeros(size, np.float32)
        weights[:n_real] = 1.0
        weights = to_global(weights[slice(*local_rows(mesh, size))], mesh, size)
        sums = eval_step.sums(model, batch, jax.random.fold_in(key, i), weights, model_state=model_state)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        n += n_real
    return {k: float(v) / n for k, v in jax.device_get(totals).items()}



@typechecked
def predict(
    predict_step: Callable,
    model,
    examples: Any,
    collate_fn: Callable,
    per_device_batch_size: int,
    mesh: Mesh,
    *,
    key,
    output_fn: Callable | None = None,
    desc: str | None = None,
    prefetch: int = DEFAULT_PREFETCH,
    model_state=None,
) -> list:
    """One output per example, in the order of ``examples``, on every process.

    The last batch is padded up to full size and the padding's outputs are
    dropped. Without ``output_fn`` each output is the example's row of every
    array ``pred_fn`` returned (NumPy); with it, ``output_fn(preds)`` turns a
    batch of NumPy predictions into a list of per-example outputs (e.g.
    decoded text). ``examples`` (a sequence or a stream), ``desc`` and
    ``prefetch`` are as in `batches`; ``model_state`` is passed on to the
    step for a model with state.

    **Example:**

    ```python
    labels = redeqx.predict(predict_step, state.model, test, collate_fn, 64, mesh, key=key)
    ```
    """
    mesh = check_mesh(mesh)
    made = _every_example(examples, collate_fn, per_device_batch_size, mesh, desc, prefetch)
    outputs: list = []
    state_kw = {} if model_state is None else {"model_state": model_state}

    def drain(pending):
        preds, n_real = pending
        preds = jax.tree.map(lambda x: np.asarray(x)[:n_real], to_host(preds))
        if output_fn is not None:
            got = list(output_fn(preds))
            if len(got) != n_real:
                raise ValueError(f"output_fn {_fn_name(output_fn)!r} returned {len(got)} outputs for {n_real} examples.")
            outputs.extend(got)
        else:
            outputs.extend(jax.tree.map(lambda x: x[j], preds) for j in range(n_real))

    pending = None
    for i, (batch, n_real) in enumerate(made):
        preds = predict_step(model, batch, jax.random.fold_in(key, i), **state_kw)
        if pending is not None:
            drain(pending)  # fetch the previous batch while this one computes
        pending = (preds, n_real)
    drain(pending)
    return outputs
