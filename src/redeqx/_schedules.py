"""Learning-rate schedules whose length comes from the data."""

from __future__ import annotations

from typing import Literal

import optax
from jax.sharding import Mesh

from ._mesh import DATA
from ._steps import _check_positive_int
from ._typing import typechecked


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
) -> optax.Schedule:
    """Warm-up from ``init_learning_rate`` to ``learning_rate``, then linear or
    cosine decay to ``end_learning_rate`` at the last step.

    The number of optimizer steps is ``n_epochs * (train_size // rows per
    step)``, where one step takes ``per_device_batch_size * accumulate * data``
    examples (the short last batch of an epoch is dropped, as `batches` does
    when shuffling). Warm-up lasts ``warmup_steps``, or ``warmup_ratio`` of
    all steps.

    **Example:**

    ```python
    schedule = redeqx.lr_schedule(len(train), 32, n_epochs=3, learning_rate=1e-3, mesh=mesh,
                                  schedule_type="cosine", warmup_ratio=0.1)
    optimizer = optax.adamw(schedule)
    ```
    """
    for name, v in (("train_size", train_size), ("per_device_batch_size", per_device_batch_size),
                    ("n_epochs", n_epochs), ("accumulate", accumulate)):
        _check_positive_int(name, v)
    if schedule_type not in ("linear", "cosine"):
        raise ValueError(f"schedule_type must be 'linear' or 'cosine', got {schedule_type!r}.")
    per_step = per_device_batch_size * accumulate * mesh.shape[DATA]
    steps_per_epoch = train_size // per_step
    if steps_per_epoch == 0:
        raise ValueError(
            f"train_size={train_size} is smaller than one step's {per_step} examples (per_device_batch_size="
            f"{per_device_batch_size} x accumulate={accumulate} x data={mesh.shape[DATA]}); no step would run."
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
