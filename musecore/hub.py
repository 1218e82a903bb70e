"""Hugging Face Hub ids (``org/name``) as models: resolved through the local Hugging Face cache.

``musecore.load("org/name")`` and ``--model org/name`` find the snapshot that ``hf download`` (or
transformers) left in the cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``) and never touch the network: a missing snapshot is a one-line error
naming the command that fetches it. Downloading happens only when asked (``download=True``,
``--download``), and never while ``HF_HUB_OFFLINE`` is set. ``org/name@revision`` picks a branch,
tag or commit.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
# What musecore reads from a checkpoint (DESIGN.md "Loading checkpoints"); nothing else is downloaded.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
TRUE = {"1", "ON", "YES", "TRUE"}


def looks_like_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and not name.startswith((".", "/"))


def cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (not at import, as huggingface_hub does)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE


def resolve(hub_id: str, download: bool = False) -> Path:
    """The local snapshot folder of ``org/name[@revision]``; fetched only with ``download=True``.

    Example::

        folder = resolve("my-org/Muse-Spark-Open-NVFP4")   # FileNotFoundError if not cached
    """
    repo_id, _, revision = hub_id.partition("@")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError as e:
        raise FileNotFoundError(f"{hub_id!r} looks like a Hub id, but huggingface_hub is not installed ({e}); "
                                "pip install huggingface_hub, or pass a checkpoint folder") from None
    cache = cache_dir()
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    if download and offline():
        raise FileNotFoundError(f"cannot download {hub_id}: HF_HUB_OFFLINE is set; unset it, or fetch the "
                                f"snapshot elsewhere into {cache}")
    try:
        folder = snapshot_download(repo_id, revision=revision or None, cache_dir=str(cache),
                                   local_files_only=not download,
                                   allow_patterns=CHECKPOINT_FILES if download else None)
    except LocalEntryNotFoundError as err:
        if download:  # huggingface_hub's answer when the Hub cannot be reached and nothing is cached
            raise FileNotFoundError(f"could not download {hub_id}: the Hub was not reachable and no snapshot is cached "
                                    f"in {cache} ({_first_line(err)}); check the network (HF_ENDPOINT, proxy "
                                    f"settings), or fetch it on a machine that has one with `{fetch}`") from None
        raise FileNotFoundError(f"{hub_id} is not in the Hugging Face cache ({cache}); fetch it with "
                                f"`{fetch}`, or pass --download (download=True) to let musecore fetch it") from None
    except GatedRepoError:
        raise FileNotFoundError(f"{repo_id} is gated on the Hub: accept its terms on its page, log in with "
                                "`hf auth login` (or set HF_TOKEN), then try again") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"no repository {repo_id} on the Hub (or it is private: log in with `hf auth login` "
                                "or set HF_TOKEN); check the id") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{repo_id} has no revision {revision!r} on the Hub; pass a branch, tag or commit "
                                "that exists (org/name@revision)") from None
    except HfHubHTTPError as err:
        raise FileNotFoundError(f"downloading {hub_id} failed: {_first_line(err)}; try again, or fetch it with "
                                f"`{fetch}`") from None
    return Path(folder)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]

