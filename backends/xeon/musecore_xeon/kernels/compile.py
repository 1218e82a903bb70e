"""Building the native sources once per machine: shared objects cached in a directory, named by a hash of the
source and of everything else that changes the result (compiler command and flags, PyTorch and Python versions),
and written atomically, so that concurrent processes never load a half-written file."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Optional


def compile_cached(cache_dir: Path, name: str, source: str, key: str, suffix: str,
                   command: Callable[[Path, Path], Optional[list[str]]], timeout: int = 600) -> Optional[Path]:
    """``cache_dir / "<name>-<hash>.so"``, built when missing by ``command(source_file, shared_object)``
    (None from ``command``: no compiler, nothing built, None returned). Raises ``OSError`` /
    ``SubprocessError`` when the build fails."""
    target = cache_dir / f"{name}-{hashlib.sha256((source + key).encode()).hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, obj = Path(tmp) / f"{name}{suffix}", Path(tmp) / f"{name}.so"
        cmd = command(src, obj)
        if cmd is None:
            return None
        src.write_text(source)
        subprocess.run(cmd, check=True, capture_output=True, timeout=timeout)
        os.replace(obj, target)
    return target
