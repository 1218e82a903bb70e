"""The per-user cache for compiled kernels (and other derived files), safe against other users.

A compiled object that musecore loads into the process is code; a cache directory another user can
write to would let them plant one. So the cache lives under the user's own cache root
(``$MUSECORE_CACHE``, else ``$XDG_CACHE_HOME/musecore``, else ``~/.cache/musecore``), every
directory of it is created mode 0700, and an existing one that is owned by somebody else or
writable by group or others is refused with :class:`CacheError` naming it. Entries are keyed by a
hash of everything that determines their bytes (:func:`key`: source, compiler, flags) and written
atomically (:func:`write_atomic`), so a crash never leaves a half-written entry that looks complete.

A name that is a hash of the sources is predictable, so the name alone proves nothing about the bytes.
Entries that are loaded as code are therefore stored with :func:`store` / :func:`install`, which
record the sha256 of what was written in a ``<entry>.sha256`` file beside it, and looked up with
:func:`lookup`, which hands back an entry only when it is a regular file (not a link) owned by this
user, writable by nobody else, and its bytes still hash to the recorded value; anything else (an
entry nobody recorded: a pre-planted file, a changed one) is refused with :class:`CacheError`.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Union

ENV = "MUSECORE_CACHE"


HASH_SUFFIX = ".sha256"


class CacheError(RuntimeError):
    """The cache directory, or an entry in it, is not private to this user or not what was written."""


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
    """``root()/parts...``, created 0700 where missing; every level from the root down is checked private. The
    root's missing parents are made too (a fresh machine may have no ``~/.cache``), unchecked: its parent 0700 as XDG
    asks, any above that by the umask."""
    path = root()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise CacheError(f"cannot create {path.parent} for the cache: {err.strerror}; set {ENV} to a writable "
                         "private directory") from None
    levels = [path]
    for part in parts:
        levels.append(levels[-1] / part)
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


def _check_private_file(path: Path, what: str) -> os.stat_result:
    """``path`` is a regular file (not a link) of this user that nobody else can write."""
    try:
        info = path.lstat()
    except OSError as err:
        raise CacheError(f"cannot read {what} {path}: {err.strerror}; delete it and it will be rebuilt") from None
    if not stat.S_ISREG(info.st_mode):
        raise CacheError(f"{what} {path} is not a regular file (a link or a device); delete it and it will be rebuilt")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise CacheError(f"{what} {path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): it may be "
                         "planted code; delete it and it will be rebuilt")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(f"{what} {path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}); delete "
                         "it and it will be rebuilt")
    return info


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _record(path: Path) -> Path:
    """Write the sha256 of ``path``'s bytes beside it (``<path>.sha256``, atomically, mode 0600)."""
    return write_atomic(path.with_name(path.name + HASH_SUFFIX), (_sha256(path) + "\n").encode())


def store(path: Path, data: bytes) -> Path:
    """Write a cache entry that will be loaded as code: :func:`write_atomic`, then its recorded sha256."""
    write_atomic(path, data)
    _record(path)
    return path


def install(built: Path, path: Path) -> Path:
    """Move a file built elsewhere in the same file system (a compiler's output in a private temporary
    directory beside the entry) to ``path`` and record its sha256; :func:`lookup` will accept it."""
    os.chmod(built, 0o600 if not os.access(built, os.X_OK) else 0o700)
    os.replace(built, path)
    _record(path)
    return path


def lookup(path: Path) -> Union[Path, None]:
    """``path`` when it is an entry this user stored and its bytes are unchanged; None when there is no
    entry (build it); :class:`CacheError` naming the file for anything else: an entry with no recorded
    hash (planted by somebody else, or written before hashes were recorded), a different hash, a link, a
    file of another user or one that others can write."""
    _check_private(path.parent)
    if not os.path.lexists(path):
        return None
    _check_private_file(path, "cache entry")
    recorded_file = path.with_name(path.name + HASH_SUFFIX)
    if not os.path.lexists(recorded_file):
        raise CacheError(f"cache entry {path} has no recorded sha256 ({recorded_file.name}): musecore did not write "
                         "it, so it is not loaded; delete it and it will be rebuilt")
    _check_private_file(recorded_file, "cache hash record")
    recorded = recorded_file.read_text(errors="replace").strip()
    actual = _sha256(path)
    if actual != recorded:
        raise CacheError(f"cache entry {path} has sha256 {actual[:16]}..., not the {recorded[:16]!r}... recorded when "
                         "it was written: it changed since; delete it and it will be rebuilt")
    return path
