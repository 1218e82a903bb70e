"""The tokenizer loader: round trip, special and EOS ids from file and config, clear errors."""

import json
from pathlib import Path

import pytest

from musecore.tokenizer import CHAT_SPECIAL_TOKENS, load_tokenizer

SPECIAL_TOKENS = CHAT_SPECIAL_TOKENS + ("<|pad|>",)  # ids 0..4, as the muse-tiny tokenizer orders them
CORPUS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n\tprint(i, i * i)\n",
    "Muse runs on whatever hardware you have: GPUs, CPUs and TPUs.",
    "import torch\nx = torch.zeros(3, 4)\nprint(x.shape)\n",
]


def train_small_tokenizer(folder: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE like the muse-tiny one (same pre-tokenizer, decoder, special tokens), small."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_small_tokenizer(folder)
    return folder


def test_text_round_trips_through_encode_and_decode(tokenizer_folder):
    tok = load_tokenizer(tokenizer_folder)
    for text in CORPUS + ["unseen wörds ✓ and\ttabs\n\n", "<|start|>user<|message|>hi<|eot|>"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, f"{text!r} -> {ids} -> {tok.decode(ids)!r}"


def test_chat_special_tokens_encode_to_single_ids(tokenizer_folder):
    tok = load_tokenizer(tokenizer_folder)
    for want, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_id(token) == want, f"{token}: id {tok.token_id(token)}, expected {want}"
    ids = tok.encode("<|start|>user<|message|>hi<|eot|>")
    assert ids[0] == tok.token_id("<|start|>") and ids[-1] == tok.token_id("<|eot|>"), ids


def test_eos_ids_come_from_end_tokens_and_config(tokenizer_folder, tmp_path):
    tok = load_tokenizer(tokenizer_folder)
    assert set(tok.eos_ids) == {tok.token_id("<|eot|>"), tok.token_id("<|eom|>")}, tok.eos_ids
    assert tok.pad_id == tok.token_id("<|pad|>") and tok.bos_id is None, (tok.pad_id, tok.bos_id)

    folder = tmp_path / "with_config"
    train_small_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [42, 3], "bos_token_id": 0, "pad_token_id": 7}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 99}))
    tok = load_tokenizer(folder)
    assert tok.eos_ids == (42, 3, 99, tok.token_id("<|eom|>")), tok.eos_ids  # <|eot|> is 3 already
    assert (tok.bos_id, tok.pad_id) == (0, 7), (tok.bos_id, tok.pad_id)
    assert load_tokenizer(folder, eos_token_id=5).eos_ids[0] == 5


def test_missing_tokenizer_json_gives_none(tmp_path):
    assert load_tokenizer(tmp_path) is None


def test_corrupt_tokenizer_json_error_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a valid tokenizer\.json") as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(info.value), str(info.value)


def test_unknown_token_error_names_the_token(tokenizer_folder):
    tok = load_tokenizer(tokenizer_folder)
    with pytest.raises(ValueError, match=r"'<\|nope\|>' is not in the vocabulary"):
        tok.token_id("<|nope|>")


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "tokenizer_config.json"])
def test_a_tokenizer_file_linked_from_outside_the_checkpoint_is_refused(tokenizer_folder, tmp_path, name):
    """The shards' containment applies to every file the tokenizer reads: a link out of the folder is one line."""
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(tokenizer_folder, folder)
    outside = tmp_path / f"outside-{name}"
    shutil.copy(folder / name, outside) if (folder / name).exists() else outside.write_text("{}")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(outside)
    with pytest.raises(ValueError, match="outside the checkpoint folder") as info:
        load_tokenizer(folder)
    assert "\n" not in str(info.value), str(info.value)
