"""Chat: the checkpoint's template renders as transformers renders it; model.chat streams and stops
at the template's end token; ``musecore chat`` keeps history, resets and leaves at end of input."""

import io
import json
import shutil
import subprocess
import sys

import pytest

import musecore
from musecore.api import BUNDLED
from musecore.chat import ChatTemplate
from musecore.cli import main
from musecore.tokenizer import load_tokenizer

TINY = BUNDLED / "muse-tiny"

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "print [bold]x[/bold] {{ not jinja }} {% raw %}"},
     {"role": "assistant", "content": "ok\n  indented\n"},
     {"role": "user", "content": "ünïcödé — 日本語 <|start|>"}],
    [{"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image"},
                                  {"type": "text", "text": " and listen "}, {"type": "audio"}]}],
]

# A template in the style of many Hub checkpoints: whitespace control, tojson, loop variables,
# namespace and raise_exception, all of which transformers' sandbox provides.
CHATML = """{%- set ns = namespace(n=0) -%}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}
    {% set ns.n = ns.n + 1 %}
<|start|>{{ message['role'] }}<|message|>{{ message['content'] | trim }}{{ eos_token }}
{% if loop.last and message['role'] == 'user' %}{{ '' }}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|start|>assistant<|message|>{{ {'turns': ns.n} | tojson }}{% endif %}"""


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers", reason="transformers is the oracle of the chat template")
    return transformers.AutoTokenizer.from_pretrained(str(TINY))


@pytest.fixture(scope="module")
def model():
    return musecore.load("muse-tiny", device="cpu")


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_bundled_template_renders_as_transformers_does(hf_tokenizer, index, generation_prompt):
    messages = CONVERSATIONS[index]
    template = ChatTemplate.from_folder(TINY)
    ours = template.render(messages, add_generation_prompt=generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours == theirs
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    tok = load_tokenizer(TINY)
    assert tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True) == list(ids)


def test_a_hub_style_template_with_whitespace_control_renders_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is the oracle of the chat template")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(TINY / name, folder / name)
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    config["chat_template"] = CHATML
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    template = ChatTemplate.from_folder(folder)
    for messages in CONVERSATIONS[:3]:
        for generation_prompt in (True, False):
            assert template.render(messages, generation_prompt) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt)
    with pytest.raises(ValueError, match="bad role"):
        template.render([{"role": "tool", "content": "x"}])


def test_a_template_that_is_not_jinja_is_reported_with_its_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        ChatTemplate.from_folder(tmp_path)


def test_messages_that_are_not_role_content_dicts_are_rejected(model):
    with pytest.raises(ValueError, match="role"):
        model.chat([{"content": "no role"}])
    with pytest.raises(ValueError, match="non-empty list"):
        model.chat([])


def test_chat_reply_is_generate_on_the_rendered_prompt_cut_at_the_end_token(model):
    messages = CONVERSATIONS[1]
    ids = model.tokenizer.apply_chat_template(messages, tokenize=True)
    eot = model.tokenizer.token_id("<|eot|>")
    raw = model.generate(ids, max_new_tokens=24, stop=[])
    expected = raw[:raw.index(eot)] if eot in raw else raw
    assert model.chat(messages, max_new_tokens=24) == model.tokenizer.decode(expected)


def test_chat_streams_through_a_callback_and_an_iterator_to_the_same_reply(model):
    messages = CONVERSATIONS[0]
    reply = model.chat(messages, max_new_tokens=16)
    pieces = []
    assert model.chat(messages, max_new_tokens=16, stream=pieces.append) == reply
    assert "".join(pieces) == reply and len(pieces) > 1
    streamed = list(model.chat_stream(messages, max_new_tokens=16))
    assert "".join(streamed) == reply


def test_closing_the_stream_early_stops_generation(model):
    stream = model.chat_stream(CONVERSATIONS[0], max_new_tokens=400)
    first = next(stream)
    stream.close()  # joins the worker: it must stop at the next token, not after 400
    assert isinstance(first, str)
    assert model.last_generation_stats.new_tokens < 400


def test_a_stop_string_cuts_the_reply(model):
    reply = model.chat(CONVERSATIONS[0], max_new_tokens=32)
    if len(reply) < 4:
        pytest.skip(f"the bundled model's reply is too short to cut: {reply!r}")
    cut = reply[2:4]
    assert model.chat(CONVERSATIONS[0], max_new_tokens=32, stop=cut) == reply[:reply.index(cut)]


def test_chat_command_keeps_history_resets_and_exits_at_end_of_input(model, monkeypatch, capsys):
    seen = []
    chat = model.chat

    def recording_chat(messages, **kwargs):
        seen.append([m["content"] for m in messages])
        return chat(messages, **kwargs)

    monkeypatch.setattr(model, "chat", recording_chat)
    monkeypatch.setattr(musecore, "load", lambda *a, **k: model)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n/reset\n\nhello\n"))
    assert main(["chat", "--device", "cpu", "--max-new-tokens", "6", "--system", "be brief"]) == 0
    out, err = capsys.readouterr()
    assert len(seen) == 3, seen
    assert seen[0] == ["be brief", "hello"]
    assert seen[1][:2] == ["be brief", "hello"] and seen[1][-1] == "again" and len(seen[1]) == 4  # history kept
    assert seen[2] == ["be brief", "hello"]  # /reset keeps only the system message
    assert "conversation reset" in err and "Traceback" not in err



def test_piped_chat_input_the_model_cannot_take_is_one_error_line(model, monkeypatch, capsys):
    """Piped input ends the command at a message the model cannot take, with one error line (it was printed twice:
    the conversation's "error:" and the command's)."""
    monkeypatch.setattr(musecore, "load", lambda *a, **k: model)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello " * 9000 + "\n"))
    assert main(["chat", "--device", "cpu", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "max_position_embeddings" in errors[0] and "Traceback" not in err, err


def test_chat_command_answers_help_and_unknown_commands_and_sends_escaped_or_path_like_slashes(model, monkeypatch,
                                                                                                 capsys):
    seen = []
    monkeypatch.setattr(model, "chat", lambda messages, **kwargs: seen.append(messages[-1]["content"]) or "ok")
    monkeypatch.setattr(musecore, "load", lambda *a, **k: model)
    monkeypatch.setattr(sys, "stdin", io.StringIO("/help\n/imgae cat.png\n//reset is a command\n/usr/bin is a dir\n"
                                                  "hello there\n"))
    assert main(["chat", "--device", "cpu", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert seen == ["/reset is a command", "/usr/bin is a dir", "hello there"], seen
    assert "(unknown command /imgae; commands: /image PATH" in err and err.count("/help shows this") == 2, err


def test_chat_command_runs_with_piped_input_and_exits_cleanly_at_eof():
    run = subprocess.run([sys.executable, "-m", "musecore.cli", "chat", "--device", "cpu", "--max-new-tokens", "8"],
                         input="hello\n/reset\nhello\n", capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    half = len(run.stdout) // 2  # the same question after /reset gets the same greedy reply
    assert run.stdout[:half] == run.stdout[half:] and run.stdout.endswith("\n"), run.stdout
