"""The progress bars of the `batches` loops now running, innermost last:
`batches(..., desc=...)` registers its bar for as long as its loop runs,
and `Logger.log` shows the latest loss and learning rate on the innermost."""

from __future__ import annotations

_OPEN: list = []


def opened(bar) -> None:
    """``bar`` (a tqdm bar) is shown from now on, inside the bars already open."""
    _OPEN.append(bar)


def closed(bar) -> None:
    """``bar`` is gone (a no-op for a bar never opened)."""
    if bar in _OPEN:
        _OPEN.remove(bar)


def innermost():
    """The innermost open bar, or None."""
    return _OPEN[-1] if _OPEN else None
