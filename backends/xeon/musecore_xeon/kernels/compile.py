"""Building the C / C++ sources of ``musecore_xeon/csrc`` once per user: shared objects in the per-user compile cache
(:mod:`musecore.compile_cache`: a 0700 directory, refused when another user could write to it), named by a hash of
the sources, the compiler (its path and ``--version``) and the flags, and renamed into place only when complete, so
that concurrent processes and crashes never leave a half-written object that looks finished."""

from __future__ import annotations

import functools
import importlib.resources
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from musecore import compile_cache

SOURCES_PACKAGE, SOURCES_DIR = "musecore_xeon", "csrc"
CACHE_SUBDIR = "xeon"

log = logging.getLogger(__name__)


def read_source(name: str) -> str:
    """The text of ``csrc/<name>`` as installed (package data of ``musecore-xeon``)."""
    return importlib.resources.files(SOURCES_PACKAGE).joinpath(SOURCES_DIR, name).read_text(encoding="utf-8")


@functools.cache
def compiler_identity(compiler: str) -> str:
    """``compiler``'s path and the output of ``compiler --version``: a new compiler gives new cache entries."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
        version = done.stdout or done.stderr
    except (OSError, subprocess.SubprocessError) as err:
        version = f"--version failed: {type(err).__name__}"
    return f"{compiler}\n{version}"


def cache_dir() -> Path:
    """This user's directory for the compiled objects (created 0700; :class:`musecore.compile_cache.CacheError` when
    it is not private)."""
    return compile_cache.directory(CACHE_SUBDIR)


def cached_object_path(name: str, sources: Sequence[str], compiler: str, flags: Sequence[str], *extra: str) -> Path:
    """Where the object built from ``sources`` (names in ``csrc``) by ``compiler`` with ``flags`` is cached."""
    items = [f"{source}\n{read_source(source)}" for source in sources]
    digest = compile_cache.key(*items, compiler_identity(compiler), *flags, *extra)
    return cache_dir() / f"{name}-{digest}.so"


def compile_cached(name: str, sources: Sequence[str], main: str, compiler: str, flags: Sequence[str],
                   command: Callable[[Path, Path], list[str]], *extra: str, timeout: int = 600) -> Path:
    """The shared object of ``csrc/<main>`` (which includes the other ``sources``), built when missing by
    ``command(main_file, shared_object)`` in a private temporary directory beside the cache entry and renamed into
    place. ``extra``: anything else that changes the result (e.g. PyTorch and Python versions). Raises
    :class:`~musecore.compile_cache.CacheError` for a cache directory that is not private, ``OSError`` /
    ``SubprocessError`` when the build fails."""
    target = cached_object_path(name, sources, compiler, flags, *extra)  # the directory is checked private here
    try:
        if compile_cache.lookup(target) is not None:  # ours, unchanged since we stored it
            return target
    except compile_cache.CacheError as err:  # an entry we cannot vouch for is never loaded: rebuilt over it
        log.warning("rebuilding %s: %s", target.name, err)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-build-") as tmp:
        for source in sources:
            (Path(tmp) / source).write_text(read_source(source), encoding="utf-8")
        obj = Path(tmp) / f"{name}.so"
        subprocess.run(command(Path(tmp) / main, obj), check=True, capture_output=True, timeout=timeout)
        if os.path.lexists(target) and not target.is_file():  # a link or a directory planted there
            raise compile_cache.CacheError(f"{target}: not a regular file; delete it and it will be rebuilt")
        compile_cache.install(obj, target)
    return target
