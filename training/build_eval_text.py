"""Build musecore/data/eval/stdlib_heldout_64k.jsonl.gz: >= 65,536 muse-tiny tokens of held-out stdlib files.

Eligible: files whose split is "heldout" in training/corpus_manifest.tsv (never trained on), minus the
matrix's calibration modules (musecore.matrix.CALIBRATION_MODULES), each checked byte-for-byte
against the manifest's sha256. Sorted by path; every 8th file from the first.
"""
import gzip, hashlib, io, json, platform, sysconfig
from pathlib import Path
from musecore.tokenizer import load_tokenizer
from musecore.matrix import CALIBRATION_MODULES

REPO = Path(__file__).resolve().parents[1]  # the repository
STRIDE, MIN_TOKENS = 8, 65_536
OUT = REPO / "musecore/data/eval/stdlib_heldout_64k.jsonl.gz"
MANIFEST = REPO / "musecore/data/eval/stdlib_heldout_64k.manifest.tsv"
tok = load_tokenizer(REPO / "musecore/data/muse-tiny")
stdlib = Path(sysconfig.get_paths()["stdlib"])
lines = [l.rstrip("\n").split("\t") for l in open(REPO / "training/corpus_manifest.tsv") if not l.startswith("#")]
assert lines[0] == ["split", "bytes", "sha256", "path"], lines[0]
rows = lines[1:]
train = {r[3] for r in rows if r[0] == "train"}
eligible = sorted((r for r in rows if r[0] == "heldout" and r[3] not in CALIBRATION_MODULES), key=lambda r: r[3])
picked = eligible[::STRIDE]
python = platform.python_version()
assert python == "3.11.7", python
docs, table, total = [], [], 0
for split, size, sha, path in picked:
    assert path not in train
    data = (stdlib / path).read_bytes()
    assert hashlib.sha256(data).hexdigest() == sha and len(data) == int(size), path
    text = data.decode("utf-8")
    n = 1 + len(tok.encode(text, add_special_tokens=False)) + 1  # BOS + text + EOS, as the loader frames it
    total += n
    docs.append({"path": path, "python": python, "sha256": sha, "text": text})
    table.append(f"{path}\t{python}\t{sha}\t{size}\t{n}")
assert total >= MIN_TOKENS, total
buf = io.BytesIO()
with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as f:
    for d in docs:
        f.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
OUT.write_bytes(buf.getvalue())
with open(MANIFEST, "w", encoding="utf-8") as f:
    f.write(f"# {OUT.name}: the accuracy matrix's default evaluation text, {len(docs)} files, {total} muse-tiny tokens "
            "(each file framed <|start|> + text + <|eot|>, in this order)\n")
    f.write(f"# source: CPython {python} standard library; only files in the held-out split of training/corpus_manifest.tsv "
            "(sha256(path)[0] % 10 == 0: never trained on), sha256 checked against it\n")
    f.write(f"# rule: held-out files sorted by path, minus the calibration modules (musecore.matrix.CALIBRATION_MODULES: "
            f"{', '.join(CALIBRATION_MODULES)}); every {STRIDE}th from the first\n")
    f.write("path\tpython\tsha256\tbytes\ttokens\n")
    for line in table:
        f.write(line + "\n")
print(len(docs), total, OUT.stat().st_size, "bytes gz")
