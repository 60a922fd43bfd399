"""The save in flight: a `Writer` keeps at most one orbax write going (in
background threads with ``async_save``) and finishes it at the next save,
at `CheckpointManager.close`, or at exit (`finish_in_flight`, which
``_hooks.finish_saves_on_exit`` runs at exit and on an uncaught exception)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import orbax.checkpoint as ocp

from ._directory import RunDirectory
from ._save import Encoded, remove_partial, write, write_failed

# Writers with a save in flight, kept alive (with their manager) until it is written even if the caller drops them.
_IN_FLIGHT: set[Writer] = set()


def finish_in_flight(why: str) -> list[str]:
    """Waits for every save in flight; returns the failures, one line each."""
    failures = []
    for writer in list(_IN_FLIGHT):
        try:
            writer.finish()
        except Exception as e:
            failures.append(f"redeqx.CheckpointManager ({why}): {e}")
    return failures


class Writer:
    """Orbax's checkpointer with at most one save in flight, into ``disk``;
    ``done`` runs once a save is complete (the manager deletes there what
    it no longer keeps)."""

    def __init__(self, disk: RunDirectory, async_save: bool, done: Callable[[], None]):
        handler = ocp.CompositeCheckpointHandler()
        self._checkpointer = ocp.AsyncCheckpointer(handler) if async_save else ocp.Checkpointer(handler)
        self._disk, self._done = disk, done
        self._lock = threading.Lock()
        self.pending: Path | None = None  # the checkpoint being written

    def start(self, path: Path, encoded: Encoded) -> None:
        """Starts writing ``encoded`` to ``path`` (without ``async_save``, writes it)."""
        with self._lock:
            write(self._checkpointer, path, encoded.args)
            self._disk.remember(path, encoded.metadata)
            self.pending = path
            _IN_FLIGHT.add(self)
        if not isinstance(self._checkpointer, ocp.AsyncCheckpointer):
            self.finish()

    def finish(self) -> None:
        """Waits for the save in flight, then runs ``done``; a save that
        failed leaves nothing behind and raises a `CheckpointError`."""
        with self._lock:
            pending, self.pending = self.pending, None
            _IN_FLIGHT.discard(self)
            if pending is None:
                return
            try:
                if isinstance(self._checkpointer, ocp.AsyncCheckpointer):
                    self._checkpointer.wait_until_finished()
            except Exception as e:
                self._disk.forget(pending)
                remove_partial(pending)
                raise write_failed(pending, e) from e
            self._done()  # only after a save of ours is complete

    def close(self) -> None:
        """Releases orbax's checkpointer (finish first)."""
        self._checkpointer.close()
