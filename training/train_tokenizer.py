"""Encode both corpus splits with muse-tiny's byte-level BPE tokenizer (or, with ``--retrain``, train it first).

Byte-level BPE (GPT-2 style pre-tokenizer and decoder) so that any text, every space, tab and
newline of Python source included, decodes back to itself; the script checks that on every file
of both splits before it writes anything. Vocabulary 4096 = the 8 special tokens below (ids 0-7,
in this order), the 256 byte symbols, and 3832 merges learned from the train split only.

Documents are framed ``<|start|>`` + file text + ``<|eot|>`` (bos = ``<|start|>``, eos =
``<|eot|>``) and concatenated in path order; the token streams go to ``<corpus>/train.i16`` and
``<corpus>/heldout.i16`` (raw little-endian int16, every id < 4096), with ``tokens.json`` holding
the counts and the tokenizer's sha256 so training can check it reads what this run wrote.

The shipped tokenizer (``musecore/data/muse-tiny/tokenizer.json``) is kept as it is: by default the
script loads it and only encodes the splits. ``--retrain`` trains a new one on the train split and
writes it to ``--out`` first (on this corpus that reproduces the shipped file byte for byte).

Usage::

    python training/train_tokenizer.py --corpus .corpus                 # encode with the shipped tokenizer
    python training/train_tokenizer.py --corpus .corpus --retrain --out /tmp/tokenizer.json
"""

from __future__ import annotations

import argparse
import array
import hashlib
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# The Muse chat format's markers, then the multimodal placeholders, then padding (ids 0..7).
SPECIAL_TOKENS = ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>", "<|image|>", "<|video|>", "<|audio|>", "<|pad|>")
BOS, EOS, PAD = "<|start|>", "<|eot|>", "<|pad|>"
VOCAB_SIZE = 4096


def read_docs(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode_documents(tokenizer: Tokenizer, docs: list[dict]) -> tuple[array.array, int]:
    """The framed token stream of ``docs``, checking that each file decodes back to its text."""
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    stream = array.array("h")
    encodings = tokenizer.encode_batch([d["text"] for d in docs], add_special_tokens=False)
    failures = 0
    for doc, enc in zip(docs, encodings):
        if tokenizer.decode(enc.ids, skip_special_tokens=False) != doc["text"]:
            failures += 1
            print(f"round-trip failed: {doc['path']}", file=sys.stderr)
        stream.append(bos)
        stream.extend(enc.ids)
        stream.append(eos)
    return stream, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=Path(".corpus"))
    parser.add_argument("--out", type=Path, default=Path("musecore/data/muse-tiny/tokenizer.json"),
                        help="the tokenizer to encode with (and, with --retrain, the file to write)")
    parser.add_argument("--retrain", action="store_true", help="train a new tokenizer and write it to --out")
    args = parser.parse_args()

    train_docs, heldout_docs = read_docs(args.corpus / "train.jsonl"), read_docs(args.corpus / "heldout.jsonl")
    if args.retrain:
        tokenizer = train([d["text"] for d in train_docs])
    else:
        tokenizer = Tokenizer.from_file(str(args.out))
    got = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    assert got == list(range(len(SPECIAL_TOKENS))), got
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()

    summary = {}
    for name, docs in (("train", train_docs), ("heldout", heldout_docs)):
        stream, failures = encode_documents(tokenizer, docs)
        if failures:
            raise SystemExit(f"{failures} {name} file(s) do not decode back to their text; the tokenizer is not lossless")
        (args.corpus / f"{name}.i16").write_bytes(stream.tobytes())
        size = sum(len(d["text"].encode("utf-8")) for d in docs)
        summary[name] = {"files": len(docs), "bytes": size, "tokens": len(stream), "bytes_per_token": round(size / len(stream), 3)}
        print(f"{name}: {len(docs)} files, {len(stream):,} tokens, {size / len(stream):.2f} bytes/token, all round-trip")

    if args.retrain:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(args.out))
    summary["tokenizer_sha256"] = hashlib.sha256(args.out.read_bytes()).hexdigest()
    summary["special_tokens"] = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    (args.corpus / "tokens.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"tokenizer {args.out} (sha256 {summary['tokenizer_sha256'][:16]}...){' written' if args.retrain else ''}")


if __name__ == "__main__":
    main()
