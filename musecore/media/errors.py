"""The one error media loading raises, and the lazy import of the optional media packages.

Every problem with a user's image, video or audio (a missing file, a corrupt one, a URL while
offline, a codec nobody here decodes) becomes a :class:`MediaError` whose one-line message names
the input and says what to do. Pillow, PyAV and soundfile are the optional ``media`` extra: the
core package imports without them, and the first media call without them says how to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = 'pip install "musecore[media]"'

# import name -> (distribution name, what it is for)
_PACKAGES = {
    "PIL": ("pillow", "images"),
    "av": ("av", "video (and audio in containers soundfile cannot read)"),
    "soundfile": ("soundfile", "audio files"),
}


class MediaError(ValueError):
    """Bad or unreadable media: the message names the input and what to do, on one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # one line, whatever the caller's formatting


def require(module: str) -> ModuleType:
    """Import an optional media package, or raise MediaError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        dist, purpose = _PACKAGES.get(module.split(".")[0], (module, "media"))
        raise MediaError(f"{purpose} need the '{dist}' package, which is not installed ({exc}); "
                         f'install the media extra: {INSTALL_HINT}') from None
