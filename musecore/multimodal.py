"""Chat messages with images, video and audio -> prompt token ids and the feature rows that replace
their placeholders, through a bounded cache of encoder outputs.

What it does, in transformers' order (``ProcessorMixin.apply_chat_template`` then ``__call__``):

1. Each message's content parts are read: ``text``, ``image``/``video``/``audio`` (the value under
   ``path``, ``url``, ``image``/``video``/``audio``, ``data`` or ``base64``: a path, bytes, a PIL
   image, a numpy/torch array, a ``data:`` URL), and the OpenAI shapes ``image_url`` (a ``data:``
   URL or a local path) and ``input_audio`` (``{"data": base64, "format": "wav"}``).
2. The checkpoint's chat template renders the conversation; it writes one placeholder string per
   media part (``<|image|>`` in muse-tiny's template). The i-th placeholder of a kind, counted over
   the whole batch, becomes the processor's expansion of the i-th media item of that kind
   (``<|image_start|>`` + one placeholder token per feature row + ``<|image_end|>``, with frame
   timestamps for video), exactly as transformers' ``get_text_with_replacements`` does.
3. The text is tokenized (no BOS added: the template writes it), the media processed by
   :class:`musecore.media.MediaProcessor`, and the towers run through the model's
   :class:`EncoderCache` when the prefill needs the features (:meth:`Prepared.features`).

The cache is keyed by a SHA-256 of the kind and the processed input (pixels and grid, or samples),
so the same picture in a later turn, or twice in one batch, is encoded once. It is bounded in bytes
(``MUSECORE_ENCODER_CACHE_BYTES``, default 256 MiB): least recently used entries go first, and an
output larger than the whole bound is used once and not kept.

Example::

    from musecore.multimodal import prepare
    prepared = prepare(model, [[{"role": "user", "content": [
        {"type": "image", "path": "cat.png"}, {"type": "text", "text": "What is this?"}]}]])
    logits = model.forward(torch.tensor(prepared.ids), media=prepared.features(model))
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

KINDS = ("image", "video", "audio")
CACHE_BYTES_ENV = "MUSECORE_ENCODER_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 256 * 2**20
PART_TYPES = ("text", "image", "video", "audio", "image_url", "input_audio")
# Where a media part's value may be, per kind, in the order transformers looks (plus "data").
SOURCE_KEYS = {"image": ("image", "url", "path", "base64", "data"),
               "video": ("video", "url", "path", "data"),
               "audio": ("audio", "url", "path", "base64", "data")}
TOWER = {"image": "vision", "video": "vision", "audio": "audio"}


# -- the encoder cache -----------------------------------------------------------------------------

class EncoderCache:
    """Encoder outputs by content hash, least recently used first out, never above ``max_bytes``.

    Counters: ``hits`` (items served without encoding: found in the cache, or a repeat of an item
    earlier in the same call), ``misses`` (items encoded), ``encoder_calls`` (times an encoder ran;
    at most one per kind per :meth:`encode` call), ``evictions``, ``too_large`` (outputs bigger than
    the whole bound: used, not kept). ``max_bytes=0`` keeps nothing (every item is encoded).

    Example::

        model.encoder_cache = EncoderCache(max_bytes=64 * 2**20)
        ... model.chat(messages) ...
        print(model.encoder_cache.stats())
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"EncoderCache(max_bytes=...) must be an int >= 0 (0 keeps nothing); got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = self.encoder_calls = self.evictions = self.too_large = 0
        self._entries: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> "EncoderCache":
        """A cache bounded by ``MUSECORE_ENCODER_CACHE_BYTES`` (default 256 MiB)."""
        return cls(cache_bytes_from_env())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Optional[torch.Tensor]:
        """The cached output for ``key`` (now the most recently used), or None. Counts nothing."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: str, value: torch.Tensor) -> bool:
        """Keep ``value`` under ``key``, evicting the least recently used entries to stay within the
        bound. Returns False (and counts ``too_large``) when it is larger than the whole bound."""
        size = tensor_bytes(value)
        with self._lock:
            if key in self._entries:
                self.bytes -= tensor_bytes(self._entries.pop(key))
            if size > self.max_bytes:
                self.too_large += 1
                return False
            while self.bytes + size > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= tensor_bytes(old)
                self.evictions += 1
            self._entries[key] = value
            self.bytes += size
            return True

    def clear(self) -> None:
        """Forget every entry (the counters stay)."""
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes, "hits": self.hits,
                "misses": self.misses, "encoder_calls": self.encoder_calls, "evictions": self.evictions,
                "too_large": self.too_large}

    def encode(self, keys: Sequence[str], encoder: Callable[[list[int]], list[torch.Tensor]]) -> list[torch.Tensor]:
        """The output for each of ``keys``: cached ones reused, the rest computed by one call
        ``encoder(indices)`` (indices into ``keys`` of the first occurrence of each missing key, in
        order), which returns one tensor per index. Repeated keys are encoded once."""
        found: dict[str, torch.Tensor] = {}
        missing: list[int] = []
        pending: set[str] = set()
        with self._lock:
            for i, key in enumerate(keys):
                if key in found or key in pending:
                    self.hits += 1
                    continue
                value = self._entries.get(key)
                if value is None:
                    missing.append(i)
                    pending.add(key)
                    self.misses += 1
                else:
                    self._entries.move_to_end(key)
                    found[key] = value
                    self.hits += 1
            if missing:
                self.encoder_calls += 1
        if missing:  # the encoder runs outside the lock
            outputs = encoder(missing)
            if len(outputs) != len(missing):
                raise ValueError(f"the encoder returned {len(outputs)} outputs for {len(missing)} inputs")
            for i, value in zip(missing, outputs):
                found[keys[i]] = value
                self.put(keys[i], value)
        return [found[key] for key in keys]

    def __repr__(self) -> str:
        return (f"EncoderCache({self.bytes}/{self.max_bytes} bytes, {len(self)} entries, hits={self.hits}, "
                f"misses={self.misses}, encoder_calls={self.encoder_calls})")


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"268435456"``, ``"256M"``/``"256MiB"`` (2**20), ``"256MB"`` (10**6), ``"1G"``, ``"0"`` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with K, M or G (e.g. 256M)")
    return int(float(match.group(1)) * _UNITS[unit])


def cache_bytes_from_env() -> int:
    """``MUSECORE_ENCODER_CACHE_BYTES`` (bytes, or with a K/M/G suffix; 0 = keep nothing), default 256 MiB."""
    raw = os.environ.get(CACHE_BYTES_ENV)
    if raw is None or raw == "":
        return DEFAULT_CACHE_BYTES
    try:
        return parse_bytes(raw)
    except ValueError:
        raise ValueError(f"{CACHE_BYTES_ENV}={raw!r}: set it to a size in bytes (e.g. 268435456, 256M or 1G; 0 "
                         f"keeps nothing), or unset it (default {DEFAULT_CACHE_BYTES // 2**20}M)") from None


def encoder_cache(model: Any) -> EncoderCache:
    """The model's cache (``model.encoder_cache``), made from the environment on first use."""
    cache = getattr(model, "encoder_cache", None)
    if cache is None:
        cache = EncoderCache.from_env()
        model.encoder_cache = cache
    return cache


# -- messages and their parts ----------------------------------------------------------------------

@dataclass
class MediaPart:
    """One media item of a conversation: its kind, the value to load, and where it was given."""

    kind: str
    source: Any
    where: str  # "message 0, part 1", for errors
    sampling_rate: Optional[int] = None  # audio arrays only


def parse_messages(messages: Any, conversation: Optional[int] = None) -> tuple[list[dict], list[MediaPart]]:
    """``(messages for the template, media parts in order)``. The template sees each media part as
    ``{"type": "image"|"video"|"audio"}`` (the OpenAI shapes too) and text parts unchanged.
    Raises ValueError naming the message and part on a shape it does not know."""
    from musecore.chat import check_messages

    check_messages(messages)
    at = f"conversation {conversation}, " if conversation is not None else ""
    rendered: list[dict] = []
    parts: list[MediaPart] = []
    for i, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, str):
            rendered.append(dict(message))
            continue
        new_content = []
        for j, part in enumerate(content):
            where = f"{at}message {i}, part {j}"
            kind, item = _parse_part(part, where)
            if item is None:
                new_content.append(dict(part))
            else:
                parts.append(item)
                new_content.append({"type": kind})
        rendered.append({**message, "content": new_content})
    return rendered, parts


def _parse_part(part: Any, where: str) -> tuple[str, Optional[MediaPart]]:
    if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
        raise ValueError(f'{where}: a content part must be a dict with a str "type" (one of {", ".join(PART_TYPES)}); '
                         f"got {_short(part)}")
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError(f'{where}: a "text" part needs a str "text"; got {_short(part)}')
        return kind, None
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, Mapping) else value
        if not isinstance(url, str) or not url:
            raise ValueError(f'{where}: an "image_url" part needs {{"image_url": {{"url": "data:image/...;base64,..." '
                             f"or a local path}}}}; got {_short(part)}")
        return "image", MediaPart("image", _local_url(url), where)
    if kind == "input_audio":
        value = part.get("input_audio")
        if not isinstance(value, Mapping) or not isinstance(value.get("data"), str):
            raise ValueError(f'{where}: an "input_audio" part needs {{"input_audio": {{"data": base64, "format": '
                             f'"wav"}}}}; got {_short(part)}')
        return "audio", MediaPart("audio", dict(value), where)
    if kind not in SOURCE_KEYS:
        raise ValueError(f"{where}: unknown content part type {kind!r}; use one of {', '.join(PART_TYPES)}")
    keys = [k for k in SOURCE_KEYS[kind] if part.get(k) is not None]
    if len(keys) != 1:
        got = "none" if not keys else " and ".join(repr(k) for k in keys)
        raise ValueError(f'{where}: an "{kind}" part needs exactly one of '
                         f"{', '.join(repr(k) for k in SOURCE_KEYS[kind])} (got {got})")
    value = part[keys[0]]
    if keys[0] == "base64":
        value = _base64_bytes(value, where)
    elif keys[0] == "url" and isinstance(value, str):
        value = _local_url(value)
    rate = part.get("sampling_rate")
    if rate is not None and (kind != "audio" or isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0):
        raise ValueError(f'{where}: "sampling_rate" is for audio arrays and must be an int > 0; got {rate!r}')
    return kind, MediaPart(kind, value, where, rate)


def _local_url(url: str) -> Any:
    """``file://`` URLs become paths; other strings (paths, ``data:`` URLs, http) go to the loader as given."""
    return Path(url[len("file://"):]) if url.startswith("file://") else url


def _base64_bytes(value: Any, where: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str) and value.startswith("data:"):
        value = value.split(",", 1)[-1]
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise ValueError(f'{where}: "base64" is not valid base64 text; give the file\'s bytes base64-encoded') from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def has_media(messages: Any) -> bool:
    """Whether any message has a content part other than text (cheap: parses nothing)."""
    if not isinstance(messages, (list, tuple)):
        return False
    return any(isinstance(m, Mapping) and isinstance(m.get("content"), list)
               and any(not (isinstance(p, Mapping) and p.get("type") == "text") for p in m["content"])
               for m in messages)


# -- prompt and features ---------------------------------------------------------------------------

@dataclass
class _Item:
    """A processed media item: what the encoder takes for it and the key of its output."""

    kind: str
    key: str
    inputs: tuple  # image/video: (pixel rows [p,1176], grid_thw [3]); audio: (samples [n],)
    rows: int  # placeholder tokens in its expansion = feature rows it must get
    label: str


@dataclass
class Prepared:
    """Token ids of each conversation (no padding) and the media to splice into them.

    ``features(model)`` encodes the media (through the model's :class:`EncoderCache`) and returns
    ``{placeholder token id: rows [n, H]}`` for ``model.forward(..., media=)``, rows in the order
    the placeholders occur, row-major over the batch; None when there is no media.
    """

    ids: list[list[int]]
    texts: list[str]
    items: list[_Item] = field(default_factory=list)
    audio_width: int = 0  # the processor's padded width for this batch's audio

    @property
    def has_media(self) -> bool:
        return bool(self.items)

    @classmethod
    def join(cls, parts: Sequence["Prepared"]) -> "Prepared":
        """One batch of several prepared batches, in order (their towers then run once per kind)."""
        return cls([i for p in parts for i in p.ids], [t for p in parts for t in p.texts],
                   [it for p in parts for it in p.items], max((p.audio_width for p in parts), default=0))

    def split(self, media: Optional[Mapping[int, torch.Tensor]], sizes: Sequence["Prepared"],
              config: Any) -> list[Optional[dict[int, torch.Tensor]]]:
        """``media`` of a :meth:`join`-ed batch cut back into each part's own mapping."""
        out: list[Optional[dict[int, torch.Tensor]]] = []
        offsets = dict.fromkeys(KINDS, 0)
        for part in sizes:
            mine: dict[int, torch.Tensor] = {}
            for kind in KINDS:
                rows = sum(it.rows for it in part.items if it.kind == kind)
                if rows:
                    token = placeholder_id(config, kind)
                    mine[token] = media[token][offsets[kind]:offsets[kind] + rows]
                    offsets[kind] += rows
            out.append(mine or None)
        return out

    def features(self, model: Any) -> Optional[dict[int, torch.Tensor]]:
        if not self.items:
            return None
        cache = encoder_cache(model)
        media: dict[int, torch.Tensor] = {}
        for kind in KINDS:
            items = [it for it in self.items if it.kind == kind]
            if not items:
                continue

            def encode(indices: list[int], kind: str = kind, items: list[_Item] = items) -> list[torch.Tensor]:
                return _run_encoder(model, kind, [items[i] for i in indices], self.audio_width)

            outputs = cache.encode([it.key for it in items], encode)
            for item, out in zip(items, outputs):
                if out.shape[0] != item.rows:
                    raise ValueError(f"{item.label}: the {TOWER[kind]} tower gave {out.shape[0]} feature rows but its "
                                     f"placeholder has {item.rows} tokens: the processor's settings do not match the "
                                     "model's tower config (preprocessor_config.json vs config.json)")
            media[placeholder_id(model.config, kind)] = torch.cat(outputs, 0)
        return media


def placeholder_id(config: Any, kind: str) -> int:
    return int(getattr(config, f"{kind}_token_id"))


def _run_encoder(model: Any, kind: str, items: list[_Item], audio_width: int) -> list[torch.Tensor]:
    device = model.device
    if kind == "audio":
        width = max(audio_width, max(it.inputs[0].shape[0] for it in items))
        values = torch.zeros(len(items), width, dtype=torch.float32)
        mask = torch.zeros(len(items), width, dtype=torch.bool)
        for b, it in enumerate(items):
            n = it.inputs[0].shape[0]
            values[b, :n], mask[b, :n] = it.inputs[0], True
        return list(model.encode_audio(values.to(device), mask.to(device)))
    pixels = torch.cat([it.inputs[0] for it in items], 0).to(device)
    grid = torch.stack([it.inputs[1] for it in items], 0).to(device)
    encode = model.encode_images if kind == "image" else model.encode_videos
    return list(encode(pixels, grid))


def media_processor(model: Any) -> Any:
    """The model's :class:`musecore.media.MediaProcessor` (``model.media_processor``), read from its
    checkpoint folder on first use."""
    processor = getattr(model, "media_processor", None)
    if processor is None:
        from musecore.media import MediaProcessor

        folder = Path(model.tokenizer.source).parent if getattr(model, "tokenizer", None) is not None else None
        processor = MediaProcessor.from_pretrained(folder, model.config)
        model.media_processor = processor
    return processor


def checkpoint_name(model: Any) -> str:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None and getattr(tokenizer, "source", None):
        return str(Path(tokenizer.source).parent)
    return "this checkpoint"


def check_towers(model: Any, parts: Sequence[MediaPart]) -> None:
    """A media part for a tower the checkpoint lacks is an error naming the checkpoint and the part."""
    for part in parts:
        tower = TOWER[part.kind]
        if getattr(model, tower, None) is not None:
            continue
        if hasattr(model, "missing_tower"):  # the model says why (the plan's reason, or no tensors)
            why = str(model.missing_tower(tower, f"{part.kind} input"))
        else:
            why = f"{checkpoint_name(model)} has no {tower} tower, so it cannot take {part.kind} input"
        raise ValueError(f"{part.where}: {why}; use a checkpoint with a {tower} tower (e.g. muse-tiny-mm), or "
                         "leave the media out")


def prepare(model: Any, conversations: Sequence[Sequence[Mapping[str, Any]]],
            add_generation_prompt: bool = True) -> Prepared:
    """Render, expand, tokenize and process a batch of conversations (see the module docstring).

    Media is loaded and processed here; the towers run later, in :meth:`Prepared.features`.
    Raises ValueError (``musecore.media.MediaError`` for bad media) naming the message and part.
    """
    from musecore.chat import chat_template_of

    tokenizer, template = chat_template_of(model)
    several = len(conversations) > 1
    parsed = [parse_messages(c, i if several else None) for i, c in enumerate(conversations)]
    texts = [template.render(messages, add_generation_prompt) for messages, _ in parsed]
    parts = [p for _, ps in parsed for p in ps]
    if not parts:
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return Prepared(ids, texts)
    check_towers(model, parts)
    processor = media_processor(model)
    strings = processor.token_strings
    for kind in {p.kind for p in parts}:
        _check_placeholder_token(model, kind, strings[kind])
    for c, ((_, ps), text) in enumerate(zip(parsed, texts)):
        for kind in KINDS:
            given, emitted = sum(p.kind == kind for p in ps), text.count(strings[kind])
            if given != emitted:
                at = f"conversation {c}: " if several else ""
                raise ValueError(f"{at}the chat template ({template.origin}) wrote {emitted} {kind} placeholders "
                                 f"({strings[kind]}) for {given} {kind} parts: each {kind} part must appear once in "
                                 "the rendered text, and text may not contain the placeholder itself")
    expansions, items, audio_width = _process(processor, parts)
    texts = _expand(texts, strings, expansions)
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return Prepared(ids, texts, items, audio_width)


def _check_placeholder_token(model: Any, kind: str, string: str) -> None:
    tokenizer, wanted = model.tokenizer, placeholder_id(model.config, kind)
    have = tokenizer.token_id(string) if tokenizer.has_token(string) else None
    if have != wanted:
        found = f"id {have}" if have is not None else "no single token"
        raise ValueError(f"{tokenizer.source}: the {kind} placeholder {string!r} is {found} in the tokenizer but "
                         f"config.json's {kind}_token_id is {wanted}: the tokenizer and config belong to different "
                         "checkpoints")


def _process(processor: Any, parts: list[MediaPart]) -> tuple[dict[str, list[str]], list[_Item], int]:
    """Load and process every item (per kind, as one batch, like transformers); per-kind expansions in order."""
    expansions: dict[str, list[str]] = {kind: [] for kind in KINDS}
    items: list[_Item] = []
    audio_width = 0
    for kind in KINDS:
        mine = [p for p in parts if p.kind == kind]
        if not mine:
            continue
        loaded = [_load(processor, p, n) for n, p in enumerate(mine, 1)]
        token = processor.token_strings[kind]
        if kind == "audio":
            inputs = processor.audio(loaded)
            audio_width = int(inputs.input_values.shape[1])
            lengths = inputs.mask.sum(-1).tolist()
            per_item = [(inputs.input_values[i, :n].contiguous(),) for i, n in enumerate(lengths)]
        else:
            inputs = processor.images(loaded) if kind == "image" else processor.videos(loaded)
            sizes = inputs.grid_thw.prod(-1).tolist()
            rows = inputs.pixel_values.split(sizes, 0)
            per_item = [(r.contiguous(), g) for r, g in zip(rows, inputs.grid_thw)]
        for n, (part, tensors) in enumerate(zip(mine, per_item)):
            expansion = processor.placeholder(kind, inputs, n)
            expansions[kind].append(expansion)
            items.append(_Item(kind, content_key(kind, tensors), tensors, expansion.count(token),
                               f"{kind} #{n + 1} ({part.where})"))
    return expansions, items, audio_width


def _load(processor: Any, part: MediaPart, number: int) -> Any:
    """The loaded item (with the checkpoint's settings: video frame sampling, audio rate); a
    MediaError names it by path (or number) and by message and part."""
    src = part.source
    shown = os.fspath(src) if isinstance(src, (str, Path)) and not str(src).startswith("data:") else f"#{number}"
    name = f"{shown} ({part.where})"
    if part.kind == "image":
        return processor.load_image(src, name=name)
    if part.kind == "video":
        return processor.load_video(src, name=name)
    return processor.load_audio(src, sampling_rate=part.sampling_rate, name=name)


def content_key(kind: str, tensors: tuple) -> str:
    """SHA-256 of the kind and the processed input tensors (dtype, shape and bytes)."""
    digest = hashlib.sha256(kind.encode())
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        digest.update(f"|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, not a copy
    return digest.hexdigest()


def _expand(texts: list[str], strings: Mapping[str, str], expansions: Mapping[str, list[str]]) -> list[str]:
    """Each placeholder string, in text order over the batch, becomes its kind's next expansion
    (transformers' ``ProcessorMixin.get_text_with_replacements``)."""
    kinds = [k for k in KINDS if expansions.get(k)]
    pattern = re.compile("|".join(f"(?P<{k}>{re.escape(strings[k])})" for k in kinds))
    queues = {k: iter(expansions[k]) for k in kinds}
    return [pattern.sub(lambda m: next(queues[m.lastgroup]), text) for text in texts]
