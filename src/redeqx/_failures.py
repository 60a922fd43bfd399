"""What went wrong with a file, said so a user can act on it (the disk is
full, read-only, no permission): one wording for checkpoints and logs."""

from __future__ import annotations

import errno
import re


_OS_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a file stands where a directory is needed",
    errno.EFBIG: "a file grew past the size limit",
}


def describe_failure(e: BaseException) -> str:
    """``e`` as a cause a user can act on: the operating system's error (the
    disk is full, read-only, no permission) when one is in its chain, as an
    ``OSError`` or as the ``os_error_code`` tensorstore writes into its
    messages; then the original error, shortened."""
    text = f"{type(e).__name__}: {e}"
    text = text if len(text) <= 400 else text[:397] + "..."
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        code = x.errno if isinstance(x, OSError) else None
        if code is None and (found := re.search(r"os_error_code='?(\d+)", str(x))):
            code = int(found.group(1))
        if code in _OS_CAUSES:
            return f"{_OS_CAUSES[code]} ({errno.errorcode[code]}; {text})"
        todo += [x.__cause__, x.__context__, *(a for a in getattr(x, "args", ()) if isinstance(a, BaseException))]
    return text
