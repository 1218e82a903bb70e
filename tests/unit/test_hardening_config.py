"""The validated config schema (issue 29, items 1, 4, 5): every case the issue lists is a one-line
error naming config.json and the field, from ``MuseConfig``, ``plan()``, ``load()`` and the CLI, in
milliseconds and without allocating what the config describes; ``plan()`` checks the config against
the tensor shapes in the safetensors headers; and a hypothesis fuzz of config.json (CI budget
``MUSECORE_FUZZ_EXAMPLES``, default 150; ``MUSECORE_FUZZ_REPORT=path`` writes the counts):

    MUSECORE_FUZZ_EXAMPLES=20000 MUSECORE_FUZZ_REPORT=fuzz.json \
        python -m pytest -q tests/unit/test_hardening_config.py -k fuzz
"""

from __future__ import annotations

import atexit
import json
import math
import os
import signal
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import musecore
from musecore.cli import main
from musecore.config import MAX_WEIGHT_BYTES, ConfigError, MuseConfig, weight_bytes
from musecore.rope import RotaryTable
from tests.helpers import random_tensors, small_config, write_checkpoint

FAST_S = 1.0          # tolerance: a refused config costs at most this much wall time (measured: ~0.1 s)
MEMORY = 64 * 2**20   # tolerance: ... and at most this many bytes of Python allocations (tracemalloc peak)

NAN, INF = float("nan"), float("inf")
CASES = {  # issue 29's cases: (config.json section, key, value) -> the field the error must name
    "num_local_experts=10**7": ("text_config", "num_local_experts", 10**7, "text_config.num_local_experts"),
    "num_hidden_layers=10**7": ("text_config", "num_hidden_layers", 10**7, "text_config.num_hidden_layers"),
    "head_dim=10**12": ("text_config", "head_dim", 10**12, "text_config.head_dim"),
    "vocab 2**30 x hidden 2**20": ("text_config", "vocab_size", 2**30, "budget"),
    "sliding_window='64'": ("text_config", "sliding_window", "64", "text_config.sliding_window"),
    "rms_norm_eps='1e-6'": ("text_config", "rms_norm_eps", "1e-6", "text_config.rms_norm_eps"),
    "rms_norm_eps=NaN": ("text_config", "rms_norm_eps", NAN, "text_config.rms_norm_eps"),
    "rms_norm_eps=Inf": ("text_config", "rms_norm_eps", INF, "text_config.rms_norm_eps"),
    "rms_norm_eps<0": ("text_config", "rms_norm_eps", -1e-6, "text_config.rms_norm_eps"),
    "rope_parameters list": ("text_config", "rope_parameters", [1, 2], "text_config.rope_parameters"),
    "rope_theta=NaN": ("rope", "rope_theta", NAN, "text_config.rope_parameters.rope_theta"),
    "rope_theta=0": ("rope", "rope_theta", 0, "text_config.rope_parameters.rope_theta"),
    "rope_theta<0": ("rope", "rope_theta", -10000.0, "text_config.rope_parameters.rope_theta"),
    "yarn without factor": ("yarn", "factor", None, "text_config.rope_parameters.factor"),
    "yarn factor=0": ("yarn", "factor", 0, "text_config.rope_parameters.factor"),
    "text_config='x'": ("outer", "text_config", "x", "text_config object"),
    "layer_types nested lists": ("text_config", "layer_types", [["full_attention"]] * 4, "text_config.layer_types"),
    "layer_rope_theta NaN": ("text_config", "layer_rope_theta", [NAN] * 4, "text_config.layer_rope_theta"),
    "eos_token_id ['x']": ("text_config", "eos_token_id", ["x"], "text_config.eos_token_id"),
    "vision_config list": ("outer", "vision_config", [1], "vision_config"),
    "quantization_config string": ("outer", "quantization_config", "fp8", "quantization_config"),
    "num_experts_per_tok > experts": ("text_config", "num_experts_per_tok", 7, "text_config.num_experts_per_tok"),
}


def mutate(data: dict, where: str, key: str, value) -> dict:
    data = json.loads(json.dumps(data))
    text = data["text_config"]
    if where == "text_config":
        text[key] = value
    elif where == "rope":
        text["rope_parameters"][key] = value
    elif where == "yarn":
        text["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 64}
        if value is not None:
            text["rope_parameters"][key] = value
    else:
        data[key] = value
    if key == "vocab_size" and value == 2**30:
        text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"] = 2**20, 2**14, 2**14
    return data


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = small_config()
    return write_checkpoint(tmp_path_factory.mktemp("good"), config, random_tensors(config)), config


def with_config(folder: Path, tmp_path: Path, data: dict) -> Path:
    """A copy of checkpoint ``folder`` (weights hard-linked: a symlink out of the folder is refused) with
    ``data`` as its config.json."""
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for f in folder.iterdir():
        if f.name != "config.json":
            os.link(f, copy / f.name)
    (copy / "config.json").write_text(json.dumps(data, allow_nan=True))
    return copy


def refused_quickly(call, match: str) -> str:
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ValueError) as e:
            call()
    finally:
        took = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    message = str(e.value)
    assert match in message, message
    assert "\n" not in message, message
    assert took < FAST_S, f"refusing took {took:.3f} s (tolerance {FAST_S} s): {message}"
    assert peak < MEMORY, f"refusing allocated {peak / 2**20:.1f} MiB (tolerance {MEMORY / 2**20:.0f} MiB)"
    return message


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_listed_case_is_a_one_line_error_from_plan_and_load(checkpoint, tmp_path, case):
    folder, config = checkpoint
    where, key, value, field = CASES[case]
    bad = with_config(folder, tmp_path, mutate(config.to_dict(), where, key, value))
    for call in (lambda: musecore.plan(bad, device="cpu"), lambda: musecore.load(bad, device="cpu")):
        message = refused_quickly(call, "config.json")
        assert field in message or (field == "budget" and "budget" in message), (field, message)


@pytest.mark.parametrize("case", ["num_hidden_layers=10**7", "rms_norm_eps='1e-6'", "text_config='x'"])
def test_the_cli_prints_one_line_and_exits_2(checkpoint, tmp_path, capsys, case):
    folder, config = checkpoint
    where, key, value, field = CASES[case]
    bad = with_config(folder, tmp_path, mutate(config.to_dict(), where, key, value))
    assert main(["plan", "--model", str(bad), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and field in err and "config.json" in err, err


def test_deeply_nested_json_in_config_is_a_clean_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "muse_spark", "text_config": ' + "[" * 100_000
                                          + "]" * 100_000 + "}")
    refused_quickly(lambda: MuseConfig.from_pretrained(tmp_path), "config.json")


def test_budget_is_computed_in_closed_form_before_any_list(tmp_path):
    """The 816B preset is inside the budget; one 1024x larger is refused without building anything."""
    big = MuseConfig.from_name("muse-spark-open-816b-a42b")
    assert weight_bytes(big) == 2 * big.num_parameters(), (weight_bytes(big), 2 * big.num_parameters())
    assert weight_bytes(big) < MAX_WEIGHT_BYTES
    data = big.to_dict()
    data["text_config"].update(vocab_size=2**31 - 1, hidden_size=2**19, num_attention_heads=2**10,
                               num_key_value_heads=2**10)
    with pytest.raises(ConfigError, match="budget of 1 PiB"):
        MuseConfig.from_dict(data)


# -- plan() against the headers -----------------------------------------------------------------------

SHAPE_CASES = {  # text_config change -> what the error must name
    "num_local_experts 6 -> 7": ({"num_local_experts": 7}, "text_config.num_local_experts"),
    "moe_intermediate_size 48 -> 40": ({"moe_intermediate_size": 40}, "text_config.moe_intermediate_size"),
    "vocab_size 97 -> 100": ({"vocab_size": 100}, "text_config.vocab_size"),
    "head_dim 16 -> 8": ({"head_dim": 8}, "text_config.head_dim"),
    "intermediate_size with a dense layer": ({"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
                                             "text_config.mlp_layer_types"),
    "3 layers for a 4-layer checkpoint": ({"num_hidden_layers": 3, "layer_types": None, "mlp_layer_types": None,
                                           "layer_rope_theta": None}, "text_config.num_hidden_layers"),
    "5 layers for a 4-layer checkpoint": ({"num_hidden_layers": 5, "layer_types": None, "mlp_layer_types": None,
                                           "layer_rope_theta": None}, "missing"),
}


@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_plan_refuses_a_config_that_contradicts_the_header_shapes(checkpoint, tmp_path, case):
    folder, config = checkpoint
    data = config.to_dict()
    for key, value in SHAPE_CASES[case][0].items():
        if value is None:
            data["text_config"].pop(key)
        else:
            data["text_config"][key] = value
    bad = with_config(folder, tmp_path, data)
    message = refused_quickly(lambda: musecore.plan(bad, device="cpu"), "config.json")
    assert SHAPE_CASES[case][1] in message, message


def test_plan_accepts_the_matching_config_and_per_expert_checkpoints(checkpoint, tmp_path):
    folder, config = checkpoint
    assert musecore.plan(folder, device="cpu").backend == "reference"
    tensors = random_tensors(config)
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:  # a producer's per-expert layout
        prefix, fused = name.rsplit(".", 1)[0], tensors.pop(name)
        down = tensors.pop(prefix + ".down_proj")
        inter = fused.shape[1] // 2
        for e in range(fused.shape[0]):
            tensors[f"{prefix}.{e}.gate_proj.weight"] = fused[e, :inter].clone()
            tensors[f"{prefix}.{e}.up_proj.weight"] = fused[e, inter:].clone()
            tensors[f"{prefix}.{e}.down_proj.weight"] = down[e].clone()
    per_expert = write_checkpoint(tmp_path / "per-expert", config, tensors)
    assert musecore.plan(per_expert, device="cpu").backend == "reference"
    dropped = next(n for n in tensors if n.endswith(".3.up_proj.weight"))
    tensors.pop(dropped)
    missing = write_checkpoint(tmp_path / "missing", config, tensors)
    message = refused_quickly(lambda: musecore.plan(missing, device="cpu"), "missing 2 tensor(s)")
    assert "experts.gate_up_proj" in message and "experts.down_proj" in message, message


# -- fuzz ------------------------------------------------------------------------------------------------

MAX_EXAMPLES = int(os.environ.get("MUSECORE_FUZZ_EXAMPLES", "150"))
DEADLINE_S = float(os.environ.get("MUSECORE_FUZZ_DEADLINE_S", "10"))
FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=MAX_EXAMPLES <= 150,
                suppress_health_check=list(HealthCheck))
PLAN_EXAMPLES = max(10, MAX_EXAMPLES // 10)  # each plan reads a checkpoint's headers: ~10x a config parse
COUNTS: dict[str, Counter] = {}


def _report() -> None:
    """Merge this file's counts into ``$MUSECORE_FUZZ_REPORT`` (the quant fuzz suite writes there too)."""
    path = os.environ.get("MUSECORE_FUZZ_REPORT")
    if not path or not COUNTS:
        return
    report = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
    report.update({k: dict(v) for k, v in COUNTS.items()})
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


atexit.register(_report)


class Hang(BaseException):
    """Raised by the per-example alarm; a BaseException so that no parser can swallow it."""


def _on_alarm(signum, frame):
    raise Hang(f"example took longer than {DEADLINE_S} s")


def silent_problem(config: MuseConfig) -> str | None:
    """For an accepted config: what would make it compute garbage silently (None: nothing)."""
    numbers = [getattr(config, f) for f in ("rms_norm_eps", "post_norm_eps", "qk_scale_factor", "output_multiplier",
                                            "final_logit_softcapping", "residual_gate_temperature")]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in numbers):
        return f"non-finite or non-positive scalar accepted: {numbers}"
    if weight_bytes(config) > MAX_WEIGHT_BYTES:
        return "over the weight budget"
    if min(config.head_dim, 64) > 0:
        table = RotaryTable(min(config.head_dim, 64), config.rope_parameters, min(config.max_position_embeddings, 64))
        cos, sin = table(torch.arange(8)[None])
        if not (torch.isfinite(cos).all() and torch.isfinite(sin).all()):
            return f"rope_parameters {config.rope_parameters} give a non-finite rotary table"
    if not (len(config.layer_types) == len(config.mlp_layer_types) == config.num_hidden_layers):
        return "layer lists of the wrong length"
    return None


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=8), st.sampled_from([10**7, 10**12, 2**31, 0, -1, 1, "64", "1e-6", "\ud800",
                                                           "yarn", "default", "sparse", "full_attention"]))
json_values = st.recursive(_scalars, lambda kids: st.one_of(st.lists(kids, max_size=5),
                                                            st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                           max_leaves=10)
TEXT_KEYS = sorted(small_config().text_dict()) + ["num_experts", "rope_scaling", "x"]
ROPE_KEYS = ["rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor"]
OUTER_KEYS = ["text_config", "vision_config", "audio_config", "quantization_config", "model_type", "image_token_id"]
edits = st.lists(st.tuples(st.sampled_from(["text_config", "rope", "outer", "delete"]),
                           st.sampled_from(TEXT_KEYS + ROPE_KEYS + OUTER_KEYS), json_values), min_size=1, max_size=4)


def apply_edits(data: dict, edits) -> dict:
    data = json.loads(json.dumps(data))
    for where, key, value in edits:
        text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
        if where == "text_config":
            text[key] = value
        elif where == "rope" and isinstance(text.get("rope_parameters"), dict):
            text["rope_parameters"][key] = value
        elif where == "outer":
            data[key] = value
        else:
            text.pop(key, None)
    return data


def run_example(parser: str, call, what) -> None:
    """``call()`` under the deadline and tracemalloc; counts parsed / silent / clean_error / crash /
    hang / memory for ``parser``; anything but a clean result or a one-line ValueError fails."""
    counts = COUNTS.setdefault(parser, Counter())
    counts["tried"] += 1
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, DEADLINE_S)
    tracemalloc.start()
    try:
        problem = call()
        counts["silent" if problem else "parsed"] += 1
        assert problem is None, (problem, what)
    except ValueError as e:
        counts["clean_error"] += 1
        assert "\n" not in str(e), str(e)
    except Hang:
        counts["hang"] += 1
        raise
    except MemoryError:
        counts["memory"] += 1
        raise
    except AssertionError:
        raise
    except Exception:
        counts["crash"] += 1
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if peak > MEMORY:
        counts["memory"] += 1
    assert peak <= MEMORY, f"{peak / 2**20:.1f} MiB for {what}"


@FUZZ
@given(edits=edits)
def test_fuzz_config_json(tmp_path_factory, edits):
    data = apply_edits(small_config().to_dict(), edits)
    folder = tmp_path_factory.mktemp("fuzz", numbered=True)
    (folder / "config.json").write_bytes(json.dumps(data, allow_nan=True).encode("utf-8", "surrogatepass"))
    try:
        run_example("config.json (MuseConfig.from_pretrained)",
                    lambda: silent_problem(MuseConfig.from_pretrained(folder)), edits)
    finally:
        (folder / "config.json").unlink()
        folder.rmdir()


size_edits = st.lists(st.tuples(st.sampled_from(["text_config", "rope", "delete"]),
                                st.sampled_from(TEXT_KEYS + ROPE_KEYS),
                                st.one_of(json_values, st.integers(0, 200), st.sampled_from([10**7, 10**12]))),
                      min_size=1, max_size=3)


@settings(FUZZ, max_examples=PLAN_EXAMPLES)
@given(edits=size_edits)
def test_fuzz_plan_against_a_checkpoint(checkpoint, tmp_path_factory, edits):
    """plan() on a real checkpoint with a fuzzed config.json: a plan (the config then matches every
    header shape) or a one-line ValueError; never a crash, a hang or a memory blow-up."""
    folder, config = checkpoint
    copy = with_config(folder, tmp_path_factory.mktemp("plan", numbered=True),
                       apply_edits(config.to_dict(), edits))

    def plan_it():
        musecore.plan(copy, device="cpu")
        return silent_problem(MuseConfig.from_pretrained(copy))

    try:
        run_example("plan() on a checkpoint with a fuzzed config.json", plan_it, edits)
    finally:
        for f in copy.iterdir():
            f.unlink()
        copy.rmdir()
