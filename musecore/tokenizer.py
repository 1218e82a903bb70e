"""Text <-> token ids for a checkpoint, from its ``tokenizer.json`` (Hugging Face ``tokenizers``).

The model itself only sees ids; this is the thin layer that lets ``model.generate("text")`` take
and return strings, and that tells generation which ids end a sequence. The end-of-sequence ids
come from two places because checkpoints disagree on where they put them: ``eos_token_id`` in
``config.json`` / ``generation_config.json``, and the chat-format special tokens ``<|eot|>`` (end
of turn) and ``<|eom|>`` (end of message) when the vocabulary has them. A checkpoint without
``tokenizer.json`` is still usable with token-id prompts, so :func:`load_tokenizer` returns
``None`` rather than raising.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

TOKENIZER_FILE = "tokenizer.json"
# The Muse chat format: <|start|>role<|message|>text<|eot|>  (<|eom|> ends a message mid-turn).
START, MESSAGE, END_OF_MESSAGE, END_OF_TURN = "<|start|>", "<|message|>", "<|eom|>", "<|eot|>"
CHAT_SPECIAL_TOKENS: tuple[str, ...] = (START, MESSAGE, END_OF_MESSAGE, END_OF_TURN)
EOS_SPECIAL_TOKENS: tuple[str, ...] = (END_OF_TURN, END_OF_MESSAGE)
PAD_TOKEN = "<|pad|>"


class MuseTokenizer:
    """A ``tokenizers.Tokenizer`` plus the ids generation needs (EOS, padding).

    Example::

        tok = load_tokenizer("path/to/checkpoint")
        ids = tok.encode("def fib(n):")
        assert tok.decode(ids) == "def fib(n):"
    """

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int] = (), pad_id: Optional[int] = None,
                 bos_id: Optional[int] = None, source: str = TOKENIZER_FILE) -> None:
        self._tokenizer = tokenizer
        self.source = source
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_ids))  # ordered, unique
        self.pad_id: Optional[int] = pad_id
        self.bos_id: Optional[int] = bos_id  # generation puts it before a text prompt (training framing)
        self.chat_template: Optional[Any] = None  # musecore.chat.ChatTemplate, when the checkpoint ships one

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the file's post-processor (e.g. a BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Special tokens are kept by default so chat markers stay visible."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Any], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> Union[str, list[int]]:
        """The checkpoint's chat template applied to ``messages`` (text, or ids with ``tokenize=True``),
        as ``transformers``' ``apply_chat_template`` does it."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: this checkpoint has no chat template "
                             "(tokenizer_config.json has no chat_template)")
        text = self.chat_template.render(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters: a text of ``n`` tokens has at most about ``n`` times this many
        characters (byte-level entries spell one character per byte), so longer text cannot fit a context of ``n``
        (the server refuses it before tokenizing it)."""
        return max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def token_id(self, token: str) -> int:
        """The id of one vocabulary entry (e.g. ``"<|eot|>"``); raises if the vocabulary lacks it."""
        found = self._tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"token {token!r} is not in the vocabulary of {self.source}; "
                             "check the spelling or use tokenizer.encode(text) for ordinary text")
        return int(found)

    def has_token(self, token: str) -> bool:
        return self._tokenizer.token_to_id(token) is not None

    def __repr__(self) -> str:
        return (f"MuseTokenizer({self.source}, vocab={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={list(self.eos_ids)}, pad_id={self.pad_id})")


def inside(folder: Path, path: Path) -> Path:
    """``path`` (a file of the checkpoint ``folder``), refused in one line when a symlink takes it outside the
    folder (as the checkpoint reader refuses such a config.json or shard)."""
    from musecore_quant.checkpoint.safetensors_io import require_inside
    return require_inside(folder, path, path.name)


def _config_ids(folder: Path) -> tuple[list[int], Optional[int], Optional[int]]:
    """``eos_token_id`` (int or list), ``pad_token_id`` and ``bos_token_id`` from config.json (its
    ``text_config`` in transformers' nested layout) and
    generation_config.json (the first file that sets a single id wins)."""
    eos: list[int] = []
    pad: Optional[int] = None
    bos: Optional[int] = None
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(inside(folder, path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e}); fix or re-export the file") from e
        if not isinstance(data, dict):
            continue
        if isinstance(data.get("text_config"), dict):  # transformers' nested config: the ids are the text model's
            data = {**data["text_config"], **{k: v for k, v in data.items() if v is not None}}
        value = data.get("eos_token_id")
        if value is not None:
            eos.extend(value if isinstance(value, list) else [value])
        if pad is None and data.get("pad_token_id") is not None:
            pad = int(data["pad_token_id"])
        if bos is None and data.get("bos_token_id") is not None:
            bos = int(data["bos_token_id"])
    return [int(i) for i in eos], pad, bos


def load_tokenizer(folder: Union[str, Path], eos_token_id: Union[int, Sequence[int], None] = None
                   ) -> Optional[MuseTokenizer]:
    """The tokenizer of a checkpoint folder, or ``None`` when it has no ``tokenizer.json``.

    EOS ids: ``eos_token_id`` if given, else those in the folder's ``config.json`` /
    ``generation_config.json``, plus ``<|eot|>`` and ``<|eom|>`` when the vocabulary has them.
    The pad id is ``pad_token_id`` from the config, else ``<|pad|>`` when present, else ``None``;
    the BOS id is the config's ``bos_token_id`` (``None`` when unset).

    Example::

        tok = load_tokenizer("path/to/checkpoint")   # None for an ids-only checkpoint
    """
    from tokenizers import Tokenizer

    folder = Path(folder)
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        inner = Tokenizer.from_file(str(inside(folder, path)))
    except Exception as e:  # tokenizers raises a bare Exception for every parse failure
        raise ValueError(f"{path} is not a valid tokenizer.json ({e}); re-export it with "
                         "tokenizers.Tokenizer.save(), or remove it to generate from token ids only") from e
    config_eos, pad, bos = _config_ids(folder)
    if eos_token_id is not None:
        config_eos = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [int(eos_token_id)]
    special = [inner.token_to_id(t) for t in EOS_SPECIAL_TOKENS]
    eos = config_eos + [i for i in special if i is not None]
    if pad is None:
        pad = inner.token_to_id(PAD_TOKEN)
    from musecore.chat import ChatTemplate

    tokenizer = MuseTokenizer(inner, eos_ids=eos, pad_id=pad, bos_id=bos, source=str(path))
    tokenizer.chat_template = ChatTemplate.from_folder(folder)
    return tokenizer
