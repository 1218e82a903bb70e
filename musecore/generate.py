"""Autoregressive generation: prefill once, then one token per step through the KV cache.

Why it looks like this:

- One code path for one prompt and for a batch. A batch of prompts of different lengths is
  left-padded; padding tokens get position ``-1``, which the attention op treats as "attends to
  nothing, seen by nothing" and the cache never stores, so every row runs the same operations it
  would alone. Not bit for bit, though: see "Batching" in :func:`generate`. Each row then
  continues from its own next position; a finished row is fed position ``-1`` so it stops
  touching the cache.
- Logits that are NaN or Inf at the prefill or the first decode step raise
  :class:`NonFiniteLogitsError` (broken weights or numerics) instead of producing tokens.
- One KV cache sized ``longest prompt + max_new_tokens``: no reallocation while decoding.
- Token choice always goes through ``model.ops.sample`` (greedy at temperature 0), so a backend
  that fuses sampling gets it for free, and a seeded ``torch.Generator`` makes sampling
  reproducible without touching the global RNG.
- Streaming never shows text it may have to take back: text that could still become a stop
  string, or an unfinished UTF-8 character, is held until it is settled, so the streamed pieces
  always concatenate to exactly the returned text.

Timing of the last call is kept on ``model.last_generation_stats`` (a :class:`GenerationStats`),
so ``generate`` keeps the plain "str in -> str out" signature of DESIGN.md.
"""

from __future__ import annotations

import numbers
import operator
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

Prompt = Union[str, Sequence[int], Sequence[str], Sequence[Sequence[int]], Sequence[Mapping[str, Any]],
               Sequence[Sequence[Mapping[str, Any]]]]
Media = Mapping[int, torch.Tensor]  # {placeholder token id: feature rows [n, H]}, see MuseModel.forward
Stop = Union[str, int, Sequence[Union[str, int]], None]
REPLACEMENT_CHAR = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


@dataclass
class GenerationStats:
    """What the last :func:`generate` call did, for throughput reports (``musecore generate``).

    ``new_tokens`` counts every token the model produced, including an EOS or stop token that
    ended a sequence (it is not returned, but it was computed). ``decode_tokens`` are those that
    came from decode steps (the first token of each sequence comes from the prefill).
    """

    batch_size: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    setup_seconds: float = 0.0  # making the decode step (a CUDA-graph capture), not in decode_seconds

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "prefill_seconds": self.prefill_seconds, "decode_seconds": self.decode_seconds,
                "decode_tokens": self.decode_tokens, "decode_tokens_per_s": self.decode_tokens_per_s,
                "setup_seconds": self.setup_seconds}


# -- inputs ---------------------------------------------------------------------------------------

def _is_token_id(x: Any) -> bool:
    """An integer (``int``, ``numpy.int64``, any ``numbers.Integral``) but not a bool. Callers convert what
    passes with ``operator.index`` so that only Python ints go further."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_conversation(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, Mapping) for m in x)


def _normalise_prompt(prompt: Prompt) -> tuple[list[Any], str, bool]:
    """-> (prompts, mode, is_batch), mode "text", "ids" or "chat" (messages). Raises on anything else."""
    usage = ("prompt must be a str, a list[int] of token ids, a list of chat messages (dicts with role and "
             "content), or a list of any one of these (a batch)")
    if isinstance(prompt, str):
        return [prompt], "text", False
    if isinstance(prompt, torch.Tensor):
        raise TypeError(f"{usage}; got a tensor: pass prompt.tolist()")
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"{usage}; got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError("prompt is empty: give at least one token (or one prompt in a batch)")
    if all(_is_token_id(x) for x in prompt):
        return [[operator.index(x) for x in prompt]], "ids", False
    if all(isinstance(x, Mapping) for x in prompt):
        return [list(prompt)], "chat", False
    if all(isinstance(x, str) for x in prompt):
        return list(prompt), "text", True
    if all(isinstance(x, (list, tuple)) and all(_is_token_id(t) for t in x) for x in prompt):
        return [[operator.index(t) for t in x] for x in prompt], "ids", True
    if all(_is_conversation(x) for x in prompt):
        return [list(x) for x in prompt], "chat", True
    kinds = sorted({type(x).__name__ for x in prompt})
    raise TypeError(f"{usage}; got a list mixing {kinds}")


SEEDS = (-(1 << 63), 1 << 64)  # the seeds torch.Generator.manual_seed takes: [low, high)


def _validate_options(max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                      seed: Optional[int] = None) -> tuple[int, float, float, int, Optional[int]]:
    """Raise ValueError on a bad option; return the options with integers as Python ints (numpy's too).
    Needs no model: ``musecore generate`` / ``chat`` call it before loading the weights."""
    if not _is_token_id(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
    if not 0 <= temperature < float("inf"):  # also rejects NaN
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off); got {top_p!r}")
    if not _is_token_id(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off); got {top_k!r}")
    if seed is not None and (not _is_token_id(seed) or not SEEDS[0] <= seed < SEEDS[1]):
        raise ValueError(f"seed must be an int in [{SEEDS[0]}, {SEEDS[1]}) (or None: torch's global RNG); got {seed!r}")
    return (operator.index(max_new_tokens), float(temperature), float(top_p), operator.index(top_k),
            None if seed is None else operator.index(seed))


def _eos_ids(model: Any) -> set[int]:
    ids: set[int] = set()
    configured = getattr(model.config, "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    if model.tokenizer is not None:
        ids.update(model.tokenizer.eos_ids)
    return {int(i) for i in ids}


def _split_stop(stop: Stop, tokenizer: Any, is_text: bool) -> tuple[set[int], list[str]]:
    """Stop ids and stop strings. With id prompts a stop string must be one vocabulary token."""
    if stop is None:
        return set(), []
    items = [stop] if isinstance(stop, str) or _is_token_id(stop) else stop
    if not isinstance(items, (list, tuple, set)):
        raise TypeError(f"stop must be a str, an int token id, or a list of them; got {type(stop).__name__}")
    ids: set[int] = set()
    strings: list[str] = []
    for item in items:
        if _is_token_id(item):
            ids.add(operator.index(item))
        elif isinstance(item, str) and item:
            if is_text:
                strings.append(item)
            elif tokenizer is not None and tokenizer.has_token(item):
                ids.add(tokenizer.token_id(item))
            else:
                raise ValueError(f"stop string {item!r} with a token-id prompt: it is not a single token of the "
                                 "vocabulary, so it cannot be matched on ids; pass a str prompt or stop token ids")
        elif isinstance(item, str):
            raise ValueError("a stop string must not be empty (it would stop before the first token)")
        else:
            raise TypeError(f"each stop must be a non-empty str or an int token id; got {item!r}")
    return ids, strings


def _check_text(texts: list[Any], model: Any) -> None:
    """Text prompts must be encodable UTF-8 (a command-line argument with invalid bytes arrives as
    lone surrogates), and the tokenizer must not know more tokens than the model has."""
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            where = f"prompt {i}" if len(texts) > 1 else "the prompt"
            bad = text[err.start]
            byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
            raise ValueError(f"{where} is not valid UTF-8 text ({byte} at character {err.start}); pass UTF-8 "
                             "text, or token ids") from None
    have, vocab = model.tokenizer.vocab_size, model.config.vocab_size
    if have > vocab:
        raise ValueError(f"the tokenizer has {have} tokens but the model's vocab_size is {vocab} (config.json): "
                         "tokenizer.json belongs to another model; use the checkpoint's own tokenizer.json")


def _encode_text(model: Any, text: str) -> list[int]:
    """A text prompt framed as training documents were: BOS first, unless the text starts with it."""
    tokenizer = model.tokenizer
    ids = tokenizer.encode(text)
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else model.config.bos_token_id
    if bos is not None and not 0 <= bos < model.config.vocab_size:  # (not the prompt's fault: say whose it is)
        raise ValueError(f"bos_token_id {bos} (config.json or generation_config.json) is outside the vocabulary "
                         f"(vocab_size {model.config.vocab_size}): fix it to the id the tokenizer gives the BOS token")
    return [int(bos)] + ids if bos is not None and ids[:1] != [bos] else ids


def _check_lengths(prompts: list[list[int]], max_new_tokens: int, config: Any) -> None:
    limit, vocab = config.max_position_embeddings, config.vocab_size
    for i, ids in enumerate(prompts):
        where = f"prompt {i}" if len(prompts) > 1 else "the prompt"
        if not ids:
            raise ValueError(f"{where} is empty: give at least one token")
        if len(ids) > limit:
            raise ValueError(f"{where} has {len(ids)} tokens, longer than max_position_embeddings {limit}; "
                             "shorten it")
        if len(ids) + max_new_tokens > limit:
            raise ValueError(f"{where} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} the sequence "
                             f"would exceed max_position_embeddings {limit}; "
                             f"lower max_new_tokens to at most {limit - len(ids)}")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise _outside_vocabulary(where, bad, vocab)


def _outside_vocabulary(where: str, bad: list[int], vocab: int) -> ValueError:
    return ValueError(f"{where} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")


ID_DTYPES = (torch.long, torch.int32)  # what the embedding takes


def check_input_ids(input_ids: Any, vocab: int) -> None:
    """``MuseModel.forward``'s input check: ``input_ids`` must be a non-empty integer tensor ``[B,T]`` of
    ids in ``[0, vocab)``. The type, dtype and shape checks read only metadata; the ids' range is checked
    only on a CPU tensor, where reading the values waits for no device (see ``MuseModel.forward``), and not while
    ``torch.compile`` / ``torch.export`` traces ``forward`` (the TPU backend's compiled step)."""
    if not isinstance(input_ids, torch.Tensor):
        hint = ": wrap them, torch.tensor([ids])" if isinstance(input_ids, (list, tuple)) else ""
        raise TypeError(f"input_ids must be a torch.Tensor of token ids [batch, tokens]; got "
                        f"{type(input_ids).__name__}{hint}")
    if input_ids.dtype not in ID_DTYPES:
        raise TypeError(f"input_ids must hold integer token ids (torch.long); got dtype {input_ids.dtype}: "
                        "pass input_ids.long()")
    if input_ids.dim() != 2:
        hint = ": for one sequence pass input_ids[None]" if input_ids.dim() == 1 else ""
        raise ValueError(f"input_ids must be 2-D [batch, tokens]; got shape {list(input_ids.shape)}{hint}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {list(input_ids.shape)}): give at least one token per row")
    if input_ids.device.type == "cpu" and not torch.compiler.is_compiling():  # (a traced step has no values)
        low, high = torch.aminmax(input_ids)
        if int(low) < 0 or int(high) >= vocab:
            bad = input_ids[(input_ids < 0) | (input_ids >= vocab)].unique().tolist()
            raise _outside_vocabulary("input_ids", bad, vocab)


# -- non-finite logits ---------------------------------------------------------------------------

DEBUG_ENV = "MUSECORE_DEBUG"


class NonFiniteLogitsError(ValueError):
    """The model produced NaN or Inf logits: broken weights (or numerics), never a token to return."""


def check_finite_logits(model: Any, logits: torch.Tensor, when: str,
                        sequence: Optional[Callable[[], tuple[torch.Tensor, torch.Tensor]]] = None,
                        live: Optional[torch.Tensor] = None) -> None:
    """Raise :class:`NonFiniteLogitsError` when a row of ``logits [B,V]`` (a live row, when ``live``
    is given) holds NaN or Inf. With ``MUSECORE_DEBUG=1``, ``sequence()`` gives the tokens so far
    (``ids``, ``positions [B,T]``, padding at -1) and the message names the first layer whose output
    is non-finite on them (:func:`first_non_finite_stage`)."""
    finite = torch.isfinite(logits).all(dim=-1)  # [B]
    if live is not None:
        finite = finite | ~live
    if bool(finite.all()):
        return
    raise_non_finite(model, (~finite).nonzero().flatten().tolist(), when, sequence)


def raise_non_finite(model: Any, rows: list[int], when: str,
                     sequence: Optional[Callable[[], tuple[torch.Tensor, torch.Tensor]]] = None) -> None:
    """Raise :class:`NonFiniteLogitsError` for the batch ``rows`` whose logits are NaN/Inf at ``when``
    (:func:`check_finite_logits`'s message, for callers that tested finiteness on the device themselves)."""
    where = f"rows {rows[:8]}" if len(rows) > 1 else f"row {rows[0]}"
    if os.environ.get(DEBUG_ENV, "") not in ("", "0") and sequence is not None:
        found = first_non_finite_stage(model, *sequence())
        located = f"; the first non-finite output is {found}" if found else "; every layer's output is finite " \
            "when the prompt is recomputed without the KV cache (the cache or a decode kernel is at fault)"
    else:
        located = f"; set {DEBUG_ENV}=1 to name the first layer whose output is non-finite"
    raise NonFiniteLogitsError(f"the model's logits are NaN/Inf at {when} ({where} of the batch): its weights or "
                               f"numerics are broken, so no token is generated{located}")


def first_non_finite_stage(model: Any, ids: torch.Tensor, positions: Optional[torch.Tensor],
                           media: Optional[Media] = None) -> Optional[str]:
    """Recompute the prompt stage by stage (embedding, each layer's attention and MLP, lm_head) without a
    KV cache and name the first stage whose output has a NaN or Inf on a real (non-padding) token.
    ``media``: the prefill's features, spliced into the embedding as the prefill did."""
    prefix = "model.language_model."
    real = (positions >= 0) if positions is not None else torch.ones(ids.shape, dtype=torch.bool)
    real = real.to(model.device)

    def bad(*tensors: torch.Tensor) -> bool:
        return any(not bool(torch.isfinite(t[real]).all()) for t in tensors)

    with torch.inference_mode():
        x, a, pos, rope = model.embed(ids, positions, None, media) if media else model.embed(ids, positions)
        if bad(x, a):
            where = "the embedding or the media features spliced into it" if media else "the embedding"
            return f"{where} ({prefix}embed_tokens, or layer 0's input_layernorm)"
        for i in range(len(model.layers)):
            h, m = model.attention_sublayer(i, x, a, pos, rope)
            if bad(h, m):
                return f"layer {i}'s attention ({prefix}layers.{i}.self_attn and its residual norms)"
            x, a = model.feedforward_sublayer(i, h, m)
            if bad(x, a):
                return f"layer {i}'s MLP ({prefix}layers.{i}.mlp and its residual norms)"
        if bad(model.logits(a)):
            return "the lm_head (lm_head.weight)"
    return None


# -- one sequence's output ------------------------------------------------------------------------

class _Sequence:
    """The tokens, text and streaming state of one row of the batch.

    Text is detokenized incrementally, as vLLM does: each step decodes only the tokens since the
    last settled point plus a few before them (starting with the prompt's last tokens, so decoders
    that drop a leading space see context), which keeps a long generation O(length), not O(length^2).
    """

    CONTEXT_TOKENS = 5

    def __init__(self, index: int, tokenizer: Any, stop_strings: list[str],
                 emit: Optional[Callable[[int, Any], None]], context: Sequence[int] = ()) -> None:
        self.index, self.tokenizer, self.stop_strings, self.emit = index, tokenizer, stop_strings, emit
        self.ids: list[int] = []
        self.text = ""      # text mode: decoded new tokens, cut before a stop string once one appears
        self.emitted = 0    # text mode: characters of self.text already streamed
        self.done = False
        self._window = list(context[-self.CONTEXT_TOKENS:])  # context + new ids: what gets decoded
        self._prefix_offset, self._read_offset = 0, len(self._window)
        self._settled = ""  # text of the new ids up to _read_offset, which will not change

    def add(self, token: int) -> None:
        """Append a token that is part of the output (not EOS / a stop id)."""
        self.ids.append(token)
        if self.tokenizer is None:
            if self.emit is not None:
                self.emit(self.index, token)
            return
        full = self._detokenize(token)
        cut = min((i for i in (full.find(s, self.emitted) for s in self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.done = full[:cut], True
            return
        self.text = full
        self._stream(len(full) - self._unsettled(full))

    def _detokenize(self, token: int) -> str:
        """The text of all new ids, decoding only the window since the last settled point."""
        self._window.append(token)
        decode = self.tokenizer.decode
        before = decode(self._window[self._prefix_offset:self._read_offset])
        after = decode(self._window[self._prefix_offset:])
        new = after[len(before):]
        if not new or new.endswith(REPLACEMENT_CHAR):  # nothing yet, or an unfinished character
            return self._settled + new
        self._settled += new
        self._prefix_offset, self._read_offset = self._read_offset, len(self._window)
        if self._prefix_offset > 64:  # tokens before the prefix are never decoded again
            del self._window[:self._prefix_offset]
            self._prefix_offset, self._read_offset = 0, self._read_offset - self._prefix_offset
        return self._settled

    def finish(self) -> None:
        self.done = True
        if self.tokenizer is not None:
            self._stream(len(self.text))

    def _unsettled(self, text: str) -> int:
        """Trailing characters that may still change: a partial stop string or a partial character."""
        hold = 0
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        stripped = len(text) - len(text.rstrip(REPLACEMENT_CHAR))
        return max(hold, stripped)

    def _stream(self, upto: int) -> None:
        # Text already streamed is never revised: only settled text (see _unsettled) is sent.
        if upto > self.emitted:
            piece, self.emitted = self.text[self.emitted:upto], upto
            if self.emit is not None:
                self.emit(self.index, piece)


# -- the loop -------------------------------------------------------------------------------------

def generate(model: Any, prompt: Prompt, max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None, stop: Stop = None,
             stream: Optional[Callable[..., None]] = None, kv_format: Optional[str] = None,
             media: Optional[Media] = None) -> Any:
    """Continue ``prompt`` with up to ``max_new_tokens`` new tokens; return only the new part.

    - ``str`` -> ``str`` (needs ``model.tokenizer``); ``list[int]`` -> ``list[int]``;
      ``list[str]`` -> ``list[str]`` and ``list[list[int]]`` -> ``list[list[int]]`` (a batch).
      A text prompt gets the BOS id (``bos_token_id``) first, as training documents did, unless
      it already starts with it; token-id prompts are used exactly as given.
    - Chat messages (``[{"role": "user", "content": ...}]``) -> the assistant's reply as ``str``; a
      list of conversations -> ``list[str]``. The checkpoint's chat template renders them, and
      content parts may carry images, video and audio (:mod:`musecore.multimodal`): their encoder
      outputs replace the placeholders at the prefill. The reply ends at the template's end token.
    - ``media`` (``{placeholder token id: feature rows [n, H]}``) is spliced into a str or id
      prompt's placeholders at the prefill (``MuseModel.forward(media=)``); messages carry their own.
    - ``temperature=0`` is greedy; otherwise sampling with ``top_k`` (0 = off) and ``top_p``
      (1 = off). ``seed`` seeds a private ``torch.Generator``: same seed, same output. Without a
      seed, sampling draws from torch's global RNG.
    - A sequence ends at an EOS id (config ``eos_token_id``, tokenizer ``<|eot|>``/``<|eom|>``)
      or a ``stop``: token ids and/or strings (one, or a list). The EOS / stop token is not
      returned, and the text is cut just before a stop string. With id prompts a stop string must
      be one vocabulary token (e.g. ``"<|eot|>"``).
    - ``stream(piece)`` gets each new text piece (str prompts) or token id (id prompts) as soon as
      it is settled; for a batch, ``stream(index, piece)``. The pieces join to the return value.
    - ``kv_format`` (``"bf16"`` / ``"fp8"``) defaults to the one the plan chose (``model.kv_format``).
    - Timing is left on ``model.last_generation_stats`` (:class:`GenerationStats`).
    - NaN/Inf logits at the prefill or the first decode step raise :class:`NonFiniteLogitsError`;
      with ``MUSECORE_DEBUG=1`` it names the first layer whose output is non-finite.

    Batching: the same batch run twice gives bit-identical results, and each row runs the same
    operations as that prompt alone, but not bit for bit: kernels of another shape (a longer padded
    key axis, more rows in a matrix product) round differently, and BF16 activations carry a
    one-ulp difference through the layers. On muse-tiny (reference backend, 16 prompts) the prefill
    logits of a batch are within 0.46 of one-by-one in BF16 and within 2.3e-5 with
    ``dtype=torch.float32``; greedy rows agree with one-by-one until a step where the two best
    logits are that close (a near tie), and may differ after it. For results identical to
    one-by-one, generate one prompt at a time.

    Example::

        text = generate(model, "def fib(n):", max_new_tokens=32, stop="\\n\\n")
        ids = generate(model, [1, 2, 3], temperature=0.8, top_p=0.95, seed=0)
        outs = generate(model, ["a short one", "a much longer prompt"], stream=lambda i, s: print(i, s))
    """
    max_new_tokens, temperature, top_p, top_k, seed = _validate_options(max_new_tokens, temperature, top_p, top_k,
                                                                        seed)
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be a callable (piece) or (index, piece), or None; got {type(stream).__name__}")
    prompts, mode, is_batch = _normalise_prompt(prompt)
    is_text = mode != "ids"
    tokenizer = model.tokenizer
    if mode == "text" and tokenizer is None:
        raise ValueError("this model has no tokenizer (its checkpoint has no tokenizer.json), so it cannot take "
                         "text: pass token ids (list[int]) instead, or add tokenizer.json to the checkpoint")
    stop_ids, stop_strings = _split_stop(stop, tokenizer, is_text)
    prepared = None
    if mode == "chat":
        if media is not None:
            raise ValueError("media= is for str and token-id prompts; chat messages carry their media as content "
                             'parts ({"type": "image", "path": ...})')
        from musecore.chat import end_ids
        from musecore.multimodal import prepare
        prepared = prepare(model, prompts)
        prompt_ids = prepared.ids
        stop_ids |= set(end_ids(model))
    elif mode == "text":
        _check_text(prompts, model)
        prompt_ids = [_encode_text(model, p) for p in prompts]
    else:
        prompt_ids = prompts
    _check_lengths(prompt_ids, max_new_tokens, model.config)
    from musecore.distributed import agree_request  # across ranks: every rank asked the same, or one error line
    agree_request(getattr(model, "comm", None), prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, stop,
                  kv_format)
    if prepared is not None:
        media = prepared.features(model)  # the towers run here (or their outputs come from the cache)
    ends = _eos_ids(model) | stop_ids
    kv_format = kv_format or getattr(model, "kv_format", None) or "bf16"

    emit = None
    if stream is not None:
        emit = (lambda i, piece: stream(i, piece)) if is_batch else (lambda i, piece: stream(piece))
    rows = [_Sequence(i, tokenizer if is_text else None, stop_strings, emit, context=p)
            for i, p in enumerate(prompt_ids)]
    stats = GenerationStats(batch_size=len(rows), prompt_tokens=sum(map(len, prompt_ids)))
    model.last_generation_stats = stats
    if max_new_tokens > 0:
        with torch.inference_mode():
            _decode_loop(model, prompt_ids, rows, ends, max_new_tokens, temperature, top_p, top_k, seed,
                         kv_format, stats, media)
    for row in rows:
        row.finish()
    outputs = [row.text if is_text else row.ids for row in rows]
    return outputs if is_batch else outputs[0]


def _decode_loop(model: Any, prompt_ids: list[list[int]], rows: list[_Sequence], ends: set[int],
                 max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: Optional[int],
                 kv_format: str, stats: GenerationStats, media: Optional[Media] = None) -> None:
    device, B = model.device, len(prompt_ids)
    # R >= B rows run: a backend that compiles its decode step per batch shape pads the batch to its bucket;
    # rows B.. are padding throughout (position -1: they see nothing and nothing sees them) and never read.
    R = model.generation_rows(B) if hasattr(model, "generation_rows") else B
    longest = max(map(len, prompt_ids))
    pad = getattr(model.tokenizer, "pad_id", None)
    pad = pad if pad is not None and 0 <= pad < model.config.vocab_size else 0  # position -1 hides it anyway
    ids = torch.full((R, longest), pad, dtype=torch.long)
    positions = torch.full((R, longest), -1, dtype=torch.long)  # -1: padding, attends to nothing
    for b, p in enumerate(prompt_ids):
        ids[b, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        positions[b, longest - len(p):] = torch.arange(len(p))
    next_position = torch.tensor([len(p) for p in prompt_ids] + [0] * (R - B), dtype=torch.long)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(int(seed))
    cache = model.generation_cache(R, longest + max_new_tokens, kv_format=kv_format)
    step_fn = None  # made after the prefill: a backend may capture the decode step (CUDA graphs)
    sample = lambda logits: model.ops.sample(logits, temperature, top_k, top_p, generator)  # noqa: E731
    fetch = _TokenFetch(R, torch.device(device))

    start = time.perf_counter()
    # Media features replace their placeholders' embeddings at the prefill only: decode steps feed
    # generated tokens, never placeholders.
    extra = {"media": media} if media else {}
    logits = model.forward(ids, positions=positions, cache=cache, last_only=True, **extra)[:, -1]  # [R,V] fp32
    live = (torch.arange(R) < B).to(device)  # the padding rows of a batch bucket are never live
    check_finite_logits(model, logits, "the prefill (the first new token)", lambda: (ids, positions, media),
                        live=live)
    sampled = sample(logits)  # [R] on the device
    next_position = next_position.to(device)
    greedy = None  # at temperature 0, the backend's step that also takes the argmax on the device, if it has one
    for step in range(max_new_tokens):
        fetch.start(sampled)  # this step's tokens start their trip to the host
        if step + 1 < max_new_tokens:
            # The next decode step is launched before this step's tokens reach the host: its inputs
            # (the sampled ids, the positions, the rows live as of the previous step) are already on
            # the device, so the host work below overlaps the GPU. A row that ends at this step is
            # computed once more, with its real position, and that result is never read.
            if step_fn is None:  # one-time setup (a CUDA-graph capture): timed apart from the steps
                setup_start = time.perf_counter()
                if temperature <= 0.0 and hasattr(model, "greedy_decode_step"):
                    greedy = model.greedy_decode_step(cache)
                step_fn = greedy if greedy is not None else model.decode_step(cache)
                if greedy is not None:  # the position update, the step and the argmax in one replay
                    greedy.start(sampled, next_position, live)
                stats.setup_seconds = time.perf_counter() - setup_start
                start += stats.setup_seconds
            if greedy is None or step == 0:
                step_positions = torch.where(live, next_position, torch.full_like(next_position, -1))[:, None]
            if greedy is not None:
                next_sampled = greedy()
                logits = greedy.logits[:, -1]
            else:
                next_position += live.long()
                logits = step_fn(sampled[:, None], step_positions)[:, -1]
            if step == 0:  # one host sync, once: the first decode step runs through the KV cache
                check_finite_logits(model, logits, "the first decode step", lambda: (
                    torch.cat([ids.to(device), sampled[:, None]], 1),
                    torch.cat([positions.to(device), step_positions], 1)), live=live)
            if greedy is None:
                next_sampled = sample(logits)
        tokens = fetch.wait()
        active = [row for row in rows if not row.done]
        for row in active:
            token = int(tokens[row.index])
            if token in ends:
                row.done = True
            else:
                row.add(token)
        stats.new_tokens += len(active)
        now = time.perf_counter()
        if step == 0:
            stats.prefill_seconds = now - start
        else:
            stats.decode_seconds += now - start
            stats.decode_tokens += len(active)
        if step + 1 == max_new_tokens or all(row.done for row in rows):
            return  # (a launched step may still run: its cache writes are reset by the next call)
        start = now
        if len(active) != sum(not row.done for row in rows):  # a row ended: later steps feed it position -1
            live = torch.tensor([not row.done for row in rows] + [False] * (R - B)).to(device)
            if greedy is not None:
                greedy.set_live(live)
        sampled = next_sampled


class _TokenFetch:
    """Sampled token ids copied to the host without waiting for later work on the device: into pinned
    memory with an event on CUDA, so the next decode step can be queued before the copy is read."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.empty(batch, dtype=torch.long, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None

    def start(self, tokens: torch.Tensor) -> None:
        self.host.copy_(tokens, non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()

    def wait(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
