"""Continuous batching: one scheduler thread steps every running request together through one KV cache.

How it works (and what it is not):

- One :class:`~musecore.kv_cache.KVCache` of ``max_batch`` rows and ``max_model_len`` positions
  is made at start. Running requests occupy rows ``0..n-1``, always packed: a decode step runs the
  model once on ``[n, 1]`` through views of those rows (no copies), each row at its own position
  (the cache and the attention op mask by position, as batched ``generate`` does).
- Between steps, waiting requests join: all that fit in the free rows are prefilled together
  into those rows (one forward, prompts left-padded with position -1, as batched ``generate``
  does), and their first tokens are sampled; they decode with the others from the next step.
  A request that ends (EOS, a stop, its token limit, or a client that went away) leaves at once:
  the last row is copied into its place, so rows stay packed. Joining and leaving copy at most one
  row of the cache.
- A prefill runs whole, between two decode steps: a long prompt delays the next step of the others
  by its prefill time (no chunked prefill), and a short prompt joining with a long one is padded
  to it. Sampling settings are per request (rows are sampled one by one when they differ); greedy
  rows are sampled together.
- Prompts stay on the cache's rows only while running; there is no prefix cache.
- On a backend that replays captured decode steps (``model.wants_static_cache``: CUDA and ROCm graphs, TPU's compiled
  steps), the cache is static and each decode step replays a graph captured for its shape bucket: the running rows
  rounded up to a power of two (the extra rows are padding at position -1, which writes only to the trash slot and
  attends to nothing) and the longest running sequence rounded up to ``LENGTH_ROUND`` times a power of two
  (full-attention layers read only that many slots). Every row bucket's graph at the first length bound is captured at
  ``start``; a longer bound's the first time a step needs it (logged); all are kept, so a server captures a few dozen
  at most. Elsewhere each step runs ``model.forward`` through a dynamic cache.
- A request with images or audio (``Request.media``, a :class:`musecore.multimodal.Prepared`) has
  its encoder outputs computed here, in the scheduler thread, through the model's encoder cache,
  just before its prefill: one tower call per kind for all the requests joining, whose features
  then go into that one forward.

Text is produced with generate's incremental detokenizer (``_Sequence``), so a request's pieces
are exactly what ``model.generate`` would stream, and stop strings are held back the same way.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from musecore.generate import _Sequence, _TokenFetch, check_finite_logits, raise_non_finite
from musecore.kv_cache import KVCache

log = logging.getLogger("musecore.serve")
# Engine(prefill_graphs=): which prefill buckets are captured at start ("short": the one-row buckets of the shortest
# prompts, others when first needed; "all": every bucket; "off": every prefill runs eagerly)
PREFILL_GRAPHS = ("short", "all", "off")
Sink = Callable[[dict], None]  # gets {"type": "text", "text"} ... then one {"type": "done", ...}


class EngineFull(Exception):
    """More requests than the server accepts at once (running plus waiting)."""


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop_strings: list[str] = field(default_factory=list)
    stop_ids: set[int] = field(default_factory=set)


class Request:
    """One generation: its prompt ids, sampling settings, where its text goes, and its progress."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], sampling: Sampling, sink: Sink, tokenizer: Any,
                 media: Any = None) -> None:
        self.id = next(self._ids)
        self.prompt_ids, self.sampling, self.sink = prompt_ids, sampling, sink
        self.media = media  # a musecore.multimodal.Prepared whose features go into the prefill, or None
        self.features: Optional[dict] = None
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.first_token_at: Optional[float] = None
        self.generated = 0  # tokens produced, an EOS/stop token included
        self.position = len(prompt_ids)  # the position of the next token fed to the model
        self.last_token = -1
        self.finish_reason: Optional[str] = None  # "stop", "length" or "cancelled"
        self.generator = (torch.Generator().manual_seed(int(sampling.seed)) if sampling.seed is not None else None)
        self.text = _Sequence(0, tokenizer, sampling.stop_strings,
                              lambda _i, piece: sink({"type": "text", "text": piece}), context=prompt_ids)

    def cancel(self) -> None:
        """Leave at the next step (the client went away)."""
        self.cancelled.set()


class Metrics:
    """Counters the ``/metrics`` endpoint exports; updated by the scheduler thread."""

    WINDOW_S = 10.0

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests_finished = 0
        self.requests_cancelled = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.decode_steps = 0
        self.peak_running = 0  # the largest batch a decode step has run
        self.lookahead_taken = 0    # decode steps queued before the tokens they are fed were read, then used
        self.lookahead_dropped = 0  # ... then not used (a request joined first): device time spent for nothing
        self.ttft_seconds: deque[float] = deque(maxlen=1000)  # recent times to first token
        self.ttft_sum, self.ttft_count = 0.0, 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps

    def tokens(self, n: int) -> None:
        now = time.perf_counter()
        with self.lock:
            self.generation_tokens += n
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - self.WINDOW_S:
                self._recent.popleft()

    def tokens_per_s(self) -> float:
        now = time.perf_counter()
        with self.lock:
            recent = [n for t, n in self._recent if t >= now - self.WINDOW_S]
        return sum(recent) / self.WINDOW_S

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft_seconds.append(seconds)
            self.ttft_sum += seconds
            self.ttft_count += 1


class Engine:
    """The scheduler: ``submit`` from any thread; one thread owns the model.

    Example::

        engine = Engine(model, max_batch=8)
        engine.start()
        engine.submit(Request(ids, Sampling(max_tokens=32), sink=print, tokenizer=model.tokenizer))
        ...
        engine.stop()
    """

    def __init__(self, model: Any, max_batch: int = 16, max_model_len: Optional[int] = None,
                 max_waiting: int = 64, ignore_eos: bool = False, lookahead: bool = True,
                 prefill_graphs: str = "short") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1; got {max_batch}")
        if prefill_graphs not in PREFILL_GRAPHS:
            raise ValueError(f"prefill_graphs must be one of {', '.join(PREFILL_GRAPHS)}; got {prefill_graphs!r}")
        self.prefill_graphs = prefill_graphs
        self.model = model
        limit = model.config.max_position_embeddings
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or max_model_len < 1):
            raise ValueError(f"max_model_len must be an integer >= 1 (or None: the model's {limit}); got "
                             f"{max_model_len!r}")
        if max_model_len is not None and max_model_len > limit:
            log.warning("max_model_len %d is beyond the model's max_position_embeddings; serving %d positions",
                        max_model_len, limit)
        self.max_model_len = min(max_model_len or limit, limit)
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.graphs = bool(model.wants_static_cache)  # decode steps replayed from graphs captured per bucket
        self.cache = model.new_cache(max_batch, self.max_model_len, kv_format=getattr(model, "kv_format", "bf16"),
                                     static=self.graphs)  # checked against the free memory before it is allocated
        self._steps: dict[tuple[int, int], Callable] = {}  # (rows, length bound) -> a captured decode step
        # Short prompts' prefills replay graphs too, captured per (rows, prompt length) bucket on a staging cache whose
        # rows are then copied into the joiners' rows (see _prefill_graphed); None: the backend captures none
        self._prefills: dict[tuple[int, int], Optional[Callable]] = {}
        self.staging: Optional[KVCache] = None  # made with the first prefill graph (rows x 256 slots per layer)
        # Greedy graph steps: the next step is queued from this one's device tokens before they are read (see _Launched)
        self.lookahead = lookahead
        self._ahead: Optional[_Launched] = None
        self._fetches: dict[int, list[_TokenFetch]] = {}  # rows -> two host buffers, used in turn
        self._launches = 0
        self.running: list[Request] = []  # row i of the cache holds running[i]
        self.waiting: deque[Request] = deque()
        self.metrics = Metrics()
        # ignore_eos: every request runs to its max_tokens (benchmarks of random weights, as vLLM's --ignore-eos)
        self.end_ids = set() if ignore_eos else _end_ids(model)
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    # -- the public side ---------------------------------------------------------------------------

    def start(self) -> None:
        """Capture the first decode steps (``warm_up``; none where steps are not captured), then start the scheduler
        thread."""
        self.warm_up()
        self._thread = threading.Thread(target=self._run, name="musecore-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: Request) -> None:
        """Queue ``request``; it joins the batch at the next step with a free row. Raises
        :class:`EngineFull` when ``max_batch + max_waiting`` requests are already in."""
        need = len(request.prompt_ids) + request.sampling.max_tokens
        if not request.prompt_ids or need > self.max_model_len:
            raise ValueError(f"a request needs 1 <= prompt + max_tokens <= {self.max_model_len} positions; "
                             f"got {len(request.prompt_ids)} + {request.sampling.max_tokens}")
        with self._wake:
            if self.error is not None:
                raise RuntimeError(f"the scheduler stopped after an error: {self.error!r}")
            if len(self.running) + len(self.waiting) >= self.max_batch + self.max_waiting:
                raise EngineFull(f"{len(self.running)} requests running and {len(self.waiting)} waiting "
                                 f"(the limits are {self.max_batch} and {self.max_waiting}); retry later")
            self.waiting.append(request)
            self._wake.notify()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running_count(self) -> int:
        return len(self.running)

    # -- the scheduler thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._wake:
                        while not self._stopping and not self.waiting and not self.running:
                            self._wake.wait()
                        if self._stopping:
                            break
                    self._drop_cancelled()
                    self._admit()
                    if self.running:
                        self._decode_step()
        except BaseException as e:  # every waiting client gets the error instead of hanging
            log.exception("the scheduler stopped")
            self.error = e
        finally:
            for request in list(self.running) + list(self.waiting):
                request.sink({"type": "done", "finish_reason": "error" if self.error else "cancelled",
                              "error": repr(self.error) if self.error else "the server is shutting down"})
            self.running.clear()
            self.waiting.clear()

    def _admit(self) -> None:
        """Waiting requests take the free rows; their prompts are prefilled together, in one forward."""
        joining: list[Request] = []
        with self._wake:
            while self.waiting and len(self.running) + len(joining) < self.max_batch:
                request = self.waiting.popleft()
                if request.cancelled.is_set():
                    self._finish_unrun(request)
                else:
                    joining.append(request)
        joining = self._encode(joining)
        if joining:
            self._prefill(joining, len(self.running))

    def _encode(self, requests: list[Request]) -> list[Request]:
        """The joining requests' media features, each tower run once for all of them (through the
        encoder cache); a request whose media cannot be encoded ends with its error, the others go on."""
        from musecore.multimodal import Prepared

        with_media = [r for r in requests if r.media is not None]
        if not with_media:
            return requests
        joined = Prepared.join([r.media for r in with_media])
        try:
            media = joined.features(self.model)
        except ValueError:  # one request's media does not fit the model: find it, run the rest
            return [r for r in requests if self._encode_one(r)]
        for request, features in zip(with_media, joined.split(media, [r.media for r in with_media],
                                                              self.model.config)):
            request.features = features
        return requests

    def _encode_one(self, request: Request) -> bool:
        if request.media is None:
            return True
        try:
            request.features = request.media.features(self.model)
        except ValueError as e:
            request.text.done, request.finish_reason = True, "error"
            request.sink({"type": "done", "finish_reason": "error", "error": str(e)})
            return False
        return True

    def _prefill(self, requests: list[Request], first_row: int) -> None:
        longest = max(len(r.prompt_ids) for r in requests)
        media = _joined_media([r.features for r in requests])
        bucket = None if media else self.prefill_bucket(len(requests), longest)
        step = self._prefill_step(*bucket) if bucket is not None else None
        if step is not None:
            logits = self._prefill_graphed(requests, first_row, bucket, step)
        else:
            view = _rows(self.cache, first_row, first_row + len(requests), reads=longest)
            for layer in view.layers:  # the rows may hold finished requests' entries
                layer.positions.fill_(-1)
            view.next_position.zero_()
            ids, positions = _left_padded(requests, len(requests), longest)
            extra = {"media": media} if media else {}
            logits = self.model.forward(ids, positions=positions, cache=view, last_only=True, **extra)[:, -1]  # [k,V]
            _merge_used(self.cache, view)
        for r in requests:
            r.features = None  # not needed after the prefill
        self.metrics.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        self.running.extend(requests)
        tokens = self._sample(requests, logits)
        now = time.perf_counter()
        for request, token in zip(requests, tokens):
            self._accept(request, token)
            request.first_token_at = now
            self.metrics.first_token(now - request.submitted)
        self._retire()

    def _decode_step(self) -> None:
        n = len(self.running)
        ahead, self._ahead = self._ahead, None
        greedy = self.graphs and all(r.sampling.temperature <= 0 for r in self.running)
        step = ahead.taken_by(self.running, self.step_bucket(n, 1)[0]) if ahead is not None and greedy else None
        if ahead is not None:
            with self.metrics.lock:
                self.metrics.lookahead_taken += step is not None
                self.metrics.lookahead_dropped += step is None
        if greedy:
            step = step or self._launch(self.running, [r.position - 1 for r in self.running],
                                        [r.last_token for r in self.running])
            if self.lookahead and not (self.waiting and n < self.max_batch):  # (a request about to join drops it)
                self._ahead = self._launch_after(step)
            tokens = step.tokens(self.model)
        elif self.graphs:
            logits = self._replay([r.position - 1 for r in self.running], [r.last_token for r in self.running])
            tokens = self._sample(self.running, logits[:n])
        else:
            view = _rows(self.cache, 0, n)
            ids = torch.tensor([[r.last_token] for r in self.running], dtype=torch.long)
            positions = torch.tensor([[r.position - 1] for r in self.running], dtype=torch.long)
            logits = self.model.forward(ids, positions=positions, cache=view)[:, -1]  # [n,V]
            _merge_used(self.cache, view)
            tokens = self._sample(self.running, logits)
        for request, token in zip(list(self.running), tokens):
            self._accept(request, token)
        self.metrics.decode_steps += 1
        self.metrics.peak_running = max(self.metrics.peak_running, n)
        self._retire()

    # Prompt lengths whose prefills replay graphs (each prompt left-padded to the next of these); longer ones, prompts
    # with media and buckets of more than PREFILL_MAX_TOKENS rows x length run eagerly.
    PREFILL_LENGTHS = (16, 32, 64, 128, 256)
    PREFILL_MAX_TOKENS = 1024
    PREFILL_START = 2  # the first this many lengths at one row are captured by start(); other buckets when first needed

    def prefill_bucket(self, rows: int, longest: int) -> Optional[tuple[int, int]]:
        """The captured prefill's shape for ``rows`` joining prompts of at most ``longest`` tokens: rows up to a power
        of two (at most ``max_batch``), the length up to the next of ``PREFILL_LENGTHS``; None when it is not replayed
        (graphs not used or ``prefill_graphs="off"``, too long, too many tokens)."""
        if not self.graphs or self.prefill_graphs == "off" or longest > self.PREFILL_LENGTHS[-1]:
            return None
        length = next(n for n in self.PREFILL_LENGTHS if n >= longest)
        rows = self._row_bucket(rows)
        return (rows, length) if rows * length <= self.PREFILL_MAX_TOKENS else None

    @property
    def captured_prefills(self) -> list[tuple[int, int]]:
        """The (rows, length) buckets whose prefills are captured so far."""
        return sorted(key for key, step in self._prefills.items() if step is not None)

    def _prefill_step(self, rows: int, length: int) -> Optional[Callable]:
        key = (rows, length)
        if key not in self._prefills and None in self._prefills.values():  # the backend captures none
            self._prefills[key] = None
        if key not in self._prefills:
            t = time.perf_counter()
            if self.staging is None:
                self.staging = self.model.new_cache(
                    min(self.max_batch, self.PREFILL_MAX_TOKENS // self.PREFILL_LENGTHS[0]),
                    min(self.PREFILL_LENGTHS[-1], self.max_model_len), kv_format=getattr(self.model, "kv_format", "bf16"),
                    static=True)
            step = self._prefills[key] = self.model.prefill_step(_rows(self.staging, 0, rows, reads=length), length)
            if step is not None:
                log.info("captured the prefill for %d rows of up to %d tokens in %.2f s", rows, length,
                         time.perf_counter() - t)
            else:
                self.staging = None  # the backend captures none: no staging cache
        return self._prefills[key]

    def _prefill_graphed(self, requests: list[Request], first_row: int, bucket: tuple[int, int],
                         step: Callable) -> torch.Tensor:
        """The prefill of ``requests`` replayed from the graph of ``bucket`` on the staging cache's rows, whose slots
        are then copied into rows ``first_row..`` of the engine's cache: logits ``[k, V]``."""
        rows, length = bucket
        k, staging = len(requests), self.staging
        for layer in staging.layers:  # a staging row holds the previous prefill's entries
            layer.positions[:rows].fill_(-1)
        ids, positions = _left_padded(requests, rows, length)
        logits = step(ids.to(self.model.device), positions.to(self.model.device))[:k, -1]  # [k, V]
        for layer, part in zip(self.cache.layers, staging.layers):
            # positions < length: a full layer's slots [0, length); a ring the same slots, or all of it where it wrapped
            # (then it is as long as the engine's own: the window is below both caches' lengths)
            slots = min(part.capacity, length)
            into = slice(first_row, first_row + k)
            layer.positions[into].fill_(-1)
            layer.k[into, :slots].copy_(part.k[:k, :slots])
            layer.v[into, :slots].copy_(part.v[:k, :slots])
            layer.positions[into, :slots].copy_(part.positions[:k, :slots])
        self.cache.next_position[first_row:first_row + k] = torch.tensor([len(r.prompt_ids) for r in requests])
        return logits

    LENGTH_ROUND = 256  # a decode graph's length bound: this many slots times a power of two (up to max_model_len)

    def step_bucket(self, rows: int, length: int) -> tuple[int, int]:
        """The captured step's shape for ``rows`` running sequences whose longest reaches position ``length - 1``:
        rows up to the backend's ``batch_bucket`` or a power of two (at most ``max_batch``), the read bound up to
        ``LENGTH_ROUND`` times a power of two (at most ``max_model_len``)."""
        bound = self.LENGTH_ROUND
        while bound < length:
            bound *= 2
        return self._row_bucket(rows), min(bound, self.max_model_len)

    def _row_bucket(self, rows: int) -> int:
        """``rows`` rounded up to the backend's ``batch_bucket`` (TPU) or a power of two, at most ``max_batch``."""
        bucket = getattr(self.model.backend, "batch_bucket", None)
        return min(int(bucket(rows)) if bucket is not None else 1 << (rows - 1).bit_length(), self.max_batch)

    @property
    def captured_steps(self) -> list[tuple[int, int]]:
        """The (rows, length bound) buckets whose decode steps are captured so far."""
        return sorted(self._steps)

    def start_buckets(self) -> list[tuple[int, int]]:
        """The (rows, length bound) buckets ``warm_up`` captures: every row bucket up to ``max_batch`` at the first
        length bound."""
        return sorted({self.step_bucket(n, 1) for n in range(1, self.max_batch + 1)})

    def start_prefills(self) -> list[tuple[int, int]]:
        """The (rows, length) prefill buckets ``warm_up`` captures: with ``prefill_graphs="short"`` (the default) the
        one-row buckets of the ``PREFILL_START`` shortest lengths, with ``"all"`` every bucket, with ``"off"`` none."""
        if not self.graphs or self.prefill_graphs == "off":
            return []
        if self.prefill_graphs == "short":
            return [(1, n) for n in self.PREFILL_LENGTHS[:self.PREFILL_START]]
        rows = {r for r, _ in self.start_buckets()}
        return sorted({b for r in rows for n in self.PREFILL_LENGTHS if (b := self.prefill_bucket(r, n))})

    def warm_up(self) -> int:
        """Capture the decode step of every row bucket at the first length bound, and the prefills of
        :meth:`start_prefills`, now (``start`` calls this), so the first requests do not wait for captures; longer
        bounds and other prefill buckets are captured when first needed. Returns how many steps were captured (0 where
        steps are not captured)."""
        if not self.graphs:
            return 0
        buckets = [b for b in self.start_buckets() if b not in self._steps]
        prefills = [b for b in self.start_prefills() if b not in self._prefills]
        with torch.inference_mode():
            for rows, bound in buckets:
                self._step(rows, bound)
            captured = sum(self._prefill_step(rows, length) is not None for rows, length in prefills)
        return len(buckets) + captured

    def _step(self, rows: int, bound: int) -> Callable:
        step = self._steps.get((rows, bound))
        if step is None:
            t = time.perf_counter()
            step = self._steps[(rows, bound)] = self.model.decode_step(_rows(self.cache, 0, rows, reads=bound))
            log.info("captured the decode step for %d rows up to %d positions in %.2f s (%d kept)", rows, bound,
                     time.perf_counter() - t, len(self._steps))
        return step

    def _replay(self, positions: list[int], ids: list[int] | torch.Tensor) -> torch.Tensor:
        """One decode step through the graph of its bucket, rows fed ``ids`` (host ids, or the device tokens of the
        step before, one per row of its bucket) at ``positions`` (-1: computed, never read): logits ``[rows, V]`` of
        every row of the bucket, valid until the next step (the graph's output buffer)."""
        n = len(positions)
        rows, bound = self.step_bucket(n, max(positions) + 1)
        step = self._step(rows, bound)
        fed = torch.full((rows, 1), -1, dtype=torch.long)  # padding rows: position -1 (seen by nothing)
        fed[:n, 0] = torch.tensor(positions, dtype=torch.long)
        if isinstance(ids, torch.Tensor):
            tokens = ids[:, None]
        else:
            tokens = torch.zeros((rows, 1), dtype=torch.long)  # padding rows: token 0
            tokens[:n, 0] = torch.tensor(ids, dtype=torch.long)
        return step(tokens.to(self.model.device), fed.to(self.model.device))[:, -1]

    def _launch(self, requests: list[Request], positions: list[int], ids: list[int] | torch.Tensor) -> _Launched:
        """Queue the greedy decode step of ``requests`` (rows in order) fed ``ids`` (host ids, or the device tokens
        of the step before, one per row of its bucket) at ``positions`` (-1: computed but never read), and the copy
        of its tokens to the host; nothing waits for the device."""
        logits = self._replay(positions, ids)
        tokens = self.model.ops.sample(logits, 0.0)  # [rows] on the device
        rows = tokens.shape[0]
        fetches = self._fetches.setdefault(rows, [_TokenFetch(rows, torch.device(self.model.device)) for _ in "ab"])
        fetch = fetches[self._launches % 2]  # never the buffer of the step launched just before (still unread)
        self._launches += 1
        fetch.start(torch.where(torch.isfinite(logits).all(-1), tokens, -1))  # -1: NaN/Inf logits
        return _Launched(list(requests), list(positions), tokens, fetch)

    def _launch_after(self, step: _Launched) -> Optional[_Launched]:
        """The step after ``step``, fed its device tokens, before they are read: the look-ahead. A row that ends at
        ``step`` for certain (its token limit, which ``submit`` keeps within the context) is fed position -1; one that
        ends otherwise (EOS, a stop) is computed once more, never read. None when every row ends."""
        positions = [p + 1 if r.generated + 1 < r.sampling.max_tokens else -1 for r, p in zip(step.requests,
                                                                                                 step.positions)]
        if max(positions) < 0:
            return None
        return self._launch(step.requests, positions, step.device_tokens)

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> list[int]:
        # NaN/Inf logits (broken weights or numerics) never become tokens: the scheduler stops with the
        # error, and every waiting client gets it (the loop's error path)
        check_finite_logits(self.model, logits, "a serving step")
        sample = self.model.ops.sample
        if all(r.sampling.temperature <= 0 for r in requests):
            return sample(logits, 0.0).tolist()
        out = []
        for i, r in enumerate(requests):
            s = r.sampling
            out.append(int(sample(logits[i:i + 1], s.temperature, s.top_k, s.top_p, r.generator)[0]))
        return out

    def _accept(self, request: Request, token: int) -> None:
        request.generated += 1
        self.metrics.tokens(1)
        if token in self.end_ids or token in request.sampling.stop_ids:
            request.text.done, request.finish_reason = True, "stop"
            return
        request.last_token, request.position = token, request.position + 1
        request.text.add(token)
        if request.text.done:  # a stop string
            request.finish_reason = "stop"
        elif request.generated >= request.sampling.max_tokens or request.position > self.max_model_len:
            request.text.done, request.finish_reason = True, "length"

    def _drop_cancelled(self) -> None:
        for request in self.running:
            if request.cancelled.is_set():
                request.text.done, request.finish_reason = True, "cancelled"
        self._retire()

    def _retire(self) -> None:
        """Finished requests leave; the last row moves into each hole so rows stay packed."""
        row = 0
        while row < len(self.running):
            request = self.running[row]
            if not request.text.done:
                row += 1
                continue
            last = len(self.running) - 1
            if row != last:
                _move_row(self.cache, last, row)
            self.running[row] = self.running[last]
            self.running.pop()
            self._finish(request)

    def _finish(self, request: Request) -> None:
        request.text.finish()
        cancelled = request.finish_reason == "cancelled"
        with self.metrics.lock:
            if cancelled:
                self.metrics.requests_cancelled += 1
            else:
                self.metrics.requests_finished += 1
        completion = request.generated  # as vLLM counts: an EOS that ended the reply is a completion token
        request.sink({"type": "done", "finish_reason": request.finish_reason,
                      "usage": {"prompt_tokens": len(request.prompt_ids), "completion_tokens": completion,
                                "total_tokens": len(request.prompt_ids) + completion}})

    def _finish_unrun(self, request: Request) -> None:
        request.finish_reason = "cancelled"
        request.text.done = True
        self._finish(request)


class _Launched:
    """A greedy decode step queued on the device: its requests (row order), the positions they were fed, its tokens
    (on the device, one per row of its bucket) and their copy to the host (``fetch``: the token, or -1 where a row's
    logits were NaN/Inf). ``pick`` maps the requests to rows of that copy.

    The scheduler queues step t + 1 from step t's device tokens before it reads them (``Engine._launch_after``), as
    ``generate`` does, so its host work (text, stops, metrics) overlaps the GPU. The next step takes it
    (:meth:`taken_by`) when every running request was in it: rows that ended in between are left out, and rows that
    moved to stay packed are picked by request (their cache rows moved after it ran, with what it wrote). A request
    that joined drops it; its rows' slots are written again by the step that replaces it."""

    def __init__(self, requests: list[Request], positions: list[int], device_tokens: torch.Tensor,
                 fetch: _TokenFetch, pick: Optional[list[int]] = None) -> None:
        self.requests, self.positions, self.device_tokens, self.fetch = requests, positions, device_tokens, fetch
        self.pick = pick if pick is not None else list(range(len(requests)))

    def taken_by(self, running: list[Request], rows: int) -> Optional[_Launched]:
        """This step for ``running`` (rows in order; ``rows`` its bucket), or None when a running request was not in
        it or was fed position -1."""
        index = {id(r): i for i, r in enumerate(self.requests)}
        picked = [index.get(id(r), -1) for r in running]
        if any(i < 0 or self.positions[i] < 0 for i in picked):
            return None
        if picked == list(range(len(self.requests))):
            return self
        tokens = torch.zeros(rows, dtype=torch.long, device=self.device_tokens.device)  # the next step's ids
        tokens[:len(picked)] = self.device_tokens[torch.tensor(picked, device=self.device_tokens.device)]
        return _Launched(list(running), [self.positions[i] for i in picked], tokens, self.fetch,
                         [self.pick[i] for i in picked])

    def tokens(self, model: Any) -> list[int]:
        """The requests' tokens, once the copy has arrived; :class:`~musecore.generate.NonFiniteLogitsError` when a
        request's logits were NaN/Inf."""
        got = self.fetch.wait()
        tokens = [got[i] for i in self.pick]
        bad = [row for row, t in enumerate(tokens) if t < 0]
        if bad:
            raise_non_finite(model, bad, "a serving step")
        return tokens


def _left_padded(requests: list[Request], rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids and positions ``[rows, length]``, each prompt at the end of its row (as ``generate`` pads); padding
    and the rows past the requests are token 0 at position -1 (seen by nothing)."""
    ids = torch.zeros((rows, length), dtype=torch.long)
    positions = torch.full((rows, length), -1, dtype=torch.long)
    for b, r in enumerate(requests):
        n = len(r.prompt_ids)
        ids[b, length - n:] = torch.tensor(r.prompt_ids, dtype=torch.long)
        positions[b, length - n:] = torch.arange(n)
    return ids, positions


def _joined_media(per_request: list[Optional[dict]]) -> Optional[dict]:
    """Each placeholder id's feature rows of the rows of a prefill, in row order (forward's splice order)."""
    joined: dict[int, list[torch.Tensor]] = {}
    for features in per_request:
        for token, rows in (features or {}).items():
            joined.setdefault(token, []).append(rows)
    return {token: torch.cat(rows, 0) for token, rows in joined.items()} or None


def _end_ids(model: Any) -> set[int]:
    from musecore.generate import _eos_ids
    return _eos_ids(model)


def _rows(cache: KVCache, start: int, stop: int, reads: Optional[int] = None) -> KVCache:
    """A cache over rows ``[start, stop)`` of ``cache``: views of its tensors, so writes land in it. ``reads`` bounds
    what a static cache's full-attention layers read (every position in those rows lies below it)."""
    view = object.__new__(KVCache)
    view.static = cache.static
    view.layers = []
    for layer in cache.layers:
        part = copy.copy(layer)
        part.k, part.v, part.positions = layer.k[start:stop], layer.v[start:stop], layer.positions[start:stop]
        part._whole = None
        if cache.static:
            part.reads = reads
        view.layers.append(part)
    view.next_position = cache.next_position[start:stop]
    return view


def _merge_used(cache: KVCache, view: KVCache) -> None:
    """Full layers read slots ``[0, used)``; a step through a view may have raised it."""
    for layer, part in zip(cache.layers, view.layers):
        layer.used = max(layer.used, part.used)


def _move_row(cache: KVCache, src: int, dst: int) -> None:
    for layer in cache.layers:
        layer.k[dst].copy_(layer.k[src])
        layer.v[dst].copy_(layer.v[src])
        layer.positions[dst].copy_(layer.positions[src])
    cache.next_position[dst] = cache.next_position[src]
