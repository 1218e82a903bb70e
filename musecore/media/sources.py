"""Where media bytes come from: a local path, raw bytes or a ``data:`` URL, checked before decoding.

musecore runs offline, so an ``http(s)://`` URL is refused with a message saying to save the file
and pass its path; a path that does not exist, a directory and an empty file are refused by name
before any decoder sees them, so the user reads "x.png does not exist" rather than a decoder's
traceback.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union
from urllib.parse import unquote, urlparse

from .errors import MediaError

Source = Union[str, os.PathLike, bytes, bytearray, memoryview]


@dataclass(frozen=True)
class Resolved:
    """A checked media source: exactly one of ``path`` and ``data`` is set; ``name`` is for messages."""

    name: str
    path: Optional[Path] = None
    data: Optional[bytes] = None
    mime: Optional[str] = None  # from a data: URL, e.g. "image/png"

    def file(self):
        """A path or a binary file object that decoders (Pillow, soundfile, PyAV) accept."""
        import io
        return str(self.path) if self.path is not None else io.BytesIO(self.data)


def describe(src: object, name: Optional[str]) -> str:
    """The name an error message uses for ``src``: the caller's name, else the path, else the type."""
    if name:
        return name
    if isinstance(src, (str, os.PathLike)):
        text = os.fspath(src)
        return text if len(text) <= 120 else text[:60] + "..." + text[-20:]
    if isinstance(src, (bytes, bytearray, memoryview)):
        return "bytes"
    return "input"


def subject(kind: str, label: str) -> str:
    """How a message names an input: "image #2" as given, else the kind before the path ("audio a.wav")."""
    return label if label.lower().startswith(kind) else f"{kind} {label}"


def is_source(src: object) -> bool:
    """True when ``src`` is something :func:`resolve` reads (a path, bytes or a URL string)."""
    return isinstance(src, (str, os.PathLike, bytes, bytearray, memoryview))


def resolve(src: Source, kind: str, name: Optional[str] = None) -> Resolved:
    """Check a path / bytes / URL source of ``kind`` ("image", "video", "audio") and return it resolved.

    Example::

        resolve("cat.png", "image").path      # Path("cat.png"), after checking it is a non-empty file
        resolve("data:image/png;base64,iVBO...", "image").data   # the decoded bytes
    """
    label = subject(kind, describe(src, name))
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        if not data:
            raise MediaError(f"{label} is empty (0 bytes); pass the {kind} file's contents")
        return Resolved(label, data=data)
    if isinstance(src, os.PathLike):
        src = os.fspath(src)
    if not isinstance(src, str):
        raise MediaError(f"{label}: expected a path, bytes or a data: URL, got {type(src).__name__}")
    text = src.strip()
    lowered = text[:16].lower()
    if lowered.startswith(("http://", "https://")):
        raise MediaError(f"{label} is an http(s) URL; musecore runs offline and does not download media: "
                         f"save the file and pass its local path")
    if lowered.startswith("data:"):
        return _data_url(text, kind, name)
    if lowered.startswith("file://"):
        src = unquote(urlparse(text).path)
    elif "://" in text[:12]:
        scheme = text.split("://", 1)[0]
        raise MediaError(f"{label}: '{scheme}://' URLs are not supported; pass a local path, bytes or a "
                         f"data: URL")
    path = Path(src).expanduser()
    if not _exists(path) and _BASE64.fullmatch(text):
        # a bare base64 string, as transformers' loaders also accept (no file has such a long plain name)
        label = subject(kind, name or "string (no such file, so read as base64)")
        return Resolved(label, data=decode_base64(text, kind, label))
    if not _exists(path):
        raise MediaError(f"{label} does not exist; check the path")
    if path.is_dir():
        raise MediaError(f"{label} is a directory; pass the path of {_article(kind)} {kind} file")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise MediaError(f"{label} cannot be read ({exc.strerror}); check its permissions") from None
    if size == 0:
        raise MediaError(f"{label} is empty (0 bytes); pass a valid {kind} file")
    if not os.access(path, os.R_OK):
        raise MediaError(f"{label} is not readable; check its permissions")
    return Resolved(label, path=path)


_BASE64 = re.compile(r"[A-Za-z0-9+/_\-\s]{64,}={0,2}")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # e.g. a name longer than the file system allows
        return False


def _article(kind: str) -> str:
    return "an" if kind[0] in "aeiou" else "a"


def _data_url(text: str, kind: str, name: Optional[str]) -> Resolved:
    """Decode ``data:[<mime>][;base64],<payload>`` (RFC 2397)."""
    head, sep, payload = text.partition(",")
    label = subject(kind, name or f"data:{head[5:].split(';')[0] or '(no type)'} URL")
    if not sep:
        raise MediaError(f"{label} is a data: URL without a ',' before its payload; "
                         f"use data:<mime>;base64,<data>")
    params = head[5:].split(";")
    mime = params[0].lower() or None
    if "base64" in (p.strip().lower() for p in params[1:]):
        data = decode_base64(payload, kind, label)
    else:
        data = unquote(payload).encode("latin-1", errors="replace")
    if not data:
        raise MediaError(f"{label} is a data: URL with an empty payload; pass the {kind}'s bytes")
    return Resolved(label, data=data, mime=mime)


def decode_base64(payload: str, kind: str, label: str) -> bytes:
    """Base64 (standard or URL-safe, padding optional) to bytes, or a MediaError naming the input."""
    cleaned = "".join(payload.split())
    cleaned += "=" * (-len(cleaned) % 4)
    try:
        if "-" in cleaned or "_" in cleaned:
            return base64.urlsafe_b64decode(cleaned)
        return base64.b64decode(cleaned, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"{label}: the base64 data does not decode ({exc}); "
                         f"pass valid base64 of the {kind} file") from None
