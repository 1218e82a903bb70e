"""Chat: a checkpoint's Jinja chat template, rendered exactly as transformers renders it, and
``model.chat(messages)`` on top of ``generate``.

The template is the checkpoint's own (``chat_template`` in ``tokenizer_config.json``, or a
``chat_template.jinja`` file beside it, as transformers 5 saves it), so a fine-tuned checkpoint
with another format needs no code here. It runs in the same sandbox transformers uses (an
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, its ``tojson`` filter and
``raise_exception``/``strftime_now`` globals) with the tokenizer's special tokens as variables, so
``render`` equals ``AutoTokenizer.apply_chat_template(..., tokenize=False)`` (a test checks it).

A reply ends at the template's end tokens: the tokenizer config's ``eos_token`` and the tokenizer's
EOS ids (``<|eot|>``, ``<|eom|>`` for Muse), which generation already stops on.
"""

from __future__ import annotations

import json
import queue
import threading
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
Message = Mapping[str, Any]


class ChatTemplate:
    """A compiled chat template and the special-token variables it may read.

    Example::

        template = ChatTemplate.from_folder("path/to/checkpoint")
        text = template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    """

    def __init__(self, source: str, special_tokens: Optional[Mapping[str, str]] = None,
                 origin: str = TOKENIZER_CONFIG) -> None:
        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})
        self._compiled = _compile(source, origin)

    @classmethod
    def from_folder(cls, folder: Union[str, Path]) -> Optional["ChatTemplate"]:
        """The template of a checkpoint folder, or None when it ships none."""
        from musecore.tokenizer import inside
        folder = Path(folder)
        config_path = folder / TOKENIZER_CONFIG
        config: dict = {}
        if config_path.is_file():
            try:
                config = json.loads(inside(folder, config_path).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{config_path} is not valid JSON ({e}); fix or re-export the file") from e
        specials = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        specials.update({k: v["content"] for k, v in config.items()
                         if k.endswith("_token") and isinstance(v, dict) and isinstance(v.get("content"), str)})
        if (folder / TEMPLATE_FILE).is_file():
            return cls(inside(folder, folder / TEMPLATE_FILE).read_text(), specials, str(folder / TEMPLATE_FILE))
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}]: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not source:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{config_path}: chat_template must be a string (or a list of named templates); "
                             f"got {type(source).__name__}")
        return cls(source, specials, str(config_path))

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The conversation as the model's text. ``add_generation_prompt`` opens the assistant's turn."""
        check_messages(messages)
        import jinja2

        chat = [_plain(m) for m in messages]
        try:
            return self._compiled.render(messages=chat, tools=variables.pop("tools", None),
                                         documents=variables.pop("documents", None),
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **_plain(variables)})
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template of {self.origin} failed on these messages: {e}") from e

    @property
    def end_token(self) -> Optional[str]:
        """The token that closes a turn (the tokenizer config's ``eos_token``)."""
        return self.special_tokens.get("eos_token")


def check_messages(messages: Any) -> None:
    """Messages are a non-empty list of {"role": str, "content": str | list of parts}."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError('messages must be a non-empty list of {"role": ..., "content": ...} dicts')
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f'message {i} must be a dict with a str "role" and a "content"; got {m!r}')
        if not isinstance(m["content"], (str, list)):
            raise ValueError(f'message {i}: "content" must be a str or a list of parts; '
                             f"got {type(m['content']).__name__}")


def _plain(value: Any) -> Any:
    """Only JSON types reach the sandbox (transformers does the same: rich objects carry methods)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _compile(source: str, origin: str) -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; renders its body."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template in {origin} is not valid Jinja (line {e.lineno}: {e.message})") from e


# -- model.chat -----------------------------------------------------------------------------------

def chat_prompt(model: Any, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` rendered by the model's chat template (no BOS added: the template has it).

    Text only: for messages with images, video or audio, :func:`musecore.multimodal.prepare` gives
    the ids and the features that go with them."""
    from musecore.multimodal import has_media, parse_messages

    if has_media(messages):
        _, parts = parse_messages(messages)
        if parts:
            raise ValueError(f"{parts[0].where} is {parts[0].kind} input, and chat_prompt returns token ids only: use "
                             "model.chat(messages), or musecore.multimodal.prepare(model, [messages]) for the ids "
                             "and the media features")
    tokenizer, template = chat_template_of(model)
    return tokenizer.encode(template.render(messages, add_generation_prompt), add_special_tokens=False)


def chat_template_of(model: Any) -> tuple[Any, "ChatTemplate"]:
    """``(tokenizer, chat template)`` of a loaded model; a one-line error naming what the checkpoint lacks."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("this model has no tokenizer.json, so it cannot chat; add tokenizer.json and "
                         "tokenizer_config.json (with a chat_template) to the checkpoint")
    template = tokenizer.chat_template
    if template is None:
        raise ValueError(f"{tokenizer.source}: the checkpoint has no chat template (no chat_template in "
                         f"{TOKENIZER_CONFIG}, no {TEMPLATE_FILE}); use model.generate(text) instead")
    return tokenizer, template


def end_ids(model: Any) -> list[int]:
    """Ids that end an assistant turn: the template's end token and the tokenizer's EOS ids."""
    tokenizer = model.tokenizer
    ids = list(tokenizer.eos_ids)
    end = tokenizer.chat_template.end_token if tokenizer.chat_template is not None else None
    if end is not None and tokenizer.has_token(end):
        ids.append(tokenizer.token_id(end))
    return list(dict.fromkeys(ids))


def chat(model: Any, messages: Sequence[Message], stream: Optional[Callable[[str], None]] = None,
         cancel: Optional[threading.Event] = None, **generate_options: Any) -> str:
    """The assistant's reply to ``messages``; ``stream(piece)`` gets the text as it is produced.

    ``generate_options`` are :func:`musecore.generate.generate`'s (``max_new_tokens``,
    ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``). Setting ``cancel`` (from another
    thread) ends the reply at the next token. Content parts may hold images, video and audio
    (:mod:`musecore.multimodal`); their encoder outputs are cached on the model, so a later turn
    with the same picture does not run the vision tower again.

    Example::

        reply = model.chat([{"role": "user", "content": "Write a haiku"}], max_new_tokens=64)
        reply = model.chat([{"role": "user", "content": [{"type": "image", "path": "cat.png"},
                                                         {"type": "text", "text": "What is this?"}]}])
    """
    from musecore.multimodal import prepare

    return _chat(model, prepare(model, [messages]), stream, cancel, generate_options)


def _chat(model: Any, prepared: Any, stream: Optional[Callable[[str], None]], cancel: Optional[threading.Event],
          generate_options: dict) -> str:
    from musecore.generate import _Sequence, generate

    ids = prepared.ids[0]
    stop = generate_options.pop("stop", None)
    stops = [stop] if isinstance(stop, (str, int)) else list(stop or [])
    stop_ids = [s for s in stops if not isinstance(s, str)] + end_ids(model)
    # The prompt is ids (the template already holds BOS), so generate streams ids; they are detokenized
    # here with generate's own incremental decoder, which also cuts at stop strings and holds back text
    # that may still become one.
    row = _Sequence(0, model.tokenizer, [s for s in stops if isinstance(s, str)],
                    (lambda _i, piece: stream(piece)) if stream is not None else None, context=ids)

    def on_token(token: int) -> None:
        row.add(token)
        if row.done or (cancel is not None and cancel.is_set()):  # a stop string, or nothing more is wanted
            raise _Finished()

    try:
        generate(model, ids, stop=stop_ids, stream=on_token, media=prepared.features(model), **generate_options)
    except _Finished:
        pass
    row.finish()
    return row.text


class _Finished(Exception):
    """A stop string or a cancellation ended the reply inside generate's loop."""


def chat_stream(model: Any, messages: Sequence[Message], **generate_options: Any) -> Iterator[str]:
    """``chat`` as an iterator of text pieces. Closing the iterator early stops generation at the next token.

    Example::

        for piece in model.chat_stream([{"role": "user", "content": "hi"}]):
            print(piece, end="", flush=True)
    """
    pieces: "queue.Queue[tuple[str, Any]]" = queue.Queue()
    stopped = threading.Event()

    from musecore.multimodal import prepare

    def work() -> None:
        try:
            _chat(model, prepared, lambda piece: pieces.put(("piece", piece)), stopped, generate_options)
            pieces.put(("end", None))
        except BaseException as e:  # re-raised in the caller's thread
            pieces.put(("error", e))

    prepared = prepare(model, [messages])  # bad messages and media raise here, in the caller's thread
    worker = threading.Thread(target=work, name="musecore-chat", daemon=True)
    worker.start()
    try:
        while True:
            kind, value = pieces.get()
            if kind == "piece":
                yield value
            elif kind == "error":
                raise value
            else:
                return
    finally:
        stopped.set()
        worker.join()  # it stops at the next token; the model is not left mid-step in another thread
