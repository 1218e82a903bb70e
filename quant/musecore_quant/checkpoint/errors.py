"""The one exception family the checkpoint readers, writers and the converter raise for bad input.

Everything a user can cause (a corrupt or malformed checkpoint, a config that contradicts its
tensors, a full disk, a destination another conversion holds) is a ``CheckpointError``: it names
the file (and the tensor, where there is one), says what was found and what was expected, and
ends with what to do. The ``musecore-quant`` CLI prints it as one line and exits with status 2;
library callers can catch it as a ``ValueError``. Lower-level failures (``OSError``, the
``safetensors`` library's ``SafetensorError``, ``RecursionError`` on absurdly nested JSON,
``UnicodeError``, ``OverflowError``) are translated at the boundary where they happen by
``translate``, so no other exception type escapes for bad input.

- ``CheckpointIOError``: the operating system refused a read or write (disk full, permissions,
  a symlink loop, a name too long); ``errno`` says which.
- ``ConversionLockedError``: another process is writing the same destination.
- ``InvalidScaleError``: a quantized weight whose scales would silently decode to wrong values
  (zero or negative global scales, negative block scales, NaN or overflowing E8M0 exponents).
"""

from __future__ import annotations

import errno as errno_codes
from pathlib import Path
from typing import Optional


class CheckpointError(ValueError):
    """A checkpoint (or a conversion request) that musecore_quant cannot accept.

    ``path`` and ``tensor`` repeat what the message names, for callers that want them.
    """

    def __init__(self, message: str, *, path: Optional[Path | str] = None,
                 tensor: Optional[str] = None) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)
        self.tensor = tensor


class CheckpointIOError(CheckpointError):
    """Reading or writing a checkpoint file failed in the operating system (``errno`` says why)."""

    def __init__(self, message: str, *, errno: Optional[int] = None, path: Optional[Path | str] = None,
                 tensor: Optional[str] = None) -> None:
        super().__init__(message, path=path, tensor=tensor)
        self.errno = errno


class ConversionLockedError(CheckpointError):
    """Another process holds the lock of the destination a writer was asked to write."""


class InvalidScaleError(CheckpointError):
    """A quantized weight's scales are out of their domain; decoding it would give wrong values silently."""


# errno -> what to do about it
_OS_ADVICE = {
    errno_codes.ENOSPC: "the disk is full: free space (or choose a destination on another disk) and rerun",
    errno_codes.EDQUOT: "the disk quota is exhausted: free space and rerun",
    errno_codes.EACCES: "permission denied: check the folder's permissions",
    errno_codes.EPERM: "operation not permitted: check the folder's permissions",
    errno_codes.EROFS: "the file system is read-only: choose a writable destination",
    errno_codes.ELOOP: "a symlink loop: fix or remove the symlink",
    errno_codes.ENAMETOOLONG: "a file name is too long for the file system: shorten it",
    errno_codes.ENOTDIR: "a path component is a file, not a folder: choose another path",
    errno_codes.ENOENT: "the file does not exist: check the path",
    errno_codes.EISDIR: "a folder stands where a file was expected: check the path",
}


def translate(exc: BaseException, path: Optional[Path | str], doing: str, *,
              tensor: Optional[str] = None, advice: str = "") -> CheckpointError:
    """The ``CheckpointError`` for a low-level failure while ``doing`` something with ``path``.

    Use as ``raise translate(e, path, "reading the header") from e``; a ``CheckpointError`` is
    returned unchanged.
    """
    if isinstance(exc, CheckpointError):
        return exc
    where = f"{path}" + (f", tensor {tensor!r}" if tensor else "")
    if isinstance(exc, OSError):
        what = exc.strerror or str(exc) or type(exc).__name__
        todo = _OS_ADVICE.get(exc.errno or -1, advice or "check the path and rerun")
        return CheckpointIOError(f"{where}: {doing} failed ({what}); {todo}", errno=exc.errno, path=path,
                                 tensor=tensor)
    if isinstance(exc, RecursionError):
        what = "the JSON is nested too deeply to be a real checkpoint file"
    elif isinstance(exc, UnicodeError):
        what = f"text that is not valid UTF-8 ({exc})"
    elif isinstance(exc, OverflowError):
        what = f"a number too large to be real ({exc})"
    else:
        what = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    todo = advice or "the file is corrupt or was not written by a supported producer: re-download or re-export it"
    return CheckpointError(f"{where}: {doing} failed: {what}; {todo}", path=path, tensor=tensor)
