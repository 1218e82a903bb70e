"""Bad input to model.forward / new_cache, numpy integers as options and ids, and the CLI's option checks:
one clear line each (TypeError / ValueError naming the argument), never a raw torch error."""

import numpy as np
import pytest
import torch

import musecore
from musecore.cli import main


@pytest.fixture(scope="module")
def model():
    return musecore.load("muse-tiny", device="cpu", progress=False)


@pytest.mark.parametrize("ids, error, words", [
    (torch.tensor([[5000]]), ValueError, "outside the vocabulary [0, 4096): [5000]"),
    (torch.tensor([[1, -1]]), ValueError, "outside the vocabulary [0, 4096): [-1]"),
    ([[1, 2]], TypeError, "input_ids must be a torch.Tensor of token ids [batch, tokens]; got list: wrap them"),
    (torch.tensor([[1.0, 2.0]]), TypeError, "integer token ids (torch.long); got dtype torch.float32"),
    (torch.tensor([[True]]), TypeError, "got dtype torch.bool"),
    (torch.zeros(1, 0, dtype=torch.long), ValueError, "input_ids is empty (shape [1, 0])"),
    (torch.tensor([1, 2]), ValueError, "input_ids must be 2-D [batch, tokens]; got shape [2]: for one sequence"),
    (torch.ones(1, 1, 2, dtype=torch.long), ValueError, "got shape [1, 1, 2]"),
])
def test_forward_rejects_bad_input_ids_with_one_line_naming_them(model, ids, error, words):
    with pytest.raises(error) as info:
        model.forward(ids)
    message = str(info.value)
    assert words in message and "\n" not in message, message


def test_forward_rejects_bad_ids_through_a_cache_and_still_runs_good_ones(model):
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.forward(torch.tensor([[1, 4096]]), cache=cache)
    logits = model.forward(torch.tensor([[1, 4095]], dtype=torch.int32), cache=model.new_cache(1, 8))
    assert logits.shape == (1, 2, model.config.vocab_size)


@pytest.mark.parametrize("batch, max_length, words", [
    (1, -1, "max_length must be an int >= 1; got -1"),
    (0, 8, "batch must be an int >= 1; got 0"),
    (1, 2.5, "max_length must be an int >= 1; got 2.5"),
    (True, 8, "batch must be an int >= 1; got True"),
])
def test_new_cache_rejects_bad_sizes_naming_the_argument(model, batch, max_length, words):
    with pytest.raises(ValueError) as info:
        model.new_cache(batch, max_length)
    assert words in str(info.value), info.value


def test_new_cache_takes_numpy_sizes(model):
    cache = model.new_cache(np.int64(1), np.int32(8))
    assert model.forward(torch.tensor([[1, 2]]), cache=cache).shape[:2] == (1, 2)


def test_generate_takes_numpy_integers_for_options_ids_and_stops(model):
    want = model.generate([1, 2, 3], max_new_tokens=3, top_k=5, temperature=0.7, seed=4)
    got = model.generate([np.int64(1), np.int32(2), 3], max_new_tokens=np.int64(3), top_k=np.int64(5),
                         temperature=np.float32(0.7), seed=np.int64(4))
    assert got == want and all(type(t) is int for t in got), got
    batch = model.generate([[np.int64(1), 2], [3]], max_new_tokens=np.int16(2))
    assert batch == [model.generate([1, 2], max_new_tokens=2), model.generate([3], max_new_tokens=2)]
    stop = want[1] if len(want) > 1 else want[0]
    assert model.generate([1, 2, 3], max_new_tokens=3, top_k=5, temperature=0.7, seed=4, stop=np.int64(stop)) == \
        want[:want.index(stop)]


@pytest.mark.parametrize("options, words", [
    ({"max_new_tokens": np.bool_(True)}, "max_new_tokens must be an int >= 0"),
    ({"max_new_tokens": True}, "max_new_tokens must be an int >= 0"),
    ({"max_new_tokens": np.int64(-1)}, "max_new_tokens must be an int >= 0; got np.int64(-1)"),
    ({"seed": np.uint64((1 << 64) - 1), "temperature": 1.0}, None),
])
def test_generate_still_rejects_bools_and_negative_numpy_integers(model, options, words):
    if words is None:  # the largest seed torch takes, as a numpy uint64, is accepted
        assert len(model.generate([1, 2], max_new_tokens=1, **options)) <= 1
        return
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        model.generate([1, 2], **options)


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("option, words", [
    (["--max-new-tokens", "-1"], "max_new_tokens must be an int >= 0; got -1"),
    (["--temperature", "nan"], "temperature must be a finite number >= 0"),
    (["--seed", str(1 << 64)], "seed must be an int in"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-k", "-2"], "top_k must be an int >= 0"),
])
def test_cli_rejects_bad_sampling_options_before_loading_the_model(command, option, words, monkeypatch, capsys):
    monkeypatch.setattr(musecore, "load", lambda *a, **k: pytest.fail("loaded the model before checking the options"))
    prompt = ["--prompt", "hi"] if command == "generate" else []
    assert main([command, "--device", "cpu", *prompt, *option]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in err, err
