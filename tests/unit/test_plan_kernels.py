"""The plan shows every kernel choice of its backend, the environment overrides in force, and counts
the bytes the backend really keeps resident; load and plan resolve devices alike.

A fake backend (the reference math under the name ``fakegpu``, which the ``mi355x`` profile is pointed
at for these tests, so the real ``rocm`` plugin may be installed beside it) stands in for the hardware
plugins: registered in-process for the plan, and through the entry point for ``load``.
"""

import json
import os
import re
from pathlib import Path

import pytest
import torch

import musecore
from musecore.api import summarize
from musecore.backends.base import EnvSetting, KernelChoice, Probe, Support
from musecore.backends.reference import ReferenceBackend
from musecore.backends.registry import PluginRecord
from musecore.planning import make_plan
from tests.helpers import random_tensors, small_config, write_checkpoint

ENV = "MUSECORE_FAKE_GEMM"

FAKE = '''
import os
from musecore.backends.base import EnvSetting, KernelChoice, Probe, Support
from musecore.backends.reference import ReferenceBackend


class FakeRocm(ReferenceBackend):
    """The reference math, claiming to be a native MI355X backend with one kernel choice per linear."""

    name = "fakegpu"
    asked = []

    def probe(self):
        return Probe(available=True, score=50, devices=["mi355x"], reason="fake MI355X for the tests")

    def supports(self, op, spec):
        return Support.native("fake: the reference math")

    def kernel_choices(self, linears, profile):
        type(self).asked = list(linears)
        return [KernelChoice(f"linear {l.name} {l.weight_format} {l.out_features}x{l.in_features}"
                             + (f" x{l.experts} experts, top {l.top_k}" if l.experts else ""),
                             "fake GEMM" if l.experts == 0 else "fake grouped GEMM",
                             f"{profile.name}: always", "{env}") for l in linears]

    def env_settings(self):
        return [EnvSetting("{env}", os.environ.get("{env}"), "auto", "forces the fake GEMM everywhere"),
                EnvSetting("MUSECORE_FAKE_UNSET_KNOB", None, "8", "never set in the tests")]

    def resident_bytes(self, weight_format, out_features, in_features, *, experts=0):
        # experts keep a padded copy three times the size of their bf16 values; the rest: the format's bytes
        return 3 * 2 * out_features * in_features * experts if experts else None
'''.replace("{env}", ENV)

namespace: dict = {}
exec(FAKE, namespace)  # the same class for the in-process records as the entry point installs
FakeRocm = namespace["FakeRocm"]


def records_with(backend_class):
    record = PluginRecord("fakegpu", "fake:FakeRocm", "fake", backend_class=backend_class)
    record.probe = backend_class().probe()
    return {"fakegpu": record}


@pytest.fixture(autouse=True)
def mi355x_served_by_the_fake(monkeypatch):
    from dataclasses import replace

    from musecore.devices import CATALOG
    monkeypatch.setitem(CATALOG, "mi355x", replace(CATALOG["mi355x"], backend="fakegpu"))


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    config = small_config(hidden_size=128, moe_hidden_size=128, moe_intermediate_size=128, head_dim=32,
                          mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    return write_checkpoint(tmp_path_factory.mktemp("kernels") / "bf16", config,
                            random_tensors(config, dtype=torch.bfloat16))


def test_plan_shows_every_kernel_choice_of_the_backend(bf16_checkpoint):
    summary, _ = summarize(bf16_checkpoint)
    config = summary.config
    plan = make_plan(summary, "mi355x", records=records_with(FakeRocm))
    assert not plan.gaps and plan.backend == "fakegpu" and plan.mode == "native", plan.gaps
    asked = {l.name: l for l in FakeRocm.asked}
    nq, nkv, d, H = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
    fused = asked["attention q_proj/k_proj/v_proj/gate_proj (fused)"]  # bf16 projections are stacked by the loader
    assert (fused.out_features, fused.in_features) == (2 * nq * d + 2 * nkv * d, H)
    assert (asked["attention o_proj"].out_features, asked["attention o_proj"].in_features) == (H, nq * d)
    experts = asked["experts gate/up"]
    assert (experts.experts, experts.top_k) == (config.num_local_experts, config.num_experts_per_tok)
    assert (experts.out_features, experts.in_features) == (2 * config.moe_intermediate_size, config.moe_hidden_size)
    assert {"experts down", "lm_head", "pooler/unpooler pre_expert_proj", "pooler/unpooler post_expert_proj",
            "dense MLP gate_proj/up_proj (fused)", "dense MLP down_proj"} <= set(asked)
    assert len(plan.kernels) == len(FakeRocm.asked) and all(k.env == ENV for k in plan.kernels)
    as_json = json.loads(plan.to_json())["kernels"]
    assert as_json[0] == {"what": plan.kernels[0].what, "choice": plan.kernels[0].choice,
                          "reason": plan.kernels[0].reason, "env": ENV}
    text = str(plan)
    assert "kernels (fakegpu)" in text and "fake grouped GEMM" in text and "mi355x: always" in text, text


def test_plan_notes_every_env_override_in_force(bf16_checkpoint, monkeypatch):
    summary, _ = summarize(bf16_checkpoint)
    quiet = make_plan(summary, "mi355x", records=records_with(FakeRocm))
    assert not any(ENV in n for n in quiet.notes), quiet.notes
    monkeypatch.setenv(ENV, "1")
    loud = make_plan(summary, "mi355x", records=records_with(FakeRocm))
    notes = [n for n in loud.notes if n.startswith("env ")]
    assert notes == [f"env {ENV}=1 in force (fakegpu backend; default auto): forces the fake GEMM everywhere"], notes
    assert "MUSECORE_FAKE_UNSET_KNOB" not in str(loud)


def test_memory_counts_the_backends_resident_bytes(bf16_checkpoint):
    summary, _ = summarize(bf16_checkpoint)

    class FormatBytesOnly(FakeRocm):
        def resident_bytes(self, weight_format, out_features, in_features, *, experts=0):
            return None

    padded = make_plan(summary, "mi355x", records=records_with(FakeRocm))
    plain = make_plan(summary, "mi355x", records=records_with(FormatBytesOnly))
    expert_values = sum(n for name, n in ((k, torch.Size(s).numel()) for k, s in summary.shapes.items())
                        if ".mlp.experts." in name and not name.endswith("norm.weight"))
    assert padded.memory_bytes - plain.memory_bytes == (3 * 2 - 2) * expert_values
    groups = {g.group: g.bytes for g in padded.groups}
    assert groups["experts (quantized layers)"] + groups["experts (BF16 layers)"] == 3 * 2 * expert_values


def test_a_backend_that_raises_makes_a_note_not_a_failed_plan(bf16_checkpoint):
    summary, _ = summarize(bf16_checkpoint)

    class Broken(FakeRocm):
        def kernel_choices(self, linears, profile):
            raise RuntimeError("no table for this shape")

        def resident_bytes(self, weight_format, out_features, in_features, *, experts=0):
            raise KeyError(weight_format)

    plan = make_plan(summary, "mi355x", records=records_with(Broken))
    assert not plan.gaps and plan.kernels == []
    assert any(re.search(r"backend 'fakegpu': kernel_choices\(\) raised RuntimeError: no table", n) for n in plan.notes)
    assert any("backend 'fakegpu': resident_bytes() raised KeyError" in n for n in plan.notes), plan.notes


def test_model_plan_shows_the_same_kernel_choices_as_the_plan(bf16_checkpoint, tmp_path, monkeypatch):
    from tests.unit.test_plugins import install_plugin
    monkeypatch.syspath_prepend(str(tmp_path))
    install_plugin(tmp_path, "fakerocm", {"fakegpu": "fakerocm:FakeRocm"}, FAKE)
    monkeypatch.setitem(musecore.api.TORCH_DEVICE_TYPE, "fakegpu", "cpu")  # the fake's "MI355X" is this CPU
    monkeypatch.setenv(ENV, "grouped")
    planned = musecore.plan(bf16_checkpoint, "mi355x")
    model = musecore.load(bf16_checkpoint, device="mi355x", progress=False)
    assert model.plan.backend == planned.backend == "fakegpu" and type(model.backend).__name__ == "FakeRocm"
    assert model.plan.kernels == planned.kernels and planned.kernels
    assert [n for n in model.plan.notes if n.startswith("env ")] == [n for n in planned.notes if n.startswith("env ")]
    assert str(model.plan) == str(planned)


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_load_and_plan_agree_on_auto_with_emulate(bf16_checkpoint, device):
    planned = musecore.plan(bf16_checkpoint, device, emulate=True)
    model = musecore.load(bf16_checkpoint, device=device, emulate=True, progress=False)
    assert (model.plan.device, model.plan.backend, model.plan.mode) == \
        (planned.device, planned.backend, planned.mode), (model.plan.device, planned.device)
    assert planned.mode == "emulated" and model.device == torch.device("cpu")
    assert model.plan.weight_targets == planned.weight_targets


def test_no_module_builds_a_path_from_its_own_location_outside_the_package_data():
    """The matrix and the bundled model must work from an installed wheel: anything read at run time
    is package data (musecore/data), found through importlib.resources, never the source tree."""
    root = Path(musecore.__file__).parent
    offenders = [f"{p.relative_to(root.parent)}:{i}" for p in sorted(root.rglob("*.py"))
                 for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                 if "__file__" in line and not line.lstrip().startswith("#")]
    assert not offenders, f"modules that locate files from __file__ (use importlib.resources): {offenders}"
    assert (root / "data" / "eval" / "stdlib_heldout_slice.jsonl").is_file()
    from musecore.matrix import DEFAULT_EVAL_TEXT
    assert DEFAULT_EVAL_TEXT.is_relative_to(root / "data")
