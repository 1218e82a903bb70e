"""Every ``--json`` output of ``musecore`` and ``musecore-quant`` validates against its published schema
(``musecore/schemas``, ``musecore_quant/schemas``): the real commands are run on the bundled model,
and a failure prints every path where the output and the schema disagree."""

import json
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema", reason="the schema tests need jsonschema (the [test] extra)")

from musecore.cli import build_parser, main  # noqa: E402
from musecore.schemas import NAMES, load_schema  # noqa: E402
from musecore_quant import schemas as quant_schemas  # noqa: E402
from musecore_quant.cli import build_parser as quant_parser, main as quant_main  # noqa: E402

BUNDLED = Path(__file__).resolve().parents[2] / "musecore" / "data" / "muse-tiny"


def _check(document, schema: dict, what: str) -> None:
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    shown = "\n".join(f"  at /{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in errors[:10])
    assert not errors, f"{what}: {len(errors)} disagreement(s) with its schema:\n{shown}"


def _json_of(capsys, run, argv: list[str], ok=(0,)):
    code = run([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code in ok, f"{argv} exited {code}: {err[-2000:]}"
    return json.loads(out)


def _commands_with_json(parser) -> set[str]:
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {name for name, p in sub.choices.items() if any("--json" in a.option_strings for a in p._actions)}


def test_every_schema_is_valid_and_every_json_command_has_one():
    for name in NAMES:
        jsonschema.Draft202012Validator.check_schema(load_schema(name))
    for name in quant_schemas.NAMES:
        jsonschema.Draft202012Validator.check_schema(quant_schemas.load_schema(name))
    # calibrate is its own entry point (python -m musecore.calibrate), validated in test_autoround.py
    assert _commands_with_json(build_parser()) | {"calibrate"} == set(NAMES)
    assert _commands_with_json(quant_parser()) == set(quant_schemas.NAMES)


@pytest.mark.parametrize("argv,ok", [
    (["plan", "--json"], (0,)),
    (["plan", "--model", "muse-small", "--device", "h200", "--checkpoint-format", "nvfp4", "--json"], (0, 1)),
    (["plan", "--model", "muse-small", "--device", "h200", "--tp", "2", "--json"], (0, 1)),  # a mesh object
    (["devices", "--json"], (0,)),
    (["doctor", "--json"], (0,)),
    (["generate", "--prompt", "def", "--max-new-tokens", "3", "--device", "cpu", "--json"], (0,)),
])
def test_musecore_json_matches_its_schema(capsys, argv, ok):
    _check(_json_of(capsys, main, argv, ok), load_schema(argv[0]), "musecore " + " ".join(argv))


def test_bench_json_matches_its_schema(capsys, tmp_path):
    pytest.importorskip("musecore_xeon", reason="the xeon backend offers the benchmark run here")
    argv = ["bench", "--backend", "xeon", "--case", "attention", "--out-dir", tmp_path, "--json"]
    _check(_json_of(capsys, main, argv), load_schema("bench"), "musecore bench --backend xeon --case attention")


def test_matrix_json_matches_its_schema(capsys, tmp_path):
    argv = ["matrix", "--rows", "cpu", "--tokens", "16", "--seq-len", "16", "--op-sizes", "", "--cache-dir",
            tmp_path, "--json"]
    _check(_json_of(capsys, main, argv), load_schema("matrix"), "musecore matrix --rows cpu")


def test_musecore_quant_json_matches_its_schemas(capsys, tmp_path):
    nv = tmp_path / "nv"
    report = _json_of(capsys, quant_main, ["convert", BUNDLED, nv, "--to", "nvfp4", "--no-progress", "--json"])
    _check(report, quant_schemas.load_schema("convert"), "musecore-quant convert --json")
    _check(json.loads((nv / "conversion_report.json").read_text()), quant_schemas.load_schema("convert"),
           "conversion_report.json")
    _check(_json_of(capsys, quant_main, ["inspect", nv, "--json"]), quant_schemas.load_schema("inspect"),
           "musecore-quant inspect --json")
    _check(_json_of(capsys, quant_main, ["verify", nv, "--json"]), quant_schemas.load_schema("verify"),
           "musecore-quant verify --json")
    # exit 1: muse-tiny keeps its experts fused, the NVFP4 copy per expert (ModelOpt's layout): only_in_a/b
    _check(_json_of(capsys, quant_main, ["diff", BUNDLED, nv, "--json"], ok=(0, 1)), quant_schemas.load_schema("diff"),
           "musecore-quant diff --json")
