"""NaN/Inf logits are an error at the first generated token (issue 29, item 5: all-NaN logits used to
"generate" [0, 0, ...]); with MUSECORE_DEBUG=1 the error names the first layer whose output is
non-finite. The models are real checkpoints, loaded, with one weight made NaN/Inf afterwards."""

import pytest

import musecore
from musecore.generate import NonFiniteLogitsError
from tests.helpers import random_tensors, small_config, write_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = small_config()
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), config, random_tensors(config))


@pytest.fixture
def model(folder):
    return musecore.load(folder, device="cpu")


BREAKS = {  # what is made non-finite -> the stage the debug message must name
    "layer 2 post-feedforward norm = NaN": (lambda m: m.layers[2].post_feedforward_layernorm.fill_(float("nan")),
                                           "layer 2's MLP"),
    "layer 1 o_proj = NaN": (lambda m: m.layers[1].self_attn.o_proj.data.fill_(float("nan")),
                             "layer 1's attention"),
    "embedding row = Inf": (lambda m: m.embed_tokens.data.fill_(float("inf")), "the embedding"),
    "lm_head = NaN": (lambda m: m.lm_head.data.fill_(float("nan")), "the lm_head"),
}


def test_a_healthy_model_generates(model):
    out = model.generate([0, 5, 6, 7], max_new_tokens=4)
    assert isinstance(out, list) and len(out) <= 4


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_non_finite_logits_are_an_error_that_points_at_the_debug_flag(model, case, monkeypatch):
    monkeypatch.delenv("MUSECORE_DEBUG", raising=False)
    BREAKS[case][0](model)
    with pytest.raises(NonFiniteLogitsError, match="logits are NaN/Inf at the prefill.*set MUSECORE_DEBUG=1") as e:
        model.generate([0, 5, 6, 7], max_new_tokens=4)
    assert "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_with_musecore_debug_the_error_names_the_first_non_finite_layer(model, case, monkeypatch):
    monkeypatch.setenv("MUSECORE_DEBUG", "1")
    BREAKS[case][0](model)
    with pytest.raises(NonFiniteLogitsError, match=f"the first non-finite output is {BREAKS[case][1]}") as e:
        model.generate([[0, 5, 6, 7], [0, 9]], max_new_tokens=4)  # a batch with padding: rows 0 and 1 named
    assert "rows [0, 1]" in str(e.value), str(e.value)


def test_a_prompt_with_invalid_utf8_bytes_is_one_line_exit_2(capsys):
    """``musecore generate --prompt $'abc\\xff'``: Python hands the byte over as a lone surrogate."""
    from musecore.cli import main

    assert main(["generate", "--model", "muse-tiny", "--device", "cpu", "--max-new-tokens", "2",
                 "--prompt", "abc\udcff"]) == 2
    err = capsys.readouterr().err  # a progress line for the load may come first
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "not valid UTF-8 text (byte 0xff at character 3)" in errors[0], err


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(folder, tmp_path):
    import shutil

    from musecore.api import BUNDLED

    mismatched = tmp_path / "mismatched"
    shutil.copytree(folder, mismatched)
    shutil.copy(BUNDLED / "muse-tiny" / "tokenizer.json", mismatched / "tokenizer.json")  # 4096 tokens, model 97
    model = musecore.load(mismatched, device="cpu")
    with pytest.raises(ValueError, match="tokenizer has 4096 tokens but the model's vocab_size is 97"):
        model.generate("hello", max_new_tokens=2)


def test_nan_reached_only_by_the_first_generated_token_is_caught_at_the_first_decode_step(model, monkeypatch):
    """The embedding row of the token the prefill picks is made NaN: the prompt never touches it, so
    the prefill logits are finite and only the first decode step (through the KV cache) sees it."""
    tried = {}
    for prompt in ([0, 5, 6, 7], [0, 11, 12], [0, 40, 41, 42, 43], [0, 80], [0, 20, 30, 60]):
        tried[tuple(prompt)] = first = model.generate(prompt, max_new_tokens=1)
        if first and first[0] not in prompt:
            break
    else:
        pytest.fail(f"the test needs a prompt whose first new token is not in it: {tried}")
    model.embed_tokens.data[first[0]] = float("nan")
    monkeypatch.delenv("MUSECORE_DEBUG", raising=False)
    with pytest.raises(NonFiniteLogitsError, match="at the first decode step") as e:
        model.generate(prompt, max_new_tokens=4)
    assert "\n" not in str(e.value), str(e.value)
    monkeypatch.setenv("MUSECORE_DEBUG", "1")
    with pytest.raises(NonFiniteLogitsError, match="first decode step.*the first non-finite output is the embedding"):
        model.generate(prompt, max_new_tokens=4)


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "x", "--stop", ""], "a stop string must not be empty"),
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "x", "--temperature", "inf"], "temperature must be a finite number"),
    (["--prompt", "x", "--temperature", "0.5", "--seed", str(1 << 64)], "seed must be an int in"),
])
def test_bad_generate_options_are_one_line_exit_2(capsys, argv, message):
    from musecore.cli import main

    assert main(["generate", "--model", "muse-tiny", "--device", "cpu", "--max-new-tokens", "2", *argv]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err and message in errors[0], err


def test_a_tiny_temperature_generates_like_greedy(capsys):
    """1e-40 sent every logit to +-inf and the softmax to NaN (a traceback); shifted first, it is greedy."""
    from musecore.cli import main

    outs = []
    for t in ("1e-40", "0"):
        assert main(["generate", "--model", "muse-tiny", "--device", "cpu", "--max-new-tokens", "4",
                     "--prompt", "def f():", "--temperature", t]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1], outs


def test_a_bos_outside_the_vocabulary_is_blamed_on_the_config_not_the_prompt(tmp_path, capsys):
    import json
    import shutil

    from musecore.cli import main

    folder = tmp_path / "bad_bos"
    shutil.copytree(musecore.__path__[0] + "/data/muse-tiny", folder)
    config = json.loads((folder / "config.json").read_text())
    (config.get("text_config") or config)["bos_token_id"] = 999_999
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--model", str(folder), "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "bos_token_id 999999" in err and "outside the vocabulary" in err and "Traceback" not in err, err
