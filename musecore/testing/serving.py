"""Helpers for tests of the serve engine (``musecore.serve.engine``) on any backend: sinks that collect each request's
text and its end, and a run of the engine over requests all submitted before it starts (one prefill for them all)."""

from __future__ import annotations

import threading
from typing import Any


class Collector:
    """The sinks of ``n`` requests: ``text[i]`` (the pieces), ``done[i]`` (the last event) and ``all_done``."""

    def __init__(self, n: int) -> None:
        self.text: dict[int, list[str]] = {i: [] for i in range(n)}
        self.done: dict[int, dict] = {}
        self.all_done = threading.Event()
        self.n = n

    def sink(self, i: int):
        def receive(event: dict) -> None:
            if event["type"] == "text":
                self.text[i].append(event["text"])
            else:
                self.done[i] = event
                if len(self.done) == self.n:
                    self.all_done.set()
        return receive

    def texts(self) -> list[str]:
        return ["".join(self.text[i]) for i in range(self.n)]


def serve_all(engine: Any, model: Any, requests: list[tuple[str, Any]], timeout: float = 120) -> Collector:
    """Submit every ``(prompt text, Sampling)`` to ``engine`` (not started), start it, wait for all, stop it."""
    from musecore.generate import _encode_text
    from musecore.serve.engine import Request

    got = Collector(len(requests))
    for i, (prompt, sampling) in enumerate(requests):
        engine.submit(Request(_encode_text(model, prompt), sampling, got.sink(i), model.tokenizer))
    engine.start()
    try:
        assert got.all_done.wait(timeout), f"the engine did not finish within {timeout} s"
    finally:
        engine.stop()
    return got
