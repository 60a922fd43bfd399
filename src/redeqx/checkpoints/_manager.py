"""`CheckpointManager`: a run's checkpoints in ``workdir/checkpoints/step_<step>/``.

Its parts live beside it, each small: which checkpoints to write and keep
(``_retention.py``, pure functions), the directory and what is on it
(``_directory.py``), the data position (``_position.py``), one checkpoint's
format, writing, reading and checks (``_format.py``, ``_save.py``,
``_restore.py``, ``_integrity.py``). The manager ties them together: one
save in flight at a time, finished by the next call, by `close`, or at
exit; resuming (`restore`), falling back past unreadable checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import PyTree

from .. import _hooks, _startup
from .._json import checkpointable
from ..mesh import refuse_deleted
from .._typing import positive_int, typechecked
from . import _preemption
from ._directory import RunDirectory
from ._format import CheckpointError, step_of
from ._integrity import read_metadata
from ._position import position, restore_position, warn_moved_position
from ._restore import restore_checkpoint
from ._retention import check_best, check_unit, due, improves
from ._save import Encoded, check_dtype, encode
from ._writer import Writer, finish_in_flight

# ----------------------------------------------------------------------------- checks and refusals


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}.")
    return bool(value)


def _step_to_save(state, step: int | None) -> int:
    refuse_deleted(state, "state")
    if step is None:
        step = step_of(state)
        if step is None:
            raise ValueError(
                "save(state) needs step= here: only a TrainState (or a tree of TrainStates at one step) "
                "carries its own step."
            )
    return positive_int(step, "step", minimum=0)


def _diverged(step: int, non_finite: list[str], latest: Path | None) -> FloatingPointError:
    shown_leaves = ", ".join(non_finite[:5]) + (" ..." if len(non_finite) > 5 else "")
    kept = f"the last good checkpoint, {latest.name}," if latest else "no checkpoint of it"
    return FloatingPointError(
        f"CheckpointManager.save: the state at step {step} holds NaN or inf ({shown_leaves}): training diverged. "
        f"It was not saved, so {kept} stays what restore() finds. "
        "Lower the learning rate, clip gradients (optax.clip_by_global_norm), or skip bad updates "
        "(optax.apply_if_finite); CheckpointManager(..., allow_nonfinite=True) saves such a state anyway."
    )


# ----------------------------------------------------------------------------- the manager


class CheckpointManager:
    """A run's checkpoints in ``workdir/checkpoints/step_<step>/``: which to
    write, which to keep, and which to restore.

    - ``every=k``, ``unit="step"``: `save` writes when ``state.step`` is a
      multiple of ``k``; ``unit="epoch"``: when ``epoch`` (the epoch to resume
      at, so ``epoch + 1`` after finishing epoch ``epoch``) is, at its start
      (``batch=0``; a save mid-epoch, with ``batch > 0``, is not due). A save whose
      metrics beat a tracked best, with ``force=True``, or at a preemption
      always writes.
    - ``keep_last=n`` keeps the ``n`` newest; ``best={"accuracy": "max",
      "loss": "min"}`` also keeps the best checkpoint by each metric (read
      from the ``metrics`` given to `save`; NaN and inf never count as best).
      Others are deleted after a newer save has completed (`retained`).
    - ``async_save=True`` (default): `save` returns once the arrays are copied
      off the devices and writes them in a background thread, overlapping the
      next training steps. The next `save`, `wait`, `restore` or `close` waits
      for it, and raises if it failed. **Call `close` (or use ``with``) at the
      end:** Python stops the writer's threads when the interpreter exits, so
      a save still in flight then is lost; redeqx finishes it when the script
      ends with an uncaught exception, and otherwise prints what was lost and
      exits with status 1.
    - Atomic: a checkpoint directory appears only when complete (orbax writes
      to a temporary directory and renames it), so a run killed at any moment,
      even with SIGKILL, never leaves a half checkpoint that `latest` or
      `best` would pick; leftovers are removed when the next manager starts.
      `restore` skips a checkpoint that is unreadable (truncated, corrupted)
      with a warning naming it, and falls back to the previous one; the
      skipped one never counts towards ``keep_last`` (so the last good one is
      not pruned for it), and a later save of its step replaces it whole.
    - Preemption: from its first `save` to `close`, the manager listens for
      the SIGTERM a scheduler sends before killing a job (with several
      processes, JAX's preemption service does, and every process agrees on
      the call to stop at). The next `save` call writes a checkpoint whatever
      ``every`` says, waits for it, and raises `Preempted`, which exits with
      status 143. Call `save` every step (it returns at once when not due).
    - Divergence: a state holding NaN or inf is not saved (a
      ``FloatingPointError`` naming the step and the leaves), so the last good
      checkpoint stays the one `restore` picks; ``allow_nonfinite=True``
      saves it anyway.
    - One run per workdir: a manager over checkpoints it did not write refuses
      to save until `restore` was called (the run goes on from them), unless
      ``overwrite=True``, which deletes them. A directory of another tool
      (an orbax `CheckpointManager`'s) is refused.
    - A step saved twice (a periodic save on an epoch's last step, then the
      epoch's ``force=True`` save with its metrics) is written once; the
      second call records its metrics and position in the same checkpoint.

    `save` keeps the data position for an exact resume: ``epoch`` and
    ``batch`` (the next batch to run, as ``batches(..., start=batch)``) and
    ``data_key`` (the key the epoch's shuffle order came from), with the
    mesh's ``data`` size: `restore` warns when a mid-epoch position is
    resumed on another ``data`` size, where the same batch index is another
    example.

    **Example:**

    ```python
    with redeqx.CheckpointManager("runs/mnist", keep_last=1, best={"accuracy": "max"}) as manager:
        found = manager.restore(state, mesh, specs)      # None on a fresh run
        if found is not None:
            state, meta = found                          # meta["epoch"], meta["batch"], ...
        ...
        manager.save(state, epoch=epoch + 1, metrics={"accuracy": acc})
    ```
    """

    @typechecked
    def __init__(self, workdir: str | os.PathLike, *, keep_last: int = 1, every: int = 1,
                 unit: Literal["step", "epoch"] = "step", best: Mapping[str, Literal["max", "min"]] | None = None,
                 async_save: bool = True, dtype=None, overwrite: bool = False, allow_nonfinite: bool = False):
        self.keep_last = positive_int(keep_last, "keep_last")
        self.every = positive_int(every, "every")
        self.unit = check_unit(unit)
        self.best_modes = check_best(best)
        self.dtype = check_dtype(dtype)
        self.allow_nonfinite = _check_flag("allow_nonfinite", allow_nonfinite)
        overwrite = _check_flag("overwrite", overwrite)
        async_save = _check_flag("async_save", async_save)
        self.workdir = Path(workdir).absolute()  # orbax refuses relative paths
        self._disk = RunDirectory(self.workdir, overwrite)
        self.directory = self._disk.directory
        self._calls = 0  # save() calls, the count every process agrees on for a preemption
        self._writer: Writer | None = Writer(self._disk, async_save, done=self._prune)
        self._watching = False  # listening for SIGTERM from the first save on: before it there is nothing to save
        _hooks.finish_saves_on_exit(finish_in_flight)  # at exit and on an uncaught exception

    # -- what is on disk

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first."""
        return self._disk.steps()

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is (or would be)."""
        return self._disk.path(step)

    @property
    def latest(self) -> Path | None:
        """The newest complete checkpoint (not one `restore` found unreadable), or None."""
        return self._disk.latest()

    def best(self, metric: str) -> Path | None:
        """The complete checkpoint with the best ``metric`` (per ``best=``), or None."""
        if metric not in self.best_modes:
            raise ValueError(f"metric {metric!r} is not tracked; this manager tracks best={self.best_modes}.")
        top = self._disk.ranked(metric, self.best_modes)
        return self.path(top[0]) if top else None

    # -- writing

    def save(self, state: PyTree, *, epoch: int = 0, batch: int = 0, data_key=None,
             metrics: Mapping[str, Any] | None = None, metadata: Mapping[str, Any] | None = None,
             step: int | None = None, force: bool = False, per_device_batch_size: int | None = None,
             data_iterator=None) -> bool:
        """Save ``state`` if due (see the class docstring); returns whether it
        wrote (or, for a step already saved, recorded) a checkpoint.

        ``epoch``/``batch``/``data_key`` are where to resume the data (the next
        batch to run), ``metrics`` what to rank by, ``metadata`` anything else
        JSON-able. ``step`` defaults to ``state.step`` (give it for a bare model).
        ``per_device_batch_size`` (the one `batches` used) lets `restore`
        check a mid-epoch ``batch`` exactly on another mesh.
        ``data_iterator`` (a `grain_batches` iterator, or any iterator with
        ``get_state()``, a Grain one included) has its position saved in the
        checkpoint, every process's own, for ``restore(...,
        data_iterator=)``.

        At a preemption (SIGTERM) it saves whatever ``every`` says, waits for
        the write, and raises `Preempted` (exit status 143). A state holding
        NaN or inf raises ``FloatingPointError`` (unless ``allow_nonfinite``),
        a write that fails a `CheckpointError`: nothing is skipped silently.
        """
        self._check_open()
        step = _step_to_save(state, step)
        epoch, batch = positive_int(epoch, "epoch", minimum=0), positive_int(batch, "batch", minimum=0)
        metrics, force = dict(metrics or {}), _check_flag("force", force)
        if data_iterator is not None:
            checkpointable(data_iterator)
        if self._calls == 0:
            self._watching = _preemption.watch()
        self._calls += 1
        preempted = _preemption.reached(self._calls)
        due_now = due(step, epoch, every=self.every, unit=self.unit, batch=batch)
        if not (force or preempted or due_now or self._improves(metrics)):
            return False
        self._writer.finish()
        self._disk.claim()
        self._disk.check_counts_up(step)
        where = position(state, epoch=epoch, batch=batch, data_key=data_key,
                         per_device_batch_size=per_device_batch_size, data_iterator=data_iterator)
        encoded = encode(state, {**dict(metadata or {}), "step": step, **where, "metrics": metrics}, self.dtype,
                         finite=not self.allow_nonfinite)
        if encoded.non_finite and not self.allow_nonfinite:
            raise _diverged(step, encoded.non_finite, self.latest)
        self._write(self.path(step), encoded)
        if preempted:
            self._writer.finish()
            self._disk.release()  # the run ends here: the next one may save at once
            _preemption.exit_saved(self.path(step), step)
        return True

    def _improves(self, metrics: Mapping[str, Any]) -> bool:
        """Whether ``metrics`` beat a tracked best among the checkpoints on disk and the one in flight."""
        values = {k: float(np.asarray(jax.device_get(v))) for k, v in metrics.items()
                  if k in self.best_modes and v is not None}
        paths = [self.path(s) for s in self.steps()] + ([self._writer.pending] if self._writer.pending else [])
        return improves(values, self._disk.metrics(paths, self.best_modes), self.best_modes)

    def _write(self, path: Path, encoded: Encoded) -> None:
        """Starts writing ``encoded`` to ``path``; for a step already saved, records its metadata there."""
        if path.name in self._disk.unreadable and path.exists():
            self._disk.replace_unreadable(path)
        if path.exists():
            self._disk.record(path, encoded.metadata)
            self._prune()
        else:
            self._writer.start(path, encoded)

    def _prune(self) -> None:
        self._disk.prune(self.keep_last, self.best_modes)

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; raises a
        `CheckpointError` if it failed."""
        if self._writer is not None:
            self._writer.finish()

    def _check_open(self) -> None:
        if self._writer is None:
            raise CheckpointError(f"this CheckpointManager of {self.workdir} is closed; make a new one.")

    def close(self) -> None:
        """Wait for the save in flight (raising if it failed), release the
        writer and stop listening for preemptions. Call it at the end of the
        script, or use the manager in a ``with`` statement."""
        if self._writer is None:
            return
        try:
            self._writer.finish()
        finally:
            self._writer.close()
            self._writer = None
            self._disk.release()
            if self._watching:
                _preemption.unwatch()
                self._watching = False

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading

    def restore(self, like: PyTree, mesh: Mesh, specs: PyTree = None, *, best: str | None = None,
                per_device_batch_size: int | None = None, data_iterator=None):
        """``(state, metadata)`` from the latest complete checkpoint (or the
        best by metric ``best``), or None if there is none yet. A checkpoint
        that cannot be read is skipped with a warning naming it and the next
        one (older, or next best) is tried. ``like``/``mesh``/``specs`` are as
        in `restore_checkpoint` (a model as ``like`` restores parameters only).
        After it, the manager's saves continue this run (see ``overwrite``).
        ``per_device_batch_size`` (this run's) checks a mid-epoch position
        against the one saved with it (see `save`). ``data_iterator`` (the
        one given to `save`, made again) is set to this process's saved
        position, so its next batch is the one after the checkpoint's.
        """
        if data_iterator is not None:
            checkpointable(data_iterator)
        if per_device_batch_size is not None:
            per_device_batch_size = positive_int(per_device_batch_size, "per_device_batch_size")
        if self._writer is not None:
            self._writer.finish()
        self._disk.ours = True
        if best is not None and best not in self.best_modes:
            raise ValueError(f"best={best!r} is not tracked; this manager tracks best={self.best_modes}.")

        def read(path: Path):
            _startup.doing(f"restoring the checkpoint {path}")
            state, meta = restore_checkpoint(path, like, mesh, specs), read_metadata(path)
            warn_moved_position(meta, mesh, path, per_device_batch_size)
            if data_iterator is not None:
                restore_position(data_iterator, meta, path)
            return state, meta

        steps = reversed(self.steps()) if best is None else self._disk.ranked(best, self.best_modes)
        return self._disk.first_readable(steps, read)
