"""What a process started by ``python -m redeqx.launch`` tells the launcher, as files in its
directory: before its first step what it is doing (joining the run, compiling a step, restoring a
checkpoint), that its first step ran, and that its script ended. The launcher's start-up deadline (``--startup-timeout``) ends a run one of whose
processes never gets there, naming it and what it was doing. Outside the launcher these do
nothing: one environment lookup, and after the first step not even that."""

from __future__ import annotations

import os
from pathlib import Path

LAUNCH_DIR = "REDEQX_LAUNCH_DIR"  # where each launched process leaves its marks
PROCESS = "REDEQX_PROCESS_ID"  # this process's index (`redeqx.run._settings.ENV["process_id"]`)
DOING, STEPPED, ENDED = "doing", "stepped", "ended"
_stepped = False


def _mark(kind: str, text: str) -> None:
    where, process = os.environ.get(LAUNCH_DIR), os.environ.get(PROCESS)
    if not where or process is None:
        return
    try:
        path = Path(where, f"{kind}_{process}")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # the launcher never reads half a note
    except OSError:
        pass  # the launcher's directory gone: it is ending the run anyway


def pending() -> bool:
    """Whether this process has yet to run its first step (cheap: a module flag)."""
    return not _stepped


def doing(text: str) -> None:
    """Before the first step: what this process is about to do, for the launcher's deadline message."""
    if not _stepped:
        _mark(DOING, text)


def stepped() -> None:
    """This process's first step ran: the start-up deadline no longer applies to it."""
    global _stepped
    if not _stepped:
        _stepped = True
        _mark(STEPPED, "")


def ended() -> None:
    """This process's script returned (the launcher's ``--exit-timeout`` watches for the others)."""
    _mark(ENDED, "")
