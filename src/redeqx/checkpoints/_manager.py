"""`CheckpointManager`: a run's checkpoints in ``workdir/checkpoints/step_<step>/``.

Four parts, each small: which checkpoints to keep (`retained`, a pure
function), the directory and what is on it (`CheckpointManager.steps`,
`latest`, `best`), the writer (one save in flight at a time, finished by
the next call, by `close`, or at exit), and resuming (`restore`, falling
back past unreadable checkpoints). The format of one checkpoint is
``_checkpoint.py``'s.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from jaxtyping import PyTree

from .. import _hooks
from . import _preemption
from ._checkpoint import (
    HASH,
    _all_processes,
    TMP_MARKER,
    CheckpointError,
    NewerFormatError,
    check_dtype,
    describe_failure,
    encode,
    metadata_file,
    orbax_layout,
    raw_metadata,
    read_metadata,
    remove_partial,
    restore_checkpoint,
    step_of,
    write,
    write_failed,
)
from ..data._grain import checkpointable, state_from_json, state_to_json
from .._json import as_number, dumps
from ..mesh._mesh import DATA
from ..mesh._spec_checks import refuse_deleted
from .._typing import positive_int, typechecked

_STEP_DIR = re.compile(r"^step_(\d+)$")
_DELETING = ".deleting"


# ----------------------------------------------------------------------------- retention


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


# ----------------------------------------------------------------------------- exit
# (`_hooks.finish_saves_on_exit` runs `finish_in_flight` at exit and on an uncaught exception)

# Managers with a save in flight, kept alive until it is written even if the caller drops them.
_IN_FLIGHT: set[CheckpointManager] = set()


def finish_in_flight(why: str) -> list[str]:
    """Waits for every save in flight; returns the failures, one line each."""
    failures = []
    for manager in list(_IN_FLIGHT):
        try:
            manager.wait()
        except Exception as e:
            failures.append(f"redeqx.CheckpointManager ({why}): {e}")
    return failures


# ----------------------------------------------------------------------------- the manager


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}.")
    return bool(value)



def _data_shards_of(state) -> int | None:
    """The ``data`` axis size of the mesh ``state`` lives on (what turns a
    batch index into a position in the data), if its arrays say."""
    for x in jax.tree.leaves(state):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if mesh is not None and DATA in getattr(mesh, "axis_names", ()):
            return int(mesh.shape[DATA])
    return None


def _warn_moved_position(meta: dict, mesh: Mesh, path: Path, per_device_batch_size: int | None) -> None:
    """A mid-epoch position is a batch index, and a batch is
    ``per_device_batch_size * data`` examples: with another global batch,
    ``batches(..., start=batch)`` starts at another example. When both runs
    said their ``per_device_batch_size`` the global batches are compared (a
    scaled one that keeps the global batch is quiet); otherwise only the
    ``data`` sizes can be, and the warning says what it could not check."""
    batch, saved, now = meta.get("batch", 0), meta.get("data_shards"), mesh.shape[DATA]
    saved_pdbs = meta.get("per_device_batch_size")
    if not batch or saved is None:
        return
    if saved_pdbs is not None and per_device_batch_size is not None:
        before, after = saved_pdbs * saved, per_device_batch_size * now
        if before == after:
            return
        first = batch * before
        exact = f"batches(..., start={first // after})" if first % after == 0 else "no start (it falls mid-batch)"
        warnings.warn(
            f"redeqx.CheckpointManager: {path.name} was saved mid-epoch (next batch {batch}) with a global batch of "
            f"{before} examples (per_device_batch_size={saved_pdbs} x data={saved}); here it is {after} "
            f"(per_device_batch_size={per_device_batch_size} x data={now}), so batches(..., start={batch}) would "
            f"start at example {batch * after}, not {first}, skipping or repeating examples of this epoch. "
            f"Example {first} starts {exact}; or keep the global batch ({before}), or restart the epoch (start=0).",
            stacklevel=3,
        )
        return
    if saved != now:
        warnings.warn(
            f"redeqx.CheckpointManager: {path.name} was saved mid-epoch (next batch {batch}) on a mesh with "
            f"data={saved}, and this mesh has data={now}: with the same per_device_batch_size a batch is "
            f"{now}/{saved} as many examples, so batches(..., start={batch}) would skip or repeat examples "
            "of this epoch. Resume on the same data size to finish the epoch, scale per_device_batch_size by "
            f"{saved}/{now}, or restart the epoch (start=0). (Pass per_device_batch_size= to save() and restore() "
            "and this is checked exactly, quiet when the global batch is the same.)",
            stacklevel=3,
        )


DATA_ITERATOR = "data_iterator"  # the metadata entry: one saved position per process, in process order


def _restore_position(data_iterator, meta: dict, path: Path) -> None:
    """Sets ``data_iterator`` to this process's position saved in ``meta``."""
    saved = meta.get(DATA_ITERATOR)
    if saved is None:
        raise ValueError(
            f"restore(..., data_iterator=...): {path.name} holds no data iterator position (it was saved without "
            "save(..., data_iterator=...)). Restore without data_iterator= and start the data where you choose."
        )
    if len(saved) != jax.process_count():
        raise ValueError(
            f"restore(..., data_iterator=...): {path.name} holds the data positions of {len(saved)} processes, and "
            f"this run has {jax.process_count()}: each process's Grain pipeline read its own share of the data, so "
            f"the positions do not carry over. Resume on {len(saved)} processes, or restore without data_iterator= "
            "and start the data again."
        )
    data_iterator.set_state(state_from_json(saved[jax.process_index()]))


def _shown(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps[:5])) + (f" ... {steps[-1]}" if len(steps) > 5 else "")


class CheckpointManager:
    """A run's checkpoints in ``workdir/checkpoints/step_<step>/``: which to
    write, which to keep, and which to restore.

    - ``every=k``, ``unit="step"``: `save` writes when ``state.step`` is a
      multiple of ``k``; ``unit="epoch"``: when ``epoch`` (the epoch to resume
      at, so ``epoch + 1`` after finishing epoch ``epoch``) is. A save whose
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
    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        keep_last: int = 1,
        every: int = 1,
        unit: Literal["step", "epoch"] = "step",
        best: Mapping[str, Literal["max", "min"]] | None = None,
        async_save: bool = True,
        dtype=None,
        overwrite: bool = False,
        allow_nonfinite: bool = False,
    ):
        self.keep_last = positive_int(keep_last, "keep_last")
        self.every = positive_int(every, "every")
        if unit not in ("step", "epoch"):
            raise ValueError(f"unit must be 'step' or 'epoch', got {unit!r}.")
        self.unit = unit
        best = dict(best or {})
        for name, mode in best.items():
            if mode not in ("max", "min"):
                raise ValueError(f"best[{name!r}] must be 'max' or 'min', got {mode!r}: e.g. best={{'accuracy': 'max'}}.")
        self.best_modes = best
        self.dtype = check_dtype(dtype)
        self.allow_nonfinite = _check_flag("allow_nonfinite", allow_nonfinite)
        overwrite = _check_flag("overwrite", overwrite)
        async_save = _check_flag("async_save", async_save)
        self.workdir = Path(workdir).absolute()  # orbax refuses relative paths
        self.directory = self.workdir / "checkpoints"
        if metadata_file(self.workdir).exists():
            raise CheckpointError(
                f"CheckpointManager: {self.workdir} is one checkpoint, not a run's workdir: give the directory that "
                f"holds checkpoints/ ({self.workdir.parent.parent}), or read this one with redeqx.restore_checkpoint."
            )
        if (kind := orbax_layout(self.workdir)) is not None:
            raise CheckpointError(
                f"CheckpointManager: {self.workdir} is {kind}, not a redeqx workdir; restoring from it would find "
                "nothing and start from scratch. Give the directory of a redeqx run (it holds checkpoints/step_*), "
                "or a new one."
            )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"cannot create the checkpoint directory {self.directory}: {describe_failure(e)}."
            ) from e
        strangers = sorted(p.name for p in self.directory.iterdir()
                           if not (_STEP_DIR.match(p.name) or TMP_MARKER in p.name or p.name.endswith(_DELETING)
                                   or p.name.startswith(".")))
        if strangers:
            raise CheckpointError(
                f"CheckpointManager: {self.directory} holds {', '.join(strangers[:5])}, which redeqx did not write "
                "(its checkpoints are named step_<step>): give the workdir of a redeqx run, or a new one."
            )
        self._pending: Path | None = None
        self._meta: dict[str, dict | None] = {}
        self._lock = threading.Lock()
        self._calls = 0  # save() calls, the count every process agrees on for a preemption
        self._ours = overwrite  # whether the checkpoints on disk are this run's (set by restore or a first save)
        self._unreadable: set[str] = set()  # checkpoints `restore` skipped: never counted as kept, replaced when saved again
        self._clean_leftovers()
        if overwrite and jax.process_index() == 0 and (old := self.steps()):
            warnings.warn(f"redeqx.CheckpointManager(overwrite=True): deleting the checkpoints of steps "
                          f"{_shown(old)} in {self.directory}.", stacklevel=2)
            for s in old:
                self._delete(self.path(s))
        handler = ocp.CompositeCheckpointHandler()
        self._checkpointer = ocp.AsyncCheckpointer(handler) if async_save else ocp.Checkpointer(handler)
        self._watching = False  # listening for SIGTERM from the first save on: before it there is nothing to save
        _hooks.finish_saves_on_exit(finish_in_flight)  # at exit and on an uncaught exception

    # -- what is on disk

    def _clean_leftovers(self) -> None:
        """Removes unfinished saves and half-deleted checkpoints of earlier runs."""
        if jax.process_index() != 0:
            return
        for p in self.directory.iterdir():
            if TMP_MARKER in p.name or p.name.endswith(_DELETING):
                shutil.rmtree(p, ignore_errors=True)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first."""
        found = (_STEP_DIR.match(p.name) for p in self.directory.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is (or would be)."""
        return self.directory / f"step_{int(step):09d}"

    @property
    def latest(self) -> Path | None:
        """The newest complete checkpoint (not one `restore` found unreadable), or None."""
        steps = [s for s in self.steps() if self.path(s).name not in self._unreadable]
        return self.path(steps[-1]) if steps else None

    def _metadata(self, path: Path) -> dict | None:
        if path.name not in self._meta:
            try:
                self._meta[path.name] = raw_metadata(path)
            except CheckpointError:
                return None  # not cached: it may be a save still in flight
        return self._meta[path.name]

    def _metrics(self, paths: Sequence[Path]) -> dict[int, dict[str, float]]:
        """``{step: {metric: value}}`` of the tracked metrics, as numbers."""
        out = {}
        for p in paths:
            found = (self._metadata(p) or {}).get("metrics")
            found = found if isinstance(found, dict) else {}
            out[self._step(p)] = {k: v for k in self.best_modes if (v := as_number(found.get(k))) is not None}
        return out

    @staticmethod
    def _step(path: Path) -> int:
        return int(_STEP_DIR.match(path.name).group(1))

    def best(self, metric: str) -> Path | None:
        """The complete checkpoint with the best ``metric`` (per ``best=``), or None."""
        if metric not in self.best_modes:
            raise ValueError(f"metric {metric!r} is not tracked; this manager tracks best={self.best_modes}.")
        paths = [self.path(s) for s in self.steps()]
        top = ranked([self._step(p) for p in paths], self._metrics(paths), metric, self.best_modes[metric])
        return self.path(top[0]) if top else None

    # -- writing

    def _improves(self, metrics: Mapping[str, Any]) -> bool:
        paths = [self.path(s) for s in self.steps()] + ([self._pending] if self._pending else [])
        known = self._metrics(paths)
        for name, mode in self.best_modes.items():
            if metrics.get(name) is None:
                continue
            value = float(np.asarray(jax.device_get(metrics[name])))
            if not math.isfinite(value):
                continue
            top = ranked(list(known), known, name, mode)
            if not top:
                return True
            if (value > known[top[0]][name]) if mode == "max" else (value < known[top[0]][name]):
                return True
        return False

    def _check_ours(self) -> None:
        """A first save into checkpoints of another run would mix two runs:
        `restore` would hand back the other run's newest, and pruning would
        delete this run's as older."""
        if self._ours:
            return
        others = self.steps()
        if others:
            raise CheckpointError(
                f"CheckpointManager: {self.directory} already holds checkpoints (steps {_shown(others)}) that this "
                "manager did not restore from, so this would be a second run in the same workdir. Call "
                "manager.restore(state, mesh, specs) first to go on from them, give another workdir, or pass "
                "CheckpointManager(..., overwrite=True) to delete them."
            )
        self._ours = True

    def save(
        self,
        state: PyTree,
        *,
        epoch: int = 0,
        batch: int = 0,
        data_key=None,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        step: int | None = None,
        force: bool = False,
        per_device_batch_size: int | None = None,
        data_iterator=None,
    ) -> bool:
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
        refuse_deleted(state, "state")
        if step is None:
            step = step_of(state)
            if step is None:
                raise ValueError(
                    "save(state) needs step= here: only a TrainState (or a tree of TrainStates at one step) "
                    "carries its own step."
                )
        step = positive_int(step, "step", minimum=0)
        epoch = positive_int(epoch, "epoch", minimum=0)
        batch = positive_int(batch, "batch", minimum=0)
        metrics = dict(metrics or {})
        force = _check_flag("force", force)
        if data_iterator is not None:
            checkpointable(data_iterator)
        if self._calls == 0:
            self._watching = _preemption.watch()
        self._calls += 1
        preempted = _preemption.reached(self._calls)
        counter = step if self.unit == "step" else epoch
        if not (force or preempted or counter % self.every == 0 or self._improves(metrics)):
            return False
        self._finish()
        self._check_ours()
        path = self.path(step)
        meta = {**dict(metadata or {}), "step": step, "epoch": epoch, "batch": batch, "metrics": metrics}
        if data_key is not None:
            meta["data_key"] = data_key
        if per_device_batch_size is not None:
            meta["per_device_batch_size"] = positive_int(per_device_batch_size, "per_device_batch_size")
        if (n_data := _data_shards_of(state)) is not None:
            meta["data_shards"] = n_data
        if data_iterator is not None:  # each process's position, from every process (a collective: all save here)
            meta[DATA_ITERATOR] = [p[0] for p in _all_processes([state_to_json(data_iterator.get_state())])]
        encoded = encode(state, meta, self.dtype)
        if encoded.non_finite and not self.allow_nonfinite:
            shown = ", ".join(encoded.non_finite[:5]) + (" ..." if len(encoded.non_finite) > 5 else "")
            kept = f"the last good checkpoint, {self.latest.name}," if self.latest else "no checkpoint of it"
            raise FloatingPointError(
                f"CheckpointManager.save: the state at step {step} holds NaN or inf ({shown}): training diverged. "
                f"It was not saved, so {kept} stays what restore() finds. "
                "Lower the learning rate, clip gradients (optax.clip_by_global_norm), or skip bad updates "
                "(optax.apply_if_finite); CheckpointManager(..., allow_nonfinite=True) saves such a state anyway."
            )
        if path.name in self._unreadable and path.exists():
            self._replace_unreadable(path)
        if path.exists():
            self._record(path, encoded.metadata)
        else:
            with self._lock:
                write(self._checkpointer, path, encoded.args)
                self._meta[path.name] = encoded.metadata
                self._pending = path
                _IN_FLIGHT.add(self)
            if not isinstance(self._checkpointer, ocp.AsyncCheckpointer):
                self._finish()
        if preempted:
            self._finish()
            if jax.process_index() == 0:
                print(f"redeqx: preempted (SIGTERM): saved step {step} to {path}; exiting with status "
                      f"{_preemption.PREEMPTED_EXIT_CODE}.", file=sys.stderr, flush=True)
            raise _preemption.Preempted(path, step)
        return True

    def _replace_unreadable(self, path: Path) -> None:
        """The run reached again the step of a checkpoint `restore` skipped as
        unreadable: delete it, so the state at hand is written in full (not
        just its metadata beside the damaged arrays)."""
        if jax.process_index() == 0:
            warnings.warn(f"redeqx.CheckpointManager: replacing {path}, which restore() skipped as unreadable, "
                          "with the state saved now.", stacklevel=3)
            self._delete(path)
        if jax.process_count() > 1:  # nobody writes the new one before the old one is gone
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"redeqx replace {path.name}")
        self._unreadable.discard(path.name)
        self._meta.pop(path.name, None)

    def _record(self, path: Path, meta: dict) -> None:
        """``path`` (a complete checkpoint of this step) gets ``meta``: the
        arrays must be the ones on disk; the position and metrics are the
        newer call's."""
        old = self._metadata(path)
        if old is None:
            raise CheckpointError(f"{path} exists but its metadata cannot be read; delete it to save step "
                                  f"{meta['step']} again.")
        def same_arrays(new, saved) -> bool:
            """The word sums agree, and so do the content hashes (which an
            older checkpoint does not have)."""
            a, b = new["redeqx"]["leaves"], saved["redeqx"]["leaves"]
            if {i: set(leaves) for i, leaves in a.items()} != {i: set(leaves) for i, leaves in b.items()}:
                return False
            for item, leaves in a.items():
                for name, x in leaves.items():
                    y = b[item][name]
                    if x["checksum"] != y["checksum"]:
                        return False
                    hx, hy = x.get(HASH), y.get(HASH)
                    if hx and hy and hx != hy:
                        return False
            return True

        if not same_arrays(meta, old):
            raise CheckpointError(
                f"step {meta['step']} is already saved in {path} with other arrays than this state's: one step "
                "number, two states. Save each state at its own step (state.step counts optimizer updates). If "
                f"{path.name} is damaged, restore() skips it and the next save of step {meta['step']} replaces it."
            )
        if jax.process_index() == 0:
            file = metadata_file(path)
            tmp = file.with_name(file.name + ".redeqx-tmp")
            try:
                tmp.write_text(dumps(meta, "metadata"))
                os.replace(tmp, file)  # atomic: the checkpoint is complete before and after
            except OSError as e:
                raise CheckpointError(f"could not record the metrics of step {meta['step']} in {file}: "
                                      f"{describe_failure(e)}; the checkpoint itself is intact.") from e
        self._meta[path.name] = meta
        self._prune()

    def _finish(self) -> None:
        """Waits for the save in flight, then deletes what is no longer kept."""
        with self._lock:
            pending, self._pending = self._pending, None
            _IN_FLIGHT.discard(self)
            if pending is None:
                return
            try:
                if isinstance(self._checkpointer, ocp.AsyncCheckpointer):
                    self._checkpointer.wait_until_finished()
            except Exception as e:
                self._meta.pop(pending.name, None)
                remove_partial(pending)
                raise write_failed(pending, e) from e
            self._prune()  # only after a save of ours is complete

    def _delete(self, path: Path) -> None:
        doomed = path.with_name(path.name + _DELETING)  # renamed first: a half-deleted one must never look complete
        try:
            os.rename(path, doomed)
        except OSError as e:
            warnings.warn(f"redeqx.CheckpointManager: could not delete {path}: {describe_failure(e)}.", stacklevel=3)
            return
        shutil.rmtree(doomed, ignore_errors=True)
        self._meta.pop(path.name, None)

    def _prune(self) -> None:
        if jax.process_index() != 0:
            return
        # checkpoints whose metadata cannot be read, or that restore() found unreadable, are neither counted
        # (a damaged newest one must not push the last good one out) nor deleted (a save of that step replaces it)
        paths = [p for p in (self.path(s) for s in self.steps())
                 if p.name not in self._unreadable and self._metadata(p) is not None]
        keep = retained([self._step(p) for p in paths], self._metrics(paths), keep_last=self.keep_last,
                        best=self.best_modes)
        for p in paths:
            if self._step(p) not in keep:
                self._delete(p)

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; raises a
        `CheckpointError` if it failed."""
        self._finish()

    def _check_open(self) -> None:
        if self._checkpointer is None:
            raise CheckpointError(f"this CheckpointManager of {self.workdir} is closed; make a new one.")

    def close(self) -> None:
        """Wait for the save in flight (raising if it failed), release the
        writer and stop listening for preemptions. Call it at the end of the
        script, or use the manager in a ``with`` statement."""
        if self._checkpointer is None:
            return
        try:
            self._finish()
        finally:
            self._checkpointer.close()
            self._checkpointer = None
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
        if self._checkpointer is not None:
            self._finish()
        self._ours = True
        if best is None:
            candidates = [self.path(s) for s in reversed(self.steps())]
        else:
            if best not in self.best_modes:
                raise ValueError(f"best={best!r} is not tracked; this manager tracks best={self.best_modes}.")
            steps = self.steps()
            candidates = [self.path(s) for s in ranked(steps, self._metrics([self.path(s) for s in steps]), best,
                                                       self.best_modes[best])]
        failures = []
        for path in candidates:
            try:
                state = restore_checkpoint(path, like, mesh, specs)
                meta = read_metadata(path)
                _warn_moved_position(meta, mesh, path, per_device_batch_size)
                if data_iterator is not None:
                    _restore_position(data_iterator, meta, path)
                return state, meta
            except NewerFormatError:
                raise
            except CheckpointError as e:
                failures.append(str(e))
                self._unreadable.add(path.name)
                warnings.warn(f"redeqx.CheckpointManager: skipping {path}: {e}", stacklevel=2)
        if failures:
            raise CheckpointError(f"no readable checkpoint in {self.directory}:\n" + "\n".join(failures))
        return None
