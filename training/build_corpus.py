"""Build the muse-tiny training corpus: the Python standard library's source, split by file.

Why this corpus: it is on every machine that has Python, it is permissively licensed (PSF), and
a model that has read it completes Python, which is what the bundled demo model is for. The
split is by *file*, decided by a hash of the path, so it never depends on file order or on which
files another Python version adds: a file is held out when the first byte of
``sha256(relative path)`` is divisible by 10 (about 10% of files).

What is in and out (see training/README.md):

- in: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, test suites included (``test/``,
  ``idlelib/idle_test/``, ``lib2to3/tests/`` ...): they are ordinary Python and they more than
  double the data, which matters more for a 10.8M-parameter model than their style does;
- out: ``site-packages/`` (third-party), ``__pycache__/``, ``config-*/`` (build files), the two
  generated files ``_sysconfigdata_*.py`` (machine-specific build variables) and
  ``pydoc_data/topics.py`` (a 750 KB string dump of the HTML docs), and files that are not valid
  UTF-8 (a few tests of source encodings; a byte-level tokenizer could take them, but decoding
  would not round-trip them as text).

Writes ``<out>/train.jsonl`` and ``<out>/heldout.jsonl`` (one ``{"path", "sha256", "text"}`` per
line, sorted by path), the committed manifest ``training/corpus_manifest.tsv``, and the committed
held-out slice ``musecore/data/eval/stdlib_heldout_slice.jsonl`` (three held-out modules, for CI).

Usage::

    python training/build_corpus.py --out .corpus
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sysconfig
from pathlib import Path

EXCLUDED_DIRS = ("site-packages", "__pycache__")
EXCLUDED_DIR_PREFIXES = ("config-",)
GENERATED_FILES = ("pydoc_data/topics.py",)
GENERATED_PREFIXES = ("_sysconfigdata_",)
HELDOUT_MODULUS = 10
MANIFEST = Path(__file__).resolve().parent / "corpus_manifest.tsv"
# The committed held-out slice for CI (musecore/data/eval/): three small, ordinary library modules from the
# held-out split, about 4K tokens, so that the bundled-model test evaluates in seconds on a CPU.
SLICE_FILES = ("colorsys.py", "fnmatch.py", "json/tool.py")
SLICE = Path(__file__).resolve().parent.parent / "musecore/data/eval/stdlib_heldout_slice.jsonl"


def is_heldout(relative_path: str) -> bool:
    """The split rule: first byte of sha256(path relative to the stdlib root) % 10 == 0."""
    return hashlib.sha256(relative_path.encode("utf-8")).digest()[0] % HELDOUT_MODULUS == 0


def excluded_reason(relative_path: str) -> str | None:
    parts = relative_path.split("/")
    for part in parts[:-1]:
        if part in EXCLUDED_DIRS or part.startswith(EXCLUDED_DIR_PREFIXES):
            return f"directory {part}/"
    if relative_path in GENERATED_FILES or parts[-1].startswith(GENERATED_PREFIXES):
        return "generated file"
    return None


def collect(stdlib: Path) -> tuple[list[dict], list[tuple[str, str]]]:
    """Every kept source file as ``{"path", "sha256", "text"}``, and the skipped ones with why."""
    kept, skipped = [], []
    for file in sorted(stdlib.rglob("*.py")):
        relative = file.relative_to(stdlib).as_posix()
        reason = excluded_reason(relative)
        if reason is None and not file.is_file():
            reason = "not a regular file"
        if reason is not None:
            skipped.append((relative, reason))
            continue
        data = file.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append((relative, "not valid UTF-8"))
            continue
        kept.append({"path": relative, "sha256": hashlib.sha256(data).hexdigest(), "text": text})
    return kept, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".corpus"), help="folder for the two jsonl splits (git-ignored)")
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                        help="standard library root (default: this interpreter's)")
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    parser.add_argument("--slice", type=Path, default=SLICE, help="where to write the committed held-out slice")
    args = parser.parse_args()

    kept, skipped = collect(args.stdlib)
    splits = {"train": [d for d in kept if not is_heldout(d["path"])],
              "heldout": [d for d in kept if is_heldout(d["path"])]}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, docs in splits.items():
        with open(args.out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")

    with open(args.manifest, "w", encoding="utf-8") as f:
        f.write(f"# Python {platform.python_version()} standard library at {args.stdlib}\n")
        f.write(f"# rule: heldout when sha256(path)[0] % {HELDOUT_MODULUS} == 0; built by training/build_corpus.py\n")
        f.write("split\tbytes\tsha256\tpath\n")
        for doc in kept:
            split = "heldout" if is_heldout(doc["path"]) else "train"
            f.write(f"{split}\t{len(doc['text'].encode('utf-8'))}\t{doc['sha256']}\t{doc['path']}\n")
        for path, reason in skipped:
            if not path.startswith("site-packages/"):
                f.write(f"skipped ({reason})\t-\t-\t{path}\n")

    by_path = {d["path"]: d for d in splits["heldout"]}
    missing = [p for p in SLICE_FILES if p not in by_path]
    if missing:
        raise SystemExit(f"slice files {missing} are not in the held-out split of {args.stdlib}")
    args.slice.parent.mkdir(parents=True, exist_ok=True)
    with open(args.slice, "w", encoding="utf-8") as f:
        for path in SLICE_FILES:
            f.write(json.dumps(by_path[path], ensure_ascii=False) + "\n")

    for name, docs in splits.items():
        size = sum(len(d["text"].encode("utf-8")) for d in docs)
        print(f"{name}: {len(docs)} files, {size / 1e6:.2f} MB -> {args.out / (name + '.jsonl')}")
    print(f"skipped {len(skipped)} files ({sum(1 for p, _ in skipped if p.startswith('site-packages/'))} in site-packages)")
    print(f"manifest -> {args.manifest}; held-out slice {list(SLICE_FILES)} -> {args.slice}")


if __name__ == "__main__":
    main()
