"""Generation against whole-sequence forward passes, batching, sampling, stops, streaming, errors, CLI."""

import copy
import dataclasses
import json
import types

import pytest
import torch

import musecore
from musecore.kv_cache import write_static
from musecore.tokenizer import load_tokenizer
from tests.helpers import random_tensors, small_config, write_checkpoint
from tests.unit.test_tokenizer import train_small_tokenizer


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls on a shared 2-core box: extra threads only spin (10-30x slower measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_text_checkpoint(folder, ascii_only: bool):
    """A small random checkpoint with a small byte-level BPE tokenizer (vocabulary sized to it).

    A random model mostly picks lone non-ASCII bytes, i.e. text full of partial characters (good
    for streaming tests). ``ascii_only`` zeroes the lm_head rows of every token that is not
    printable ASCII text, so greedy decoding writes readable text (for stop-string tests).
    """
    train_small_tokenizer(folder)
    tok = load_tokenizer(folder)
    config = small_config(vocab_size=tok.vocab_size, bos_token_id=0)
    tensors = random_tensors(config, seed=5)
    if ascii_only:
        unreadable = [i for i in range(tok.vocab_size)
                      if i < 5 or not (tok.decode([i]).isascii() and tok.decode([i]).isprintable())]
        tensors["lm_head.weight"][unreadable] = 0.0  # logit 0 never beats the best random logit
    return write_checkpoint(folder, config, tensors)


def load_with_tokenizer(folder, **kwargs):
    model = musecore.load(folder, device="cpu", **kwargs)
    assert model.tokenizer is not None, f"musecore.load did not attach {folder}/tokenizer.json"
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_text_checkpoint(tmp_path_factory.mktemp("gen") / "bytes", ascii_only=False)


@pytest.fixture(scope="module")
def ascii_checkpoint(tmp_path_factory):
    return write_text_checkpoint(tmp_path_factory.mktemp("gen") / "ascii", ascii_only=True)


@pytest.fixture(scope="module")
def bytes_model(checkpoint):
    return load_with_tokenizer(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def text_model(ascii_checkpoint):
    return load_with_tokenizer(ascii_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def ids_model(checkpoint):
    """Without a tokenizer (and no eos_token_id in the config): sequences run to max_new_tokens."""
    model = musecore.load(checkpoint, device="cpu", dtype=torch.float32)
    model.tokenizer = None
    return model


def test_greedy_decode_equals_argmax_of_whole_sequence_forward(ids_model):
    prompt = [5, 17, 42]
    out = ids_model.generate(prompt, max_new_tokens=12)  # 15 tokens > sliding window 5: the ring wraps
    assert len(out) == 12, out
    for t in range(len(out)):
        logits = ids_model.forward(torch.tensor([prompt + out[:t]]))[0, -1]
        top2 = logits.topk(2).values
        assert int(logits.argmax()) == out[t], (f"step {t}: decode chose {out[t]}, whole-sequence argmax is "
                                                f"{int(logits.argmax())} (top-2 margin {float(top2[0] - top2[1]):.3e})")


def test_seeded_sampling_is_reproducible_and_seeds_differ(ids_model):
    opts = dict(max_new_tokens=10, temperature=1.0, top_k=50, top_p=0.9)
    a, b = ids_model.generate([1, 2, 3], seed=0, **opts), ids_model.generate([1, 2, 3], seed=0, **opts)
    c = ids_model.generate([1, 2, 3], seed=1, **opts)
    assert a == b, f"same seed gave {a} and {b}"
    assert a != c, f"seeds 0 and 1 both gave {a}"


def test_top_k_1_sampling_is_greedy(ids_model):
    greedy = ids_model.generate([9, 8, 7], max_new_tokens=6)
    sampled = ids_model.generate([9, 8, 7], max_new_tokens=6, temperature=1.5, top_k=1, seed=3)
    assert sampled == greedy, f"top_k=1 sampled {sampled}, greedy {greedy}"


def test_batch_of_different_lengths_equals_one_by_one(ids_model):
    """The guarantee stated in the README (Reliability): a batched row runs the same operations as the
    prompt alone, within rounding (about 2e-5 on logits in fp32, this model's dtype), so greedy tokens
    agree wherever the top-2 logits are further apart than that (they are here: fp32, random weights)."""
    prompts = [[7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42, 43, 44]]  # 9 > window 5
    alone = [ids_model.generate(p, max_new_tokens=8) for p in prompts]
    batched = ids_model.generate(prompts, max_new_tokens=8)
    assert batched == alone, f"batched {batched}\none by one {alone}"
    # rows that stop early (left-padded and then fed position -1) leave the others untouched
    stop = alone[0][2]
    alone = [ids_model.generate(p, max_new_tokens=8, stop=stop) for p in prompts]
    batched = ids_model.generate(prompts, max_new_tokens=8, stop=stop)
    assert batched == alone, f"with stop id {stop}: batched {batched}\none by one {alone}"
    assert len(alone[0]) < 8, alone


def test_text_batch_equals_one_by_one(text_model):
    prompts = ["def fib(n):", "The quick brown fox jumps over"]
    alone = [text_model.generate(p, max_new_tokens=6) for p in prompts]
    assert text_model.generate(prompts, max_new_tokens=6) == alone


def test_stop_id_ends_generation_and_is_not_returned(ids_model):
    full = ids_model.generate([4, 5, 6], max_new_tokens=12)
    stop = full[5]
    first = full.index(stop)
    got = ids_model.generate([4, 5, 6], max_new_tokens=12, stop=[999_999, stop])
    assert got == full[:first], f"stop {stop}: got {got}, expected {full[:first]} (full {full})"
    stats = ids_model.last_generation_stats
    assert stats.new_tokens == first + 1, f"{stats.new_tokens} tokens computed, expected {first + 1} (incl. stop)"


def test_stop_string_across_tokens_ends_generation_and_is_trimmed(text_model):
    tok = text_model.tokenizer
    prompt = "for i in range("
    full_ids = text_model.generate([tok.bos_id] + tok.encode(prompt), max_new_tokens=16)
    full = text_model.generate(prompt, max_new_tokens=16)
    assert full == tok.decode(full_ids), (full, full_ids)
    pieces = [tok.decode([i]) for i in full_ids]
    # a stop string made of the last character of one token and the first of the next, as late as
    # possible so that it occurs first where we put it
    k = max(k for k in range(1, len(pieces) - 1) if (pieces[k][-1] + pieces[k + 1][0]) not in "".join(pieces[:k + 1]))
    stop = pieces[k][-1] + pieces[k + 1][0]
    want = "".join(pieces[:k + 1])[:-1]
    streamed = []
    got = text_model.generate(prompt, max_new_tokens=16, stop=["never appears", stop], stream=streamed.append)
    assert got == want, f"stop {stop!r}: got {got!r}, expected {want!r} (full {full!r})"
    assert "".join(streamed) == got, f"streamed {streamed} joins to something other than {got!r}"
    assert text_model.last_generation_stats.new_tokens == k + 2, text_model.last_generation_stats


def test_stream_receives_exactly_the_returned_pieces_in_order(ids_model, text_model, bytes_model):
    tokens = []
    out = ids_model.generate([1, 2, 3], max_new_tokens=7, stream=tokens.append)
    assert tokens == out, f"streamed {tokens}, returned {out}"

    for model in (text_model, bytes_model):  # bytes_model writes partial UTF-8 characters
        texts = []
        out = model.generate("import torch\n", max_new_tokens=12, stream=texts.append)
        assert "".join(texts) == out and len(texts) >= 2, f"streamed {texts}, returned {out!r}"
        unsettled = [p for p in texts[:-1] if p.endswith("\ufffd")]  # a partial character is held back
        assert not unsettled, f"streamed pieces ending in a partial character: {unsettled}"
    assert not out.isascii(), f"bytes_model wrote only ASCII ({out!r}): the partial-character path is untested"

    pieces = []
    outs = text_model.generate(["a", "print(x"], max_new_tokens=5, stream=lambda i, p: pieces.append((i, p)))
    joined = ["".join(p for i, p in pieces if i == row) for row in range(2)]
    assert joined == outs, f"streamed per row {joined}, returned {outs}"


def test_text_in_gives_text_out_equal_to_decoded_ids(text_model):
    tok = text_model.tokenizer
    text = text_model.generate("def fib(n):", max_new_tokens=8)
    ids = text_model.generate([tok.bos_id] + tok.encode("def fib(n):"), max_new_tokens=8)
    assert isinstance(text, str) and text == tok.decode(ids), f"{text!r} vs decode({ids}) = {tok.decode(ids)!r}"
    stats = text_model.last_generation_stats
    assert stats.prompt_tokens == len(tok.encode("def fib(n):")) + 1, stats  # BOS put first
    assert text_model.generate("def fib(n):", max_new_tokens=0) == ""


def test_incremental_detokenization_of_a_long_output_equals_decoding_it_whole(bytes_model):
    model = copy.copy(bytes_model)  # a tokenizer without EOS ids: all 100 steps run
    model.tokenizer = copy.copy(bytes_model.tokenizer)
    model.tokenizer.eos_ids = ()
    tok = model.tokenizer
    text = model.generate("x = ", max_new_tokens=100)  # > 64: the decode window gets trimmed
    ids = model.generate([tok.bos_id] + tok.encode("x = "), max_new_tokens=100)
    assert text == tok.decode(ids), f"incremental {text!r}\nwhole       {tok.decode(ids)!r}"


def test_eos_token_ends_generation(ids_model):
    full = ids_model.generate([4, 5, 6], max_new_tokens=10)
    model = copy.copy(ids_model)  # same weights, a config with eos_token_id
    model.config = dataclasses.replace(ids_model.config, eos_token_id=[full[3]])
    got = model.generate([4, 5, 6], max_new_tokens=10)
    assert got == full[:full.index(full[3])], f"eos {full[3]}: got {got}, full {full}"


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=-1), "max_new_tokens must be an int >= 0; got -1"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be an int >= 0"),
    (dict(temperature=0.5, seed="a"), "seed must be an int .*; got 'a'"),
    (dict(temperature=0.5, seed=1.5), "seed must be an int .*; got 1.5"),
    (dict(temperature=0.5, seed=1 << 64), r"seed must be an int in \[-9223372036854775808, 18446744073709551616\)"),
])
def test_invalid_options_are_rejected(ids_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ids_model.generate([1, 2], **kwargs)


def test_invalid_prompts_are_rejected_with_what_to_do(ids_model):
    limit = ids_model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"has {limit + 3} tokens, longer than max_position_embeddings {limit}"):
        ids_model.generate([1] * (limit + 3))
    with pytest.raises(ValueError, match=f"lower max_new_tokens to at most {limit - 500}"):
        ids_model.generate([1] * 500, max_new_tokens=64)
    with pytest.raises(ValueError, match="no tokenizer.*pass token ids"):
        ids_model.generate("hello")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ids_model.generate([1, ids_model.config.vocab_size])
    with pytest.raises(ValueError, match="prompt is empty"):
        ids_model.generate([])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        ids_model.generate([[1], []])
    with pytest.raises(TypeError, match="mixing"):
        ids_model.generate(["a", [1, 2]])
    with pytest.raises(ValueError, match="stop string 'zz' with a token-id prompt"):
        ids_model.generate([1, 2], stop="zz")


def test_cli_json_reports_completion_and_token_counts(checkpoint, text_model, capsys):
    from musecore.cli import main

    rc = main(["generate", "--model", str(checkpoint), "--device", "cpu", "--prompt", "def fib(n):",
               "--max-new-tokens", "5", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    report = json.loads(out)
    assert set(report) == {"completion", "prompt_tokens", "new_tokens", "tokens_per_s"}, report
    model = load_with_tokenizer(checkpoint)  # the CLI's dtype (the loader's default)
    want = model.generate("def fib(n):", max_new_tokens=5)
    assert report["completion"] == want, (report, want)
    assert report["prompt_tokens"] == len(text_model.tokenizer.encode("def fib(n):")) + 1, report
    assert 1 <= report["new_tokens"] <= 5 and report["tokens_per_s"] >= 0, report


def test_cli_streams_text_to_stdout_and_throughput_to_stderr(checkpoint, capsys):
    from musecore.cli import main

    rc = main(["generate", "--model", str(checkpoint), "--device", "cpu", "--prompt", "import",
               "--max-new-tokens", "4"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "tokens/s" in err and out.endswith("\n"), (out, err)
    rc = main(["generate", "--model", str(checkpoint), "--device", "cpu", "--prompt", "x", "--top-p", "0"])
    assert rc == 2 and "top_p must be in (0, 1]" in capsys.readouterr().err


class _GraphLikeBackend:
    """Wants static caches and counts decode-step captures, like the CUDA backend (which captures a
    CUDA graph on the cache); its "captured" step is the plain forward through that cache. Its
    ``kv_write`` counts the static writes it is handed and does them with the reference."""

    wants_static_cache = True

    def __init__(self):
        self.captures = 0
        self.kv_writes = 0

    def kv_write(self, *args):
        self.kv_writes += 1
        write_static(*args)

    def make_decode_step(self, model, cache):
        self.captures += 1
        return lambda ids, positions: model.forward(ids, positions=positions, cache=cache)


def test_static_generation_cache_and_its_decode_step_are_reused_and_reset(checkpoint, ids_model):
    model = musecore.load(checkpoint, device="cpu", dtype=torch.float32)
    model.tokenizer = None
    backend = _GraphLikeBackend()
    model.backend = backend
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3]]  # the second is longer than the sliding window 5
    first = [model.generate(p, max_new_tokens=12) for p in prompts]
    assert first == [ids_model.generate(p, max_new_tokens=12) for p in prompts], "static cache changed the output"
    assert backend.captures == 1, f"two calls of one shape captured {backend.captures} decode steps"
    layers = model.config.num_hidden_layers
    assert backend.kv_writes >= 2 * 12 * layers, f"the backend's kv_write took {backend.kv_writes} static writes"
    again = model.generate(prompts[0], max_new_tokens=12)  # after a longer prompt filled the cache
    assert again == first[0], f"a reused cache leaked the previous call's entries: {again} vs {first[0]}"
    model.generate([[1, 2], [3, 4]], max_new_tokens=4)  # another batch size: a new cache and capture
    assert backend.captures == 2
    model.release_generation_cache()
    assert model._generation_cache is None


class _GreedyGraphLikeBackend(_GraphLikeBackend):
    """Also captures the greedy decode step (``musecore_triton.graphs.GreedyGraphStep``), through a stand-in for the
    graph capture that keeps its semantics on the CPU: the body's output is static and every replay re-runs all of
    the body's ops (the position update, the step, the argmax), writing the output in place."""

    def __init__(self):
        super().__init__()
        self.greedy_captures = 0
        self.replays = 0

    def make_greedy_decode_step(self, model, cache):
        graphs = pytest.importorskip("musecore_triton.graphs", reason="musecore-triton is not installed")
        self.greedy_captures += 1

        def capture(model, cache, scope, body):
            for _ in range(2):  # the warm-ups, at position -1 (the state is all padding until start())
                body()
            out = body()

            def replay():
                self.replays += 1
                out.copy_(body())
            return types.SimpleNamespace(replay=replay), out

        original = graphs._capture
        graphs._capture = capture
        try:
            return graphs.GreedyGraphStep(model, cache)
        finally:
            graphs._capture = original


def test_greedy_decode_step_takes_the_tokens_on_the_device_and_equals_the_plain_loop(checkpoint, ids_model):
    """generate() at temperature 0 runs the backend's greedy step (position update, step and argmax in one replay)
    instead of the step + sampling, with the same tokens: batched prompts of different lengths, a row that ends
    early (its later steps at position -1), a reused capture; sampling at temperature > 0 keeps the plain step."""
    model = musecore.load(checkpoint, device="cpu", dtype=torch.float32)
    model.tokenizer = None
    backend = _GreedyGraphLikeBackend()
    model.backend = backend
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3]]
    want = ids_model.generate(prompts, max_new_tokens=12)
    assert model.generate(prompts, max_new_tokens=12) == want
    assert (backend.greedy_captures, backend.captures, backend.replays) == (1, 0, 11)
    # a stop id that ends the second row after a few tokens and never appears in the first
    cut = next(i for i in range(2, 12) if want[1][i] not in want[1][:i] + want[0])
    got = model.generate(prompts, max_new_tokens=12, stop=want[1][cut])
    assert got == [want[0], want[1][:cut]], (got, want, cut)
    assert backend.greedy_captures == 1, "a second call of one shape captured the greedy step again"
    sampled = model.generate(prompts, max_new_tokens=6, temperature=0.7, seed=1)
    assert sampled == ids_model.generate(prompts, max_new_tokens=6, temperature=0.7, seed=1)
    assert (backend.greedy_captures, backend.captures) == (1, 1)


@pytest.mark.parametrize("dtype, expected", [(None, torch.bfloat16), ("fp32", torch.float32),
                                             ("float32", torch.float32), (torch.float32, torch.float32)])
def test_load_takes_a_dtype_or_its_name(dtype, expected):
    assert musecore.load("muse-tiny", device="cpu", dtype=dtype, progress=False).dtype == expected


@pytest.mark.parametrize("dtype", ["float8", torch.int8, [1]])
def test_load_refuses_another_dtype_naming_the_choices(dtype):
    with pytest.raises(ValueError, match=r"dtype must be torch.bfloat16, torch.float16 or torch.float32 .*; got "):
        musecore.load("muse-tiny", device="cpu", dtype=dtype, progress=False)


def test_bad_launch_options_are_refused_before_anything_runs(ids_model):
    with pytest.raises(TypeError, match="stream must be a callable .*; got int"):
        ids_model.generate([1, 2], stream=5)
    with pytest.raises(ValueError, match=r"kv_format must be one of \('bf16', 'fp8'\) .*; got 'nvfp4'"):
        musecore.load("muse-tiny", device="cpu", kv_format="nvfp4", progress=False)
    for kw, said in ((dict(tp=2.5), "tp must be a positive integer, got 2.5"),
                     (dict(ep=0), "ep must be a positive integer, got 0")):  # ep=0 made a one-rank mesh and loaded
        with pytest.raises(musecore.distributed.MeshError, match=said):
            musecore.load("muse-tiny", device="cpu", progress=False, **kw)
