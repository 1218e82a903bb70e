"""The OpenAI-compatible HTTP API over the continuous-batching engine (FastAPI, run by uvicorn).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream`` as server-sent
events and ``usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx status
for anything the client can fix. A request whose client disconnects is cancelled: it leaves the
running batch at the next decode step.

Example::

    from musecore.serve.app import make_app
    app = make_app(model, model_name="muse-tiny")      # then: uvicorn.run(app, port=8000)
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from musecore.generate import SEEDS
from musecore.serve.engine import Engine, EngineFull, Request, Sampling

POLL_DISCONNECT_S = 0.25  # how often a non-streaming request checks that its client is still there
MAX_BODY_BYTES = 64 << 20  # a request body beyond this gets HTTP 413 (inline media included); make_app's max_body_bytes
ROLES = ("system", "developer", "user", "assistant")  # the chat roles the server takes (OpenAI's, without tools)
# Sampling parameters this server does not implement: a request that sets one to anything but its no-op value gets a
# 400 naming it, never an answer that silently ignored it.
UNSUPPORTED = (("n", (1,)), ("best_of", (1,)), ("logprobs", (False,)), ("top_logprobs", (0,)), ("echo", (False,)),
               ("suffix", ("",)), ("tools", ([],)), ("tool_choice", ("none",)), ("functions", ([],)),
               ("function_call", ("none",)), ("logit_bias", ({},)), ("presence_penalty", (0, 0.0)),
               ("frequency_penalty", (0, 0.0)), ("response_format", ({"type": "text"},)))


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def make_app(model: Any, model_name: str, engine: Optional[Engine] = None, max_batch: int = 16,
             max_waiting: int = 64, max_model_len: Optional[int] = None, prefill_graphs: str = "short",
             max_body_bytes: int = MAX_BODY_BYTES) -> Any:
    """A FastAPI app serving ``model`` under ``model_name``; its engine starts and stops with the app."""
    from contextlib import asynccontextmanager

    from starlette.exceptions import HTTPException

    engine = engine or Engine(model, max_batch=max_batch, max_model_len=max_model_len, max_waiting=max_waiting,
                              prefill_graphs=prefill_graphs)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="musecore", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def api_error(_request: Any, e: ApiError) -> Any:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_json(_request: Any, e: RequestValidationError) -> Any:
        return JSONResponse(ApiError(400, f"the request body is not valid: {e.errors()[:3]}").body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Any, e: HTTPException) -> Any:  # 404 / 405 in OpenAI's shape too
        error = ApiError(e.status_code, f"{e.detail} (this server serves /v1/completions, /v1/chat/completions, "
                                        "/v1/models, /health and /metrics)", code=str(e.status_code).lower())
        return JSONResponse(error.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.get("/health")
    async def health() -> Any:
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(engine.error)}, status_code=503)
        return {"status": "ok", "model": model_name, "running": engine.running_count, "waiting": engine.queue_depth}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "musecore", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(prometheus(engine, model_name), media_type="text/plain; version=0.0.4")

    def check_text(texts: list[str], param: str) -> None:
        """Text that cannot fit the context is refused before it is tokenized (tokenizing megabytes takes seconds
        and gigabytes), and text must be valid UTF-8 (JSON can carry lone surrogates)."""
        from musecore.generate import _check_text
        chars, bound = sum(map(len, texts)), engine.max_model_len * model.tokenizer.max_token_chars
        if chars > bound:
            raise ApiError(400, f"the {param} has {chars} characters, more than {engine.max_model_len} tokens of this "
                                f"server's context can hold (at most {model.tokenizer.max_token_chars} characters a "
                                "token): shorten it", param, "context_length_exceeded")
        try:
            _check_text(texts, model)
        except ValueError as e:
            raise ApiError(400, str(e), param) from None

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Any:
        body = await _json(http, max_body_bytes)
        _check_model(body, model_name)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            from musecore.generate import _encode_text
            check_text([prompt], "prompt")
            ids = await asyncio.to_thread(_encode_text, model, prompt) if prompt else []
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
        _check_ids(ids, model.config.vocab_size)
        return await _serve(http, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest) -> Any:
        body = await _json(http, max_body_bytes)
        _check_model(body, model_name)
        from musecore.chat import end_ids
        from musecore.multimodal import prepare
        messages = _plain_messages(body.get("messages"))
        check_text(_texts(messages), "messages")
        try:
            _check_roles(messages)
            _check_inline_media(messages)
            # Media is decoded and processed off the event loop; the towers run in the scheduler thread.
            prepared = await asyncio.to_thread(prepare, model, [messages])
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        return await _serve(http, body, prepared.ids[0], chat=True, extra_stop_ids=set(end_ids(model)),
                            media=prepared if prepared.has_media else None)

    async def _serve(http: Any, body: dict, ids: list[int], chat: bool, extra_stop_ids: frozenset = frozenset(),
                     media: Any = None):
        sampling = _sampling(body, len(ids), engine.max_model_len, model.tokenizer, chat)
        sampling.stop_ids |= set(extra_stop_ids)
        stream, include_usage = _streaming(body)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        def sink(event: dict) -> None:  # called by the scheduler thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
                request.cancel()

        request = Request(ids, sampling, sink, model.tokenizer, media=media)
        try:
            engine.submit(request)
        except EngineFull as e:
            raise ApiError(429, str(e), code="server_busy", kind="rate_limit_error") from None
        except RuntimeError as e:
            raise ApiError(503, str(e), code="engine_stopped", kind="server_error") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if stream:
            return StreamingResponse(_stream(request, events, rid, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, done = [], None
        try:
            checked = time.monotonic()
            while done is None:
                try:
                    event = await asyncio.wait_for(events.get(), POLL_DISCONNECT_S)
                except asyncio.TimeoutError:
                    event = None
                if time.monotonic() - checked >= POLL_DISCONNECT_S:  # also while tokens keep coming
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        return JSONResponse({}, status_code=499)  # (the request is cancelled below)
                if event is None:
                    continue
                if event["type"] == "text":
                    text.append(event["text"])
                else:
                    done = event
        finally:
            if done is None:
                request.cancel()
        if done["finish_reason"] == "error":
            raise ApiError(500, f"generation failed: {done.get('error')}", kind="server_error")
        content = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content},
                   "finish_reason": done["finish_reason"], "logprobs": None} if chat else
                  {"index": 0, "text": content, "finish_reason": done["finish_reason"], "logprobs": None})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name, "choices": [choice], "usage": done["usage"]}

    async def _stream(request: Request, events: asyncio.Queue, rid: str, chat: bool,
                      include_usage: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        stamp = int(time.time())

        def chunk(delta: Optional[str], finish: Optional[str] = None, role: bool = False) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            data = {"id": rid, "object": kind, "created": stamp, "model": model_name, "choices": [choice]}
            return f"data: {json.dumps(data)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk(None, role=True)
            while True:
                event = await events.get()
                if event["type"] == "text":
                    yield chunk(event["text"])
                    continue
                finished = True
                if event["finish_reason"] == "error":
                    error = ApiError(500, f"generation failed: {event.get('error')}", kind="server_error")
                    yield f"data: {json.dumps(error.body())}\n\n"
                    return
                yield chunk(None, finish=event["finish_reason"])
                if include_usage:
                    usage = {"id": rid, "object": kind, "created": stamp, "model": model_name, "choices": [],
                             "usage": event["usage"]}
                    yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            if not finished:  # the client went away (the response was cancelled): leave the batch
                request.cancel()

    return app


async def _json(http: Any, max_bytes: int = MAX_BODY_BYTES) -> dict:
    """The request body as a JSON object, read up to ``max_bytes`` (HTTP 413 past that, before reading it all)."""
    declared = http.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body is {int(declared)} bytes; this server takes at most {max_bytes}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body is over {max_bytes} bytes, this server's limit",
                           code="request_too_large")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not JSON this server reads: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _streaming(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage), checked before the request is submitted."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false; got {stream!r}", "stream")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, f"stream_options must be an object; got {options!r}", "stream_options")
    usage = (options or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise ApiError(400, f"stream_options.include_usage must be true or false; got {usage!r}", "stream_options")
    return bool(stream), bool(usage)


def _texts(messages: Any) -> list[str]:
    """The text the chat template renders from ``messages``: roles, string contents and text parts (not media)."""
    out = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        out += [v for v in [m.get("role")] + [p.get("text") for p in parts if isinstance(p, dict)
                                              and p.get("type") == "text"] if isinstance(v, str)]
    return out


def _check_roles(messages: Any) -> None:
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        role = m.get("role") if isinstance(m, dict) else None
        if isinstance(role, str) and role not in ROLES:
            extra = " (tools are not supported)" if role in ("tool", "function") else ""
            raise ValueError(f"message {i}: role {role!r} is not one of {', '.join(ROLES)}{extra}")


def _check_model(body: dict, model_name: str) -> None:
    name = body.get("model")
    if name is not None and name != model_name:
        raise ApiError(404, f"model {name!r} is not served here; this server serves {model_name!r} "
                            "(GET /v1/models)", "model", "model_not_found")


def _plain_messages(messages: Any) -> Any:
    """OpenAI messages as the chat template reads them (``content: null`` becomes empty text)."""
    if not isinstance(messages, list):
        return messages
    return [{**m, "content": "" if m.get("content") is None else m["content"]} if isinstance(m, dict) else m
            for m in messages]


def _check_inline_media(messages: Any) -> None:
    """The server reads media only from the request itself (``data:`` URLs, base64 ``input_audio``),
    never from its own disk or the network."""
    from musecore.multimodal import has_media, parse_messages
    if not isinstance(messages, list) or not has_media(messages):
        return
    for part in parse_messages(messages)[1]:
        inline = (isinstance(part.source, bytes) or isinstance(part.source, dict)
                  or (isinstance(part.source, str) and part.source.startswith("data:")))
        if not inline:
            raise ValueError(f"{part.where}: the server takes {part.kind} input inline only (an image_url with a "
                             "data: URL, input_audio with base64 data), not a file path or an http URL")


def _check_ids(ids: list[int], vocab: int) -> None:
    if not ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "prompt")


def _number(body: dict, name: str, default: Any, kind: type, low: float, high: float) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"{name} must be a{'n integer' if kind is int else ' number'}; got {value!r}", name)
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be in [{low}, {high}]; got {value}", name)
    return kind(value)


def _sampling(body: dict, prompt_len: int, max_model_len: int, tokenizer: Any, chat: bool) -> Sampling:
    for unsupported, no_ops in UNSUPPORTED:
        value = body.get(unsupported)
        if value is not None and not any(type(value) is type(v) and value == v for v in no_ops):
            raise ApiError(400, f"{unsupported}={value!r} is not supported by this server", unsupported)
    room = max_model_len - prompt_len
    if room < 1:
        raise ApiError(400, f"the prompt has {prompt_len} tokens; this server's context is {max_model_len} tokens, "
                            "so no token can be generated: shorten the prompt", "messages" if chat else "prompt",
                       "context_length_exceeded")
    limit_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, limit_name, None, int, 1, 1 << 31)
    if max_tokens is None:
        max_tokens = room if chat else min(16, room)  # OpenAI's defaults: the rest of the context; 16 for completions
    if max_tokens > room:
        raise ApiError(400, f"{limit_name}={max_tokens} plus the {prompt_len}-token prompt exceeds this server's "
                            f"context of {max_model_len} tokens; ask for at most {room}", limit_name,
                       "context_length_exceeded")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise ApiError(400, "stop must be a non-empty string or a list of at most 4 of them", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEEDS[0] <= seed < SEEDS[1]):
        raise ApiError(400, f"seed must be an integer in [{SEEDS[0]}, {SEEDS[1]}); got {seed!r}", "seed")
    return Sampling(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, float, 1e-9, 1.0),
                    top_k=_number(body, "top_k", 0, int, 0, 1 << 20),
                    seed=seed, stop_strings=list(stops))


def prometheus(engine: Engine, model_name: str) -> str:
    """The engine's counters in the Prometheus text format."""
    m = engine.metrics
    label = f'{{model="{model_name}"}}'
    with m.lock:
        recent = sorted(m.ttft_seconds)
        rows = [
            ("musecore_requests_running", "gauge", "requests in the running batch", engine.running_count),
            ("musecore_requests_waiting", "gauge", "requests waiting to join the batch (queue depth)",
             engine.queue_depth),
            ("musecore_requests_finished_total", "counter", "requests that ended normally", m.requests_finished),
            ("musecore_requests_cancelled_total", "counter", "requests whose client went away", m.requests_cancelled),
            ("musecore_prompt_tokens_total", "counter", "prompt tokens prefilled", m.prompt_tokens),
            ("musecore_generation_tokens_total", "counter", "tokens generated", m.generation_tokens),
            ("musecore_decode_steps_total", "counter", "batched decode steps run", m.decode_steps),
            ("musecore_batch_size_peak", "gauge", "the largest batch a decode step has run", m.peak_running),
            ("musecore_lookahead_steps_taken_total", "counter",
             "decode steps queued before their input tokens were read (greedy, graph replay) and then used",
             m.lookahead_taken),
            ("musecore_lookahead_steps_dropped_total", "counter",
             "decode steps queued ahead and then not used (a request joined first)", m.lookahead_dropped),
        ]
    rows.append(("musecore_generation_tokens_per_second", "gauge",
                 f"tokens generated per second over the last {m.WINDOW_S:.0f} s", m.tokens_per_s()))
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{label} {value}"]
    name = "musecore_time_to_first_token_seconds"
    lines += [f"# HELP {name} time from a request's arrival to its first token (quantiles of the last "
              f"{m.ttft_seconds.maxlen})", f"# TYPE {name} summary"]
    for q in (0.5, 0.9, 0.99):
        value = recent[min(int(q * len(recent)), len(recent) - 1)] if recent else float("nan")
        lines.append(f'{name}{{model="{model_name}",quantile="{q}"}} {value}')
    lines += [f"{name}_sum{label} {m.ttft_sum}", f"{name}_count{label} {m.ttft_count}"]
    return "\n".join(lines) + "\n"
