"""Retention as pure functions of steps and metrics (they read no disk):
whether a save is `due`, whether its metrics `improves` on a tracked best,
the steps `ranked` by a metric, and the steps a manager keeps (`retained`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal


def check_best(best: Mapping[str, str] | None) -> dict[str, Literal["max", "min"]]:
    """``best`` as a dict, each mode ``"max"`` or ``"min"``, or a ValueError naming the metric."""
    best = dict(best or {})
    for name, mode in best.items():
        if mode not in ("max", "min"):
            raise ValueError(f"best[{name!r}] must be 'max' or 'min', got {mode!r}: e.g. best={{'accuracy': 'max'}}.")
    return best


def check_unit(unit: str) -> Literal["step", "epoch"]:
    if unit not in ("step", "epoch"):
        raise ValueError(f"unit must be 'step' or 'epoch', got {unit!r}.")
    return unit


def due(step: int, epoch: int, *, every: int, unit: Literal["step", "epoch"], batch: int = 0) -> bool:
    """Whether ``every`` asks for a save now: ``unit="step"`` when ``step``
    is a multiple of ``every``, ``unit="epoch"`` at an epoch's start
    (``batch`` 0: the position to resume at) when ``epoch`` (the epoch to
    resume at) is. A loop that saves mid-epoch too (for preemption) calls
    ``save`` with ``batch > 0`` there: not due.

    **Example:**

    ```python
    due(300, 1, every=100, unit="step")            # True
    due(300, 2, every=2, unit="epoch")             # True
    due(310, 2, every=2, unit="epoch", batch=10)   # False
    ```
    """
    if check_unit(unit) == "step":
        return step % every == 0
    return batch == 0 and epoch % every == 0


def ranked(steps: Sequence[int], metrics: Mapping[int, Mapping[str, float]], name: str,
           mode: Literal["max", "min"]) -> list[int]:
    """``steps`` holding a finite ``name``, best first (``mode="max"``: highest);
    among equal values the older step first."""
    scored = [(v, s) for s in sorted(steps)
              if (v := metrics.get(s, {}).get(name)) is not None and math.isfinite(v)]
    scored.sort(key=lambda vs: vs[0], reverse=mode == "max")  # stable: ties stay oldest first
    return [s for _, s in scored]


def retained(steps: Sequence[int], metrics: Mapping[int, Mapping[str, float]], *, keep_last: int,
             best: Mapping[str, Literal["max", "min"]]) -> set[int]:
    """The steps a manager keeps: the ``keep_last`` newest, and for each metric
    of ``best`` the step with its best finite value. A NaN or inf metric never
    counts as best. Pure: it reads no disk.

    **Example:**

    ```python
    retained([1, 2, 3, 4], {2: {"acc": 0.9}, 4: {"acc": float("nan")}}, keep_last=1, best={"acc": "max"})
    # {2, 4}
    ```
    """
    keep = set(sorted(steps)[-keep_last:]) if keep_last > 0 else set()
    for name, mode in best.items():
        keep.update(ranked(steps, metrics, name, mode)[:1])
    return keep


def improves(values: Mapping[str, float], metrics: Mapping[int, Mapping[str, float]],
             best: Mapping[str, Literal["max", "min"]]) -> bool:
    """Whether ``values`` (a save's metrics) beat, for some metric of
    ``best``, the best finite value among ``metrics`` (``{step: {name:
    value}}``, the checkpoints on disk), or one no checkpoint has a finite
    value of yet. A NaN or inf value never improves.

    **Example:**

    ```python
    improves({"acc": 0.8}, {1: {"acc": 0.9}}, {"acc": "max"})   # False
    improves({"acc": 0.8}, {1: {"acc": 0.9}}, {"acc": "min"})   # True
    ```
    """
    for name, mode in best.items():
        value = values.get(name)
        if value is None or not math.isfinite(value):
            continue
        top = ranked(list(metrics), metrics, name, mode)
        if not top:
            return True
        if (value > metrics[top[0]][name]) if mode == "max" else (value < metrics[top[0]][name]):
            return True
    return False
