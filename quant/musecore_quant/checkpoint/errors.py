"""The one exception the checkpoint readers, writers and the converter raise for bad input.

A ``CheckpointError`` always names the file (and the tensor, where there is one), says what was
found and what was expected, and ends with what to do. The CLI prints it as a one-line error
and exits with status 2; library callers can catch it as a ``ValueError``.
"""

from __future__ import annotations

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
