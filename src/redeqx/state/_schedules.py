"""Learning-rate schedules whose length comes from the data."""

from __future__ import annotations

import math
from typing import Literal

import optax
from jax.sharding import Mesh

from ..mesh import DATA
from .._typing import positive_int, typechecked


@typechecked
def lr_schedule(
    train_size: int,
    per_device_batch_size: int,
    n_epochs: int,
    learning_rate: float,
    mesh: Mesh,
    *,
    schedule_type: Literal["linear", "cosine"] = "linear",
    warmup_ratio: float = 0.0,
    warmup_steps: int | None = None,
    init_learning_rate: float = 0.0,
    end_learning_rate: float = 0.0,
    accumulate: int = 1,
    drop_last: bool = True,
) -> optax.Schedule:
    """Warm-up from ``init_learning_rate`` to ``learning_rate``, then linear or
    cosine decay to ``end_learning_rate``, over exactly the optimizer steps of
    a training loop over `batches`.

    Give it the numbers you give `batches`: one step per batch, and a batch is
    ``per_device_batch_size * data`` examples (``data`` = the mesh's data axis
    size), so an epoch is ``train_size // (per_device_batch_size * data)``
    steps with ``drop_last=True`` (what `batches` does with
    ``shuffle=True``), or that rounded up with ``drop_last=False`` (the
    default of `batches` without shuffling), and the schedule lasts
    ``n_epochs`` of them. ``accumulate`` changes nothing here:
    ``make_train_step(..., accumulate=k)`` splits each batch into ``k``
    micro-batches inside one step. Pass it to have the batch size checked
    (``per_device_batch_size`` must be a multiple of it).

    Warm-up is part of those steps: it lasts ``warmup_steps``, or
    ``warmup_ratio`` of all steps. Like ``state.step``, the schedule counts
    updates done: ``schedule(k)`` is the rate of the update after ``k``
    updates, so it is ``learning_rate`` once warm-up is done and
    ``end_learning_rate`` once the last batch's step is done.

    **Example:**

    ```python
    schedule = redeqx.lr_schedule(len(train), 32, n_epochs=3, learning_rate=1e-3, mesh=mesh,
                                  schedule_type="cosine", warmup_ratio=0.1)
    optimizer = optax.adamw(schedule)
    ```
    """
    _check_arguments(train_size, per_device_batch_size, n_epochs, accumulate, learning_rate, init_learning_rate,
                     end_learning_rate, schedule_type)
    n_data = mesh.shape[DATA]
    per_step = per_device_batch_size * n_data
    steps_per_epoch = train_size // per_step if drop_last else math.ceil(train_size / per_step)
    if steps_per_epoch == 0:
        raise ValueError(
            f"train_size={train_size} is smaller than one step's {per_step} examples (per_device_batch_size="
            f"{per_device_batch_size} x data={n_data}), so with drop_last=True no step would run. Lower "
            "per_device_batch_size, or pass drop_last=False here and to batches."
        )
    total = n_epochs * steps_per_epoch
    if warmup_steps is None:
        if not 0.0 <= warmup_ratio <= 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1], got {warmup_ratio}.")
        warmup_steps = int(warmup_ratio * total)
    if not 0 <= warmup_steps <= total:
        raise ValueError(f"warmup_steps must be in [0, {total}] (the total step count), got {warmup_steps}.")
    decay_steps = total - warmup_steps
    if schedule_type == "linear":
        decay = optax.linear_schedule(learning_rate, end_learning_rate, max(decay_steps, 1))
    else:
        decay = optax.cosine_decay_schedule(
            learning_rate, max(decay_steps, 1), alpha=end_learning_rate / learning_rate if learning_rate else 0.0
        )
    warmup = optax.linear_schedule(init_learning_rate, learning_rate, max(warmup_steps, 1))
    if warmup_steps == 0:
        return decay
    return optax.join_schedules([warmup, decay], [warmup_steps])


def _check_arguments(train_size, per_device_batch_size, n_epochs, accumulate, learning_rate, init_learning_rate,
                     end_learning_rate, schedule_type) -> None:
    for name, v in (("train_size", train_size), ("per_device_batch_size", per_device_batch_size),
                    ("n_epochs", n_epochs), ("accumulate", accumulate)):
        positive_int(v, name)
    for name, v in (("learning_rate", learning_rate), ("init_learning_rate", init_learning_rate),
                    ("end_learning_rate", end_learning_rate)):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(
                f"{name} must be a finite rate >= 0, got {v}; optax's optimizers descend with a positive rate "
                "(to maximise an objective, negate it in loss_fn)."
            )
    if schedule_type not in ("linear", "cosine"):
        raise ValueError(f"schedule_type must be 'linear' or 'cosine', got {schedule_type!r}.")
    if per_device_batch_size % accumulate:
        raise ValueError(
            f"per_device_batch_size={per_device_batch_size} is not a multiple of accumulate={accumulate}: "
            f"make_train_step(..., accumulate={accumulate}) splits each data shard's {per_device_batch_size} rows "
            f"into {accumulate} micro-batches. per_device_batch_size is the rows of a whole step (what batches "
            f"yields), so use a multiple of {accumulate}, e.g. {per_device_batch_size * accumulate}."
        )
