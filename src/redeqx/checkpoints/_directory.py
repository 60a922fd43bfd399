"""A run's directory of checkpoints, ``workdir/checkpoints/step_<step>/``:
which are on disk, their metadata (read once), which `restore` found
unreadable, and deleting those no longer kept (by `retained`'s rule)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal, TypeVar

import jax

from .._failures import describe_failure
from .._json import as_number
from ._format import TMP_MARKER, CheckpointError, NewerFormatError, metadata_file
from ._integrity import orbax_layout, raw_metadata, same_arrays
from ._retention import ranked, retained
from ._save import rewrite_metadata

STEP_DIR = re.compile(r"^step_(\d+)$")
DELETING = ".deleting"
T = TypeVar("T")


def shown(steps: Sequence[int]) -> str:
    """A few of ``steps`` for a message: ``1, 2, 3, 4, 5 ... 9``."""
    return ", ".join(map(str, steps[:5])) + (f" ... {steps[-1]}" if len(steps) > 5 else "")


def _open(workdir: Path) -> Path:
    """``workdir/checkpoints``, made if needed, after checking that
    ``workdir`` is a redeqx run's (or a new one)."""
    if metadata_file(workdir).exists():
        raise CheckpointError(
            f"CheckpointManager: {workdir} is one checkpoint, not a run's workdir: give the directory that "
            f"holds checkpoints/ ({workdir.parent.parent}), or read this one with redeqx.restore_checkpoint."
        )
    if (kind := orbax_layout(workdir)) is not None:
        raise CheckpointError(
            f"CheckpointManager: {workdir} is {kind}, not a redeqx workdir; restoring from it would find "
            "nothing and start from scratch. Give the directory of a redeqx run (it holds checkpoints/step_*), "
            "or a new one."
        )
    directory = workdir / "checkpoints"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the checkpoint directory {directory}: {describe_failure(e)}.") from e
    strangers = sorted(p.name for p in directory.iterdir()
                       if not (STEP_DIR.match(p.name) or TMP_MARKER in p.name or p.name.endswith(DELETING)
                               or p.name.startswith(".")))
    if strangers:
        raise CheckpointError(
            f"CheckpointManager: {directory} holds {', '.join(strangers[:5])}, which redeqx did not write "
            "(its checkpoints are named step_<step>): give the workdir of a redeqx run, or a new one."
        )
    return directory


WRITER = ".writer"  # who is saving into the directory: {"host", "pid"}; its mtime is a heartbeat
HEARTBEAT_S = 5.0
STALE_S = 30.0  # a writer on another host whose heartbeat is older than this has stopped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def live_writer(directory: Path) -> str | None:
    """The other process saving into ``directory`` (host and pid), or None: none, this process,
    a process of this host that has ended, or one elsewhere whose heartbeat stopped."""
    path = directory / WRITER
    try:
        holder = json.loads(path.read_text())
        age = time.time() - path.stat().st_mtime
        host, pid = str(holder["host"]), int(holder["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host == socket.gethostname():
        return None if pid == os.getpid() or not _alive(pid) else f"process {pid} on this host ({host})"
    return f"process {pid} on host {host} (last heard of {age:.0f} s ago)" if age < STALE_S else None


class WriterLock:
    """``directory/.writer`` held by this process from its first save to `release`: a second run
    saving into the same directory is refused at once, naming this one. The file's mtime is touched
    every `HEARTBEAT_S`, so a run on another host that was killed stops holding it after `STALE_S`."""

    def __init__(self, directory: Path):
        self.path = directory / WRITER
        other = live_writer(directory)
        if other is not None:
            raise CheckpointError(
                f"CheckpointManager: {other} is saving checkpoints into {directory}; two runs in one workdir "
                "would delete each other's saves. Give this run another workdir, or stop the other one first "
                f"(if it has ended, delete {self.path})."
            )
        tmp = self.path.with_name(f"{WRITER}.{os.getpid()}{TMP_MARKER}")
        tmp.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        os.replace(tmp, self.path)
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="redeqx-writer-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if live_writer(self.path.parent) is None:  # still ours (or nobody's): remove it
            self.path.unlink(missing_ok=True)


class RunDirectory:
    """The checkpoints in ``workdir/checkpoints``. Opening it removes the
    unfinished saves and half-deleted checkpoints of earlier runs, and with
    ``overwrite`` the checkpoints of another run."""

    def __init__(self, workdir: Path, overwrite: bool):
        self.directory = _open(workdir)
        self._meta: dict[str, dict | None] = {}
        self.unreadable: set[str] = set()  # checkpoints `restore` skipped: never counted as kept, replaced when saved
        self.ours = overwrite  # whether the checkpoints on disk are this run's (set by restore or a first save)
        self.lock: WriterLock | None = None  # taken by process 0 at the first save
        if overwrite and jax.process_index() == 0:
            self.lock = WriterLock(self.directory)  # never delete the checkpoints of a run still saving
        # another run saving here: its unfinished save is not ours to clean up (its first save is refused)
        if jax.process_index() == 0 and live_writer(self.directory) is None:
            for p in self.directory.iterdir():
                if TMP_MARKER in p.name or p.name.endswith(DELETING):
                    shutil.rmtree(p, ignore_errors=True)
        if overwrite and jax.process_index() == 0 and (old := self.steps()):
            warnings.warn(f"redeqx.CheckpointManager(overwrite=True): deleting the checkpoints of steps "
                          f"{shown(old)} in {self.directory}.", stacklevel=3)
            for s in old:
                self.delete(self.path(s))

    def claim(self) -> None:
        """Before a first save: a save into checkpoints of another run would
        mix two runs (`restore` would hand back the other run's newest, and
        pruning would delete this run's as older). Process 0 takes the
        directory's `WriterLock`, refused while another run holds it."""
        if self.lock is None and jax.process_index() == 0:
            self.lock = WriterLock(self.directory)
        if not self.ours and (others := self.steps()):
            raise CheckpointError(
                f"CheckpointManager: {self.directory} already holds checkpoints (steps {shown(others)}) that this "
                "manager did not restore from, so this would be a second run in the same workdir. Call "
                "manager.restore(state, mesh, specs) first to go on from them, give another workdir, or pass "
                "CheckpointManager(..., overwrite=True) to delete them."
            )
        self.ours = True

    def release(self) -> None:
        """Lets another run save here (`close`)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def check_counts_up(self, step: int) -> None:
        """A save of ``step`` below the newest checkpoint on disk would be the first one pruned (the
        newest ``keep_last`` are kept by step number) and `restore` would go back to the newer one:
        refused. One `restore` skipped as unreadable does not count (a save of its step replaces it)."""
        newer = [s for s in self.steps() if s > step and self.path(s).name not in self.unreadable]
        if newer:
            raise CheckpointError(
                f"CheckpointManager.save: step {step} is below the newest checkpoint in {self.directory} (step "
                f"{newer[-1]}). Checkpoints are kept and restored by step number, so this save would be pruned "
                "as the oldest and the next restore would go back to step "
                f"{newer[-1]}. Keep the step counting up (do not reset state.step after a restore, or pass "
                "save(..., step=) above it), or give this phase its own workdir (or overwrite=True to delete "
                "the old checkpoints)."
            )

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first."""
        found = (STEP_DIR.match(p.name) for p in self.directory.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, step: int) -> Path:
        return self.directory / f"step_{int(step):09d}"

    @staticmethod
    def step(path: Path) -> int:
        return int(STEP_DIR.match(path.name).group(1))

    def latest(self) -> Path | None:
        steps = [s for s in self.steps() if self.path(s).name not in self.unreadable]
        return self.path(steps[-1]) if steps else None

    # -- metadata

    def metadata(self, path: Path) -> dict | None:
        """The checkpoint's metadata as stored, or None if it cannot be read."""
        if path.name not in self._meta:
            try:
                self._meta[path.name] = raw_metadata(path)
            except CheckpointError:
                return None  # not cached: it may be a save still in flight
        return self._meta[path.name]

    def remember(self, path: Path, meta: dict) -> None:
        self._meta[path.name] = meta

    def forget(self, path: Path) -> None:
        self._meta.pop(path.name, None)

    def metrics(self, paths: Sequence[Path], names: Sequence[str]) -> dict[int, dict[str, float]]:
        """``{step: {metric: value}}`` of the metrics ``names``, as numbers."""
        out = {}
        for p in paths:
            found = (self.metadata(p) or {}).get("metrics")
            found = found if isinstance(found, dict) else {}
            out[self.step(p)] = {k: v for k in names if (v := as_number(found.get(k))) is not None}
        return out

    def ranked(self, name: str, best: Mapping[str, Literal["max", "min"]]) -> list[int]:
        """The steps on disk holding a finite metric ``name``, best first."""
        steps = self.steps()
        return ranked(steps, self.metrics([self.path(s) for s in steps], best), name, best[name])

    def record(self, path: Path, meta: dict) -> None:
        """``path`` (a complete checkpoint of this step) gets ``meta``: the
        arrays must be the ones on disk; the position and metrics are the
        newer call's."""
        old = self.metadata(path)
        if old is None:
            raise CheckpointError(f"{path} exists but its metadata cannot be read; delete it to save step "
                                  f"{meta['step']} again.")
        if not same_arrays(meta, old):
            raise CheckpointError(
                f"step {meta['step']} is already saved in {path} with other arrays than this state's: one step "
                "number, two states. Save each state at its own step (state.step counts optimizer updates). If "
                f"{path.name} is damaged, restore() skips it and the next save of step {meta['step']} replaces it."
            )
        rewrite_metadata(path, meta)
        self.remember(path, meta)

    # -- deleting

    def delete(self, path: Path) -> None:
        doomed = path.with_name(path.name + DELETING)  # renamed first: a half-deleted one must never look complete
        try:
            os.rename(path, doomed)
        except OSError as e:
            warnings.warn(f"redeqx.CheckpointManager: could not delete {path}: {describe_failure(e)}.", stacklevel=4)
            return
        shutil.rmtree(doomed, ignore_errors=True)
        self.forget(path)

    def prune(self, keep_last: int, best: Mapping[str, Literal["max", "min"]]) -> None:
        """Deletes the checkpoints `retained` does not keep (process 0)."""
        if jax.process_index() != 0:
            return
        # checkpoints whose metadata cannot be read, or that restore() found unreadable, are neither counted
        # (a damaged newest one must not push the last good one out) nor deleted (a save of that step replaces it)
        paths = [p for p in (self.path(s) for s in self.steps())
                 if p.name not in self.unreadable and self.metadata(p) is not None]
        keep = retained([self.step(p) for p in paths], self.metrics(paths, best), keep_last=keep_last, best=best)
        for p in paths:
            if self.step(p) not in keep:
                self.delete(p)

    def first_readable(self, steps: Iterable[int], read: Callable[[Path], T]) -> T | None:
        """``read`` of the first checkpoint of ``steps`` it can read: one that
        raises a `CheckpointError` is marked unreadable, with a warning, and
        the next is tried; a `CheckpointError` listing them all if none can
        be read; None if there is none. A newer format is never skipped."""
        failures = []
        for path in map(self.path, steps):
            try:
                return read(path)
            except NewerFormatError:
                raise
            except CheckpointError as e:
                failures.append(str(e))
                self.unreadable.add(path.name)
                warnings.warn(f"redeqx.CheckpointManager: skipping {path}: {e}", stacklevel=3)
        if failures:
            raise CheckpointError(f"no readable checkpoint in {self.directory}:\n" + "\n".join(failures))
        return None

    def replace_unreadable(self, path: Path) -> None:
        """The run reached again the step of a checkpoint `restore` skipped as
        unreadable: delete it, so the state at hand is written in full (not
        just its metadata beside the damaged arrays)."""
        if jax.process_index() == 0:
            warnings.warn(f"redeqx.CheckpointManager: replacing {path}, which restore() skipped as unreadable, "
                          "with the state saved now.", stacklevel=4)
            self.delete(path)
        if jax.process_count() > 1:  # nobody writes the new one before the old one is gone
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"redeqx replace {path.name}")
        self.unreadable.discard(path.name)
        self.forget(path)
