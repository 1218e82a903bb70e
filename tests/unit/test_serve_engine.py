"""The continuous-batching engine computes what ``generate`` computes for each request alone, while
requests join mid-decode and leave at different steps (rows are moved to stay packed)."""

import pytest
import torch

import musecore
from musecore.generate import _encode_text
from musecore.serve.engine import Engine, EngineFull, Request, Sampling
from musecore.testing import Collector, serve_all

TIMEOUT = 120


@pytest.fixture(scope="module")
def model():
    return musecore.load("muse-tiny", device="cpu")


def test_requests_joining_and_leaving_mid_decode_get_generates_greedy_output(model):
    prompts = ["def fib(n):", "import os", "Hello, my name is", "class Stack:", "x = [", "# sort a list"]
    lengths = [12, 3, 20, 7, 1, 15]  # different lengths: rows leave at different steps and are moved
    expected = [model.generate(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    engine = Engine(model, max_batch=3, max_waiting=8)  # six requests, three rows: the rest join mid-decode
    got = Collector(len(prompts))
    engine.start()
    try:
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            engine.submit(Request(_encode_text(model, p), Sampling(max_tokens=n), got.sink(i), model.tokenizer))
        assert got.all_done.wait(TIMEOUT), "the engine did not finish"
    finally:
        engine.stop()
    assert got.texts() == expected
    assert all(got.done[i]["usage"]["completion_tokens"] <= lengths[i] for i in range(len(prompts)))
    assert engine.metrics.peak_running == 3 and not engine.running


@pytest.fixture(scope="module")
def graphed():
    """muse-tiny on a backend that wants static caches (``_Captures``): the engine's graph-bucket path on the CPU."""
    model = musecore.load("muse-tiny", device="cpu")
    model.backend = _Captures(model.backend)
    return model


@pytest.mark.parametrize("path", ["plain", "graphed"])
def test_a_cancelled_request_leaves_and_the_others_continue(model, path, request):
    engine = Engine(model if path == "plain" else request.getfixturevalue("graphed"), max_batch=2)
    assert engine.graphs == (path == "graphed")
    got = Collector(2)
    engine.start()
    try:
        long = Request(_encode_text(model, "def f():"), Sampling(max_tokens=3000), got.sink(0), model.tokenizer)
        short = Request(_encode_text(model, "import os"), Sampling(max_tokens=8), got.sink(1), model.tokenizer)
        engine.submit(long)
        engine.submit(short)
        long.cancel()
        assert got.all_done.wait(TIMEOUT)
    finally:
        engine.stop()
    assert got.done[0]["finish_reason"] == "cancelled" and got.done[1]["finish_reason"] == "length"
    assert "".join(got.text[1]) == model.generate("import os", max_new_tokens=8)


def test_limits_are_checked_on_submit(model):
    engine = Engine(model, max_batch=1, max_waiting=1, max_model_len=64)  # not started: nothing leaves the queue
    tok = model.tokenizer
    with pytest.raises(ValueError, match="64"):
        engine.submit(Request([1] * 60, Sampling(max_tokens=10), lambda e: None, tok))
    engine.submit(Request([1, 2], Sampling(max_tokens=4), lambda e: None, tok))
    engine.submit(Request([1, 2], Sampling(max_tokens=4), lambda e: None, tok))
    with pytest.raises(EngineFull):
        engine.submit(Request([1, 2], Sampling(max_tokens=4), lambda e: None, tok))



def test_max_model_len_is_checked_and_capped_at_the_models_context(model, caplog):
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="max_model_len must be an integer >= 1"):
            Engine(model, max_batch=1, max_model_len=bad)
    limit = model.config.max_position_embeddings
    with caplog.at_level("WARNING", logger="musecore.serve"):
        assert Engine(model, max_batch=1, max_model_len=limit * 1000).max_model_len == limit
    assert f"max_model_len {limit * 1000} is beyond" in caplog.text, caplog.text


def test_a_kv_cache_beyond_the_free_memory_is_refused_before_it_is_allocated(model, monkeypatch):
    from musecore import kv_cache

    need = kv_cache.cache_bytes(model.config, 4, 256, model.config.num_key_value_heads, "bf16", model.dtype, False)
    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: need - 1)
    monkeypatch.setattr(kv_cache, "LayerCache", lambda *a, **k: pytest.fail("a layer's cache was allocated"))
    with pytest.raises(ValueError, match=r"KV cache of 4 rows x 256 positions \(bf16\) needs .* --max-model-len"):
        Engine(model, max_batch=4, max_model_len=256)
    with pytest.raises(ValueError, match=r"KV cache of 200000 rows"):  # generate() sizes its cache the same way
        model.generate(["x"] * 200000, max_new_tokens=8)
    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: need)
    with pytest.raises(pytest.fail.Exception, match="a layer's cache was allocated"):  # it fits: allocated
        Engine(model, max_batch=4, max_model_len=256)


def test_cache_bytes_are_what_the_cache_allocates(model):
    from musecore import kv_cache

    for kv_format, static in (("bf16", False), ("fp8", True)):
        cache = model.new_cache(3, 100, kv_format=kv_format, static=static)
        held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.k, layer.v, layer.positions))
        assert held == kv_cache.cache_bytes(model.config, 3, 100, model.config.num_key_value_heads, kv_format,
                                            model.dtype, static), (kv_format, static, held)



@pytest.mark.parametrize("path", ["plain", "graphed"])
def test_nan_logits_stop_the_engine_with_the_error_for_every_client(path):
    """Broken weights never become tokens in the server either: every waiting client gets the error."""
    broken = musecore.load("muse-tiny", device="cpu")
    broken.lm_head.data.fill_(float("nan"))
    if path == "graphed":
        broken.backend = _Captures(broken.backend)
    engine = Engine(broken, max_batch=2)
    got = Collector(2)
    engine.start()
    try:
        for i, p in enumerate(["def f():", "import os"]):
            engine.submit(Request(_encode_text(broken, p), Sampling(max_tokens=4), got.sink(i), broken.tokenizer))
        assert got.all_done.wait(TIMEOUT), "the clients were left waiting"
    finally:
        engine.stop()
    assert all(got.done[i]["finish_reason"] == "error" for i in range(2)), got.done
    assert "NaN/Inf" in got.done[0]["error"], got.done[0]
    assert not any(got.text[i] for i in range(2)), got.text


class _Captures:
    """The CPU backend, made to want static caches like a GPU backend that replays captured graphs: each "capture"
    is recorded as (rows, length bound) and its step is the plain forward through the view it was given."""

    wants_static_cache = True

    def __init__(self, backend):
        self._backend, self.captured, self.prefills = backend, [], []

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def make_decode_step(self, model, cache):
        bounds = {layer.reads for layer in cache.layers if not layer.ring}
        assert len(bounds) == 1, f"a step's full layers were given different read bounds {bounds}"
        self.captured.append((cache.next_position.shape[0], bounds.pop()))
        return lambda ids, positions: model.forward(ids, positions=positions, cache=cache)

    def make_prefill_step(self, model, cache, tokens):
        self.prefills.append((cache.next_position.shape[0], tokens))

        def step(ids, positions):
            assert ids.shape == positions.shape == (cache.next_position.shape[0], tokens), (ids.shape, tokens)
            return model.forward(ids, positions=positions, cache=cache, last_only=True)
        return step


def test_graph_buckets_compute_generates_output_and_are_captured_once_per_bucket(model):
    graphed = musecore.load("muse-tiny", device="cpu")
    backend = graphed.backend = _Captures(graphed.backend)
    prompts = ["def fib(n):", "import os", "Hello, my name is", "class Stack:", "x = [", "# sort a list",
               "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",  # a 32-token prefill bucket
               "def f(x):\n    return x\n" * 30]  # the last one: longer than the prefill graphs take (eager)
    lengths = [12, 3, 20, 7, 1, 15, 9, 5]
    assert len(_encode_text(model, prompts[-1])) > Engine.PREFILL_LENGTHS[-1]
    expected = [model.generate(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    engine = Engine(graphed, max_batch=3, max_waiting=8)
    engine.LENGTH_ROUND = 8  # short bounds, so sequences cross them while decoding
    assert engine.cache.static and engine.graphs
    engine.start()
    try:
        for attempt in range(2):  # the second wave, on the same engine, finds every bucket captured
            got = Collector(len(prompts))
            for i, (p, n) in enumerate(zip(prompts, lengths)):
                engine.submit(Request(_encode_text(graphed, p), Sampling(max_tokens=n), got.sink(i), graphed.tokenizer))
            assert got.all_done.wait(TIMEOUT), "the engine did not finish"
            texts = got.texts()
            assert texts == expected, f"wave {attempt}: bucketed static decode changed the output"
            if attempt == 0:
                first = list(backend.captured)
    finally:
        engine.stop()
    assert backend.captured == first, f"the second run captured again: {backend.captured[len(first):]}"
    # prefills: the one-row buckets of the shortest prompts at start, the others (three rows joining) when needed
    assert backend.prefills[:2] == [(1, 16), (1, 32)], backend.prefills
    assert set(backend.prefills) == set(engine.captured_prefills) and len(backend.prefills) == len(set(backend.prefills))
    assert any(rows > 1 for rows, _ in engine.captured_prefills), engine.captured_prefills
    assert len(set(first)) == len(first), f"a bucket was captured twice: {first}"
    assert {rows for rows, _ in first} <= {1, 2, 3} and {bound for _, bound in first} <= {8 << i for i in range(7)}, first
    assert any(bound > 8 for _, bound in first), f"no sequence crossed a length bound: {first}"


def test_step_bucket_rounds_rows_to_powers_of_two_and_lengths_to_doubling_bounds(model):
    engine = Engine(model, max_batch=12, max_model_len=3000)
    assert [engine.step_bucket(n, 1)[0] for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    assert [engine.step_bucket(1, n)[1] for n in (1, 256, 257, 1000, 2049, 3000)] == [256, 256, 512, 1024, 3000, 3000]


@pytest.mark.parametrize("lookahead", [True, False])
def test_lookahead_steps_give_generates_text_through_joins_stops_and_the_context_end(model, lookahead):
    """On the graph path, greedy steps are queued from the previous step's device tokens before the host reads them
    (``_Launched``). Rows end at different steps (token limits, a stop string, the context's end) while others go on,
    so a queued step is taken for a subset of its rows, gathered by request; late requests join mid-decode."""
    graphed = musecore.load("muse-tiny", device="cpu")
    graphed.backend = _Captures(graphed.backend)
    limit = 40
    cases = [("def fib(n):", 12, []), ("import os", 3, []), ("Hello, my name is", 20, ["\n"]), ("class Stack:", 7, []),
             ("x = [", 1, []), ("# sort a list", 15, [])]
    first = _encode_text(graphed, "def f():")
    cases.append(("def f():", limit - len(first), []))  # ends at the context's last position (fed -1 after it)
    expected = [model.generate(p, max_new_tokens=n, stop=stop or None) for p, n, stop in cases]
    engine = Engine(graphed, max_batch=3, max_waiting=8, max_model_len=limit, lookahead=lookahead)
    engine.LENGTH_ROUND = 8  # short bounds: the queued steps cross them too
    got = serve_all(engine, graphed, [(p, Sampling(max_tokens=n, stop_strings=stop)) for p, n, stop in cases])
    assert got.texts() == expected, f"lookahead={lookahead} changed the output"
    m = engine.metrics
    if lookahead:
        assert m.lookahead_taken >= m.decode_steps // 2, (m.lookahead_taken, m.lookahead_dropped, m.decode_steps)
    else:
        assert m.lookahead_taken == m.lookahead_dropped == 0


def test_a_queued_step_is_taken_by_a_subset_of_its_requests_and_dropped_when_one_joined():
    from musecore.generate import _TokenFetch
    from musecore.serve.engine import _Launched

    a, b, c, joined = (Request([1], Sampling(max_tokens=4), lambda e: None, None) for _ in range(4))
    fetch = _TokenFetch(4, torch.device("cpu"))
    fetch.start(torch.tensor([10, 11, -1, 0]))  # c's logits were NaN; row 3 is padding
    step = _Launched([a, b, c], [5, 6, 7], torch.tensor([10, 11, 12, 0]), fetch)
    assert step.taken_by([a, b, c], 4) is step
    moved = step.taken_by([b, a], 2)  # c ended; rows reordered
    assert moved.requests == [b, a] and moved.positions == [6, 5] and moved.device_tokens.tolist() == [11, 10]
    assert moved.tokens(None) == [11, 10]
    assert step.taken_by([a, joined], 2) is None
    assert _Launched([a, b], [5, -1], torch.tensor([10, 11]), fetch).taken_by([a, b], 2) is None  # b was fed -1
    with pytest.raises(ValueError, match="NaN/Inf.*row 2"):
        step.tokens(None)


@pytest.mark.parametrize("mode", ["all", "off"])
def test_prefill_graphs_all_are_captured_at_start_and_off_runs_every_prefill_eagerly(model, mode):
    graphed = musecore.load("muse-tiny", device="cpu")
    backend = graphed.backend = _Captures(graphed.backend)
    engine = Engine(graphed, max_batch=4, max_waiting=8, prefill_graphs=mode)
    started = engine.start_prefills()
    prompts, lengths = ["def fib(n):", "import os", "class Stack:", "x = ["], [6, 3, 5, 2]
    expected = [model.generate(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    got = serve_all(engine, graphed, [(p, Sampling(max_tokens=n)) for p, n in zip(prompts, lengths)])
    assert got.texts() == expected
    if mode == "all":
        assert started == [(r, n) for r in (1, 2, 4) for n in Engine.PREFILL_LENGTHS], started  # 4 x 256 = 1024 tokens
        assert backend.prefills == started, backend.prefills  # all at start, none later: (4, 16) was among them
    else:
        assert started == [] and backend.prefills == [] and engine.captured_prefills == []
    with pytest.raises(ValueError, match="prefill_graphs must be one of short, all, off"):
        Engine(graphed, prefill_graphs="some")
