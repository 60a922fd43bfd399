"""`evaluate` and `predict`: a compiled step over every example once, in
order, the last batch padded (its padding weighted 0, its outputs dropped).
On a mesh with a ``context`` axis the batches' ``seq_keys`` are split as
`batches` splits them, and `predict` puts the outputs named by
``seq_outputs`` back in the original token order (`restore_order`).

They sit above both the host pipeline (``_data.py``, which makes the
batches) and the steps (``_steps.py``, which make ``eval_step`` and
``predict_step``); neither of those imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .context import check_seq_keys, check_whole_keys, mesh_context, restore_order
from .data import DEFAULT_PREFETCH, every_example, fn_name, global_batch_size, local_rows, to_global, to_host
from .mesh import check_mesh
from .steps import EvalStep
from ._typing import typechecked, warn_user


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
    seq_keys: Sequence[str] | str | None = None,
    whole_keys: Sequence[str] | str | None = None,
) -> dict[str, float]:
    """The example-weighted mean of ``eval_step``'s metrics over every example
    (the last batch is padded and the padding gets weight 0). ``examples``
    (a sequence or a stream), ``desc``, ``prefetch``, ``seq_keys`` and
    ``whole_keys`` are as in `batches`; ``model_state`` is the model's ``eqx.nn.State``
    (``state.model_state``) for a model that has one.

    On a mesh with a ``context`` axis ``seq_keys`` is required: those keys'
    sequences are split over ``context`` in the dual-chunk order, exactly as
    `batches` splits them for training, and the metrics mean what they mean
    on one device as long as ``loss_fn`` does not depend on the tokens'
    order (a masked per-token mean, labels shifted in ``collate_fn``).

    **Example:**

    ```python
    metrics = redeqx.evaluate(eval_step, state.model, test, collate_fn, 64, mesh, key=key)
    print(metrics["loss"])
    metrics = redeqx.evaluate(eval_step, state.model, test, collate_fn, 1, context_mesh, key=key,
                              seq_keys=("input_ids", "labels", "attention_mask"))
    ```
    """
    if not isinstance(eval_step, EvalStep):
        raise TypeError(f"eval_step must come from redeqx.make_eval_step, got {type(eval_step).__name__}.")
    mesh = check_mesh(mesh)
    seq_keys = check_seq_keys(seq_keys, mesh, "redeqx.evaluate")
    whole_keys = check_whole_keys(whole_keys, seq_keys)
    size = global_batch_size(per_device_batch_size, mesh)
    totals, n = None, 0
    for i, (batch, n_real) in enumerate(every_example(examples, collate_fn, per_device_batch_size, mesh, desc,
                                                       prefetch, seq_keys, whole_keys)):
        weights = np.zeros(size, np.float32)
        weights[:n_real] = 1.0
        weights = to_global(weights[slice(*local_rows(mesh, size))], mesh, size)
        sums = eval_step.sums(model, batch, jax.random.fold_in(key, i), weights, model_state=model_state)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        n += n_real
    return {k: float(v) / n for k, v in jax.device_get(totals).items()}


# ----------------------------------------------------------------------------- predict: outputs in token order


def _check_seq_outputs(seq_outputs) -> bool | tuple[str, ...]:
    if isinstance(seq_outputs, bool):
        return seq_outputs
    return (seq_outputs,) if isinstance(seq_outputs, str) else tuple(seq_outputs)


def _named(preds, seq_outputs: bool | tuple[str, ...]) -> Callable:
    """Whether the output at a key path is one ``seq_outputs`` names."""
    if isinstance(seq_outputs, bool):
        return lambda kp: seq_outputs
    if seq_outputs and not isinstance(preds, dict):
        raise TypeError(f"seq_outputs={seq_outputs} names outputs of a dict, but pred_fn returned a "
                        f"{type(preds).__name__}: return a dict, or pass seq_outputs=True when every output is "
                        "per-token.")
    for name in seq_outputs:
        if name not in preds:
            raise KeyError(f"seq_outputs names {name!r}, which pred_fn's outputs lack; their keys are {sorted(preds)}.")
    return lambda kp: bool(kp) and getattr(kp[0], "key", None) in seq_outputs


def in_token_order(preds, seq_outputs: bool | tuple[str, ...], lengths: set[int], mesh: Mesh):
    """``preds`` (a batch of NumPy outputs) with dim 1 of the outputs that
    ``seq_outputs`` names put back in the original token order, and the
    paths of those it does not name whose dim 1 is one of ``lengths`` (the
    batch's ``seq_keys`` lengths) on a mesh that splits sequences: left in
    the split order, which `predict` warns about."""
    named, left = _named(preds, seq_outputs), []

    def one(kp, x):
        where = f"pred_fn's output{jax.tree_util.keystr(kp)}"
        if named(kp):
            if x.ndim < 2 or (lengths and x.shape[1] not in lengths):
                raise ValueError(
                    f"seq_outputs names {where}, of shape {x.shape} (batch first), which is not per-token: put back "
                    f"in order are outputs (batch, seq, ...) whose seq is that of seq_keys ({sorted(lengths)}). "
                    "Leave it out of seq_outputs."
                )
            return restore_order(x, mesh)
        if mesh_context(mesh) > 1 and x.ndim >= 2 and x.shape[1] in lengths:
            left.append(f"{where} {x.shape}")
        return x

    return jax.tree_util.tree_map_with_path(one, preds), left


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
    seq_keys: Sequence[str] | str | None = None,
    whole_keys: Sequence[str] | str | None = None,
    seq_outputs: bool | Sequence[str] | str = False,
) -> list:
    """One output per example, in the order of ``examples``, on every process.

    The last batch is padded up to full size and the padding's outputs are
    dropped. Without ``output_fn`` each output is the example's row of every
    array ``pred_fn`` returned (NumPy); with it, ``output_fn(preds)`` turns a
    batch of NumPy predictions into a list of per-example outputs (e.g.
    decoded text). ``examples`` (a sequence or a stream), ``desc``,
    ``prefetch``, ``seq_keys`` and ``whole_keys`` are as in `batches`;
    ``model_state`` is passed on to the step for a model with state.

    On a mesh with a ``context`` axis ``seq_keys`` is required (the batch is
    split as `batches` splits it), and the step's per-token outputs come in
    the split order. ``seq_outputs`` says which outputs are per-token, with
    dim 1 the sequence of ``seq_keys``: ``True`` for every array ``pred_fn``
    returns, or the keys of the dict it returns (``("logits",)``). Those are
    put back in the original token order (`restore_order`) before
    ``output_fn`` sees them, so no caller sees the split layout; any other
    output with such a dim 1 is returned as it is, with a warning. Without
    a ``context`` axis the order needs nothing, and ``seq_outputs`` is only
    checked. A ``pred_fn`` that generates (`redeqx.models.generate`) runs on
    a ``context`` mesh with the zoo's models (a split prefill, then decoding
    from the whole cache); a model of your own without that prefill is
    refused there (docs/guides/long_context.md, "Not split yet").

    **Example:**

    ```python
    labels = redeqx.predict(predict_step, state.model, test, collate_fn, 64, mesh, key=key)
    # pred_fn returns {"logits": (batch, seq, vocab), "score": (batch,)}
    preds = redeqx.predict(predict_step, state.model, test, collate_fn, 1, context_mesh, key=key,
                           seq_keys=("input_ids", "attention_mask"), seq_outputs=("logits",))
    ```
    """
    mesh = check_mesh(mesh)
    seq_keys = check_seq_keys(seq_keys, mesh, "redeqx.predict")
    whole_keys = check_whole_keys(whole_keys, seq_keys)
    seq_outputs = _check_seq_outputs(seq_outputs)
    made = every_example(examples, collate_fn, per_device_batch_size, mesh, desc, prefetch, seq_keys, whole_keys)
    outputs: list = []
    state_kw = {} if model_state is None else {"model_state": model_state}

    def drain(pending):
        preds, n_real, lengths = pending
        preds = jax.tree.map(lambda x: np.asarray(x)[:n_real], to_host(preds))
        preds, left = in_token_order(preds, seq_outputs, lengths, mesh)
        if left and not outputs:  # said once, at the first batch
            warn_user(f"redeqx.predict: {', '.join(left)}: dim 1 is the length of the sequences split over "
                      "'context', but seq_outputs does not name it, so it comes back as the step made it: in the "
                      "split order (redeqx.context_order) if it is per-token. Name it in seq_outputs to get the "
                      "original order.")  # past the type-checking wrapper
        if output_fn is not None:
            got = list(output_fn(preds))
            if len(got) != n_real:
                raise ValueError(f"output_fn {fn_name(output_fn)!r} returned {len(got)} outputs for {n_real} examples.")
            outputs.extend(got)
        else:
            outputs.extend(jax.tree.map(lambda x: x[j], preds) for j in range(n_real))

    pending = None
    for i, (batch, n_real) in enumerate(made):
        preds = predict_step(model, batch, jax.random.fold_in(key, i), **state_kw)
        if pending is not None:
            drain(pending)  # fetch the previous batch while this one computes
        pending = (preds, n_real, {batch[k].shape[1] for k in seq_keys})
    drain(pending)
    return outputs
