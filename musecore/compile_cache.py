"""The per-user cache for compiled kernels (and other derived files), safe against other users.

A compiled object that musecore loads into the process is code; a cache directory another user can
write to would let them plant one. So the cache lives under the user's own cache root
(``$MUSECORE_CACHE``, else ``$XDG_CACHE_HOME/musecore``, else ``~/.cache/musecore``), every
directory of it is created mode 0700, and an existing one that is owned by somebody else or
writable by group or others is refused with :class:`CacheError` naming it. Entries are keyed by a
hash of everything that determines their bytes (:func:`key`: source, compiler, flags) and written
atomically (:func:`write_atomic`), so a crash never leaves a half-written entry that looks complete.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Union

ENV = "MUSECORE_CACHE"


class CacheError(RuntimeError):
    """The cache directory is not private to this user."""


def root() -> Path:
    """The cache root (not created): ``$MUSECORE_CACHE`` or ``$XDG_CACHE_HOME/musecore`` or ``~/.cache/musecore``."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "musecore"


def _check_private(path: Path) -> None:
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(f"cache path {path} is not a directory; remove it or set {ENV} to a private directory")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise CacheError(f"cache directory {path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): "
                         f"another user could plant compiled code there; set {ENV} to a directory of your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(f"cache directory {path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}): "
                         f"another user could plant compiled code there; run `chmod 700 {path}` or set {ENV} "
                         "to a private directory")


def directory(*parts: str) -> Path:
    """``root()/parts...``, created 0700 where missing; every level from the root down is checked private."""
    path = root()
    levels = [path] + [path := path / part for part in parts]
    for level in levels:
        try:
            level.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as err:
            raise CacheError(f"cannot create cache directory {level}: {err.strerror}; set {ENV} to a writable "
                             "private directory") from None
        _check_private(level)
    return levels[-1]


def key(*items: Union[str, bytes]) -> str:
    """A stable hex key over everything that determines an entry's bytes (source, compiler, flags)."""
    h = hashlib.sha256()
    for item in items:
        data = item.encode() if isinstance(item, str) else item
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:24]


def write_atomic(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` (mode 0600) through a temporary file in the same directory and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
