"""Media features replace the prompt's placeholders; towers are loaded, checked and planned by rule.

No transformers here (``test_towers.py`` compares with it): checkpoints are written with random
tower tensors in the shapes the config implies (``musecore.towers.tower_shapes``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import musecore
from musecore.api import summarize
from musecore.backends.base import Support
from musecore.backends.reference import ReferenceBackend
from musecore.backends.registry import PluginRecord
from musecore.loader import CheckpointMismatch
from musecore.ops import TEXT_OPS, TOWER_OPS
from musecore.planning import PlanError, make_plan
from musecore.towers import MediaCountError, tower_shapes
from tests.helpers import random_tensors, small_config, write_checkpoint

TOWER_CONFIG = dict(out_hidden_size=4 * 16, projector_hidden_size=24,
                    vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, pos_emb_height=4, pos_emb_width=4),
                    audio_config=dict(hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1]))


def with_towers(config, seed: int = 0, towers=("vision", "audio")) -> dict:
    tensors = random_tensors(config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 5)
    for tower in towers:
        tensors.update({n: 0.2 * torch.randn(s, generator=gen) for n, s in tower_shapes(config, tower).items()})
    return tensors


@pytest.fixture(scope="module")
def config():
    return small_config(num_hidden_layers=2, **TOWER_CONFIG)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, config):
    return write_checkpoint(tmp_path_factory.mktemp("splice") / "ckpt", config, with_towers(config))


@pytest.fixture(scope="module")
def model(folder):
    return musecore.load(folder, device="cpu", dtype=torch.float32)


def ids_with(config, row_counts: list[tuple[int, int]]) -> torch.Tensor:
    """A batch whose row b has ``n_image`` image and ``n_audio`` audio placeholders among text tokens."""
    rows = []
    for n_image, n_audio in row_counts:
        rows.append([3, 4] + [config.image_token_id] * n_image + [5] + [config.audio_token_id] * n_audio + [6])
    width = max(map(len, rows))
    return torch.tensor([r + [7] * (width - len(r)) for r in rows])


# -- the splice --------------------------------------------------------------------------------------

def test_features_replace_placeholders_in_order_row_major_over_the_batch(model, config):
    ids = ids_with(config, [(2, 1), (3, 0)])
    H = config.hidden_size
    image = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    audio = torch.randn(1, H, generator=torch.Generator().manual_seed(2))
    x, _a, _pos, _rope = model.embed(ids, media={config.image_token_id: image, config.audio_token_id: audio})
    image_at = (ids == config.image_token_id).nonzero().tolist()  # row-major: (0,2), (0,3), (1,2), (1,3), (1,4)
    assert image_at == [[0, 2], [0, 3], [1, 2], [1, 3], [1, 4]]
    for row, (b, t) in enumerate(image_at):
        assert torch.equal(x[b, t], image[row])
    assert torch.equal(x[0, 5], audio[0])
    plain, *_ = model.embed(ids)
    text = ~torch.isin(ids, torch.tensor([config.image_token_id, config.audio_token_id]))
    assert torch.equal(x[text], plain[text])  # every other row untouched


def test_a_count_mismatch_names_both_counts(model, config):
    ids = ids_with(config, [(4, 0)])
    with pytest.raises(MediaCountError, match=rf"the prompt has 4 image placeholders \(id {config.image_token_id}\) "
                                              r"but 6 image feature rows were given"):
        model.forward(ids, media={config.image_token_id: torch.zeros(6, config.hidden_size)})
    with pytest.raises(MediaCountError, match=r"has 0 audio placeholders .* but 2 audio feature rows"):
        model.forward(ids, media={config.audio_token_id: torch.zeros(2, config.hidden_size)})
    assert issubclass(MediaCountError, ValueError)


def test_bad_media_keys_and_widths_are_refused(model, config):
    ids = ids_with(config, [(1, 0)])
    with pytest.raises(ValueError, match="media key 5 is not a placeholder id"):
        model.forward(ids, media={5: torch.zeros(1, config.hidden_size)})
    with pytest.raises(ValueError, match="width 7 but the model's hidden size is"):
        model.forward(ids, media={config.image_token_id: torch.zeros(1, 7)})


def test_encoded_media_through_forward_change_only_what_follows(model, config):
    """Causal: positions before the first placeholder have the logits of the text-only prompt."""
    values = torch.randn(2 * 4 * 4, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(3))
    feats = model.encode_images(values, torch.tensor([[2, 4, 4]]))[0]  # a 2-step video: 8 merged rows
    assert feats.shape == (8, config.hidden_size)
    ids = ids_with(config, [(8, 0)])
    with_media = model.forward(ids, media={config.image_token_id: feats})
    without = model.forward(ids)
    before = (with_media[:, :2] - without[:, :2]).abs().max().item()  # fp32 GEMMs may round by content elsewhere
    assert before <= 1e-5, f"logits before the placeholders moved by {before:.2e} (tolerance 1e-5)"
    assert (with_media[:, 2:] - without[:, 2:]).abs().max() > 1e-3


# -- loading -----------------------------------------------------------------------------------------

def test_a_checkpoint_without_towers_has_none_and_says_so(tmp_path):
    config = small_config(num_hidden_layers=2, **TOWER_CONFIG)
    folder = write_checkpoint(tmp_path / "text", config, random_tensors(config))
    muse = musecore.load(folder, device="cpu", dtype=torch.float32)
    assert muse.vision is None and muse.audio is None and muse.plan.towers == ()
    assert not any(op in TOWER_OPS for op in (c.op for c in muse.plan.ops))
    with pytest.raises(ValueError, match=rf"{folder} cannot take images or video: the checkpoint has no vision tower"):
        muse.encode_images(torch.zeros(4, 1176), torch.tensor([[1, 2, 2]]))
    with pytest.raises(ValueError, match="cannot take audio: the checkpoint has no audio tower"):
        muse.encode_audio(torch.zeros(1, 1920))


def test_only_the_tower_present_is_loaded(tmp_path):
    config = small_config(num_hidden_layers=2, **TOWER_CONFIG)
    folder = write_checkpoint(tmp_path / "audio", config, with_towers(config, towers=("audio",)))
    muse = musecore.load(folder, device="cpu", dtype=torch.float32)
    assert muse.vision is None and muse.audio is not None and muse.plan.towers == ("audio",)
    assert "varlen_attention" not in {c.op for c in muse.plan.ops} and "causal_conv1d" in {c.op for c in muse.plan.ops}


def test_a_missing_or_misshapen_tower_tensor_is_a_one_line_error(tmp_path, config):
    tensors = with_towers(config)
    lost = "model.vision_tower.layers.1.attn.k_proj.bias"
    folder = write_checkpoint(tmp_path / "missing", config, {n: t for n, t in tensors.items() if n != lost})
    with pytest.raises(CheckpointMismatch, match=rf"lacks 1 that vision_config implies: {lost}") as err:
        musecore.load(folder, device="cpu")
    assert "\n" not in str(err.value)
    bad = "model.audio_tower.layers.2.conv_blocks.0.conv.weight"
    folder = write_checkpoint(tmp_path / "shape", config, {**tensors, bad: torch.zeros(8, 1, 5)})
    with pytest.raises(CheckpointMismatch, match=rf"tensor '{bad}' has shape \[8, 1, 5\] .* implies \[8, 1, 7\]"):
        musecore.plan(folder, device="cpu")
    extra = "model.vision_tower.layers.7.norm1.weight"
    folder = write_checkpoint(tmp_path / "extra", config, {**tensors, extra: torch.zeros(16)})
    with pytest.raises(CheckpointMismatch, match=rf"unexpected tensor '{extra}'"):
        musecore.plan(folder, device="cpu")


def test_towers_false_plans_and_loads_exactly_the_text_model(folder, tmp_path, config):
    text_only = write_checkpoint(tmp_path / "text", config, random_tensors(config))
    plan, plain = musecore.plan(folder, device="cpu", towers=False), musecore.plan(text_only, device="cpu")
    assert [(c.op, c.weight_format) for c in plan.ops] == [(c.op, c.weight_format) for c in plain.ops]
    assert {c.op for c in plan.ops} == set(TEXT_OPS)
    assert plan.memory_bytes == plain.memory_bytes and plan.towers == ()
    assert set(plan.towers_skipped) == {"vision", "audio"}
    muse = musecore.load(folder, device="cpu", dtype=torch.float32, towers=False)
    assert muse.vision is None and muse.audio is None
    with pytest.raises(ValueError, match="the vision tower was not loaded: towers=False"):
        muse.encode_images(torch.zeros(4, 1176), torch.tensor([[1, 2, 2]]))


def test_the_towers_memory_is_counted(folder, config):
    plan = musecore.plan(folder, device="cpu")
    groups = {g.group: g for g in plan.groups}
    for tower in ("vision", "audio"):
        numel = sum(torch.Size(s).numel() for s in tower_shapes(config, tower).values())
        assert groups[f"{tower} tower"].parameters == numel and groups[f"{tower} tower"].bytes == 2 * numel
    assert plan.memory_bytes - musecore.plan(folder, device="cpu", towers=False).memory_bytes == \
        groups["vision tower"].bytes + groups["audio tower"].bytes
    assert plan.to_dict()["towers"] == {"loaded": ["vision", "audio"], "skipped": {}}


def test_the_backend_is_asked_about_the_towers_linears(folder, config, text_only_backend):
    asked = []

    class Asked(TextOnlyBackend):
        def kernel_choices(self, linears, profile):
            asked.extend(linears)
            return []

    records = {"fakegpu": PluginRecord("fakegpu", "fake:Asked", "fake", backend_class=Asked)}
    records["fakegpu"].probe = text_only_backend["fakegpu"].probe
    summary, _ = summarize(folder)
    make_plan(summary, "mi355x", records=records, towers=True, allow_reference=True)
    shapes = {(s.name, s.out_features, s.in_features, s.weight_format) for s in asked}
    D, inter = 16, 32
    assert {("vision_tower.attn.q_proj", D, D, "bf16"), ("vision_tower.mlp.fc1", inter, D, "bf16"),
            ("vision_tower.patch_embedder.patch_embedding", D, 1176, "bf16"), ("vision_adapter.fc1", 24, 64, "bf16"),
            ("vision_projection", config.hidden_size, 24, "bf16"), ("audio_tower.proj", config.hidden_size, 8, "bf16"),
            ("audio_tower.conv_blocks.mlp.fc2", 8, 32, "bf16")} <= shapes, sorted(shapes)
    asked.clear()
    make_plan(summary, "mi355x", records=records, towers=False)
    assert not any("tower" in s.name or "vision" in s.name for s in asked)


def test_model_weight_bytes_include_the_towers(model, folder):
    text_only = musecore.load(folder, device="cpu", dtype=torch.float32, towers=False)
    numel = sum(torch.Size(s).numel() for t in ("vision", "audio") for s in tower_shapes(model.config, t).values())
    assert model.weight_bytes() - text_only.weight_bytes() == 4 * numel  # fp32


# -- the plan's rule on a backend without the tower ops ----------------------------------------------

class TextOnlyBackend(ReferenceBackend):
    """The reference math, declining the towers' own ops (as a backend that has not implemented them)."""

    name = "fakegpu"

    def probe(self):
        from musecore.backends.base import Probe
        return Probe(available=True, score=50, devices=["mi355x"], reason="fake MI355X for the tests")

    def supports(self, op, spec):
        if op in TOWER_OPS:
            return Support.no(f"{op}: not implemented by this fake")
        return Support.native("fake: the reference math")


@pytest.fixture
def text_only_backend(monkeypatch):
    from musecore.devices import CATALOG
    monkeypatch.setitem(CATALOG, "mi355x", replace(CATALOG["mi355x"], backend="fakegpu"))
    record = PluginRecord("fakegpu", "fake:TextOnlyBackend", "fake", backend_class=TextOnlyBackend)
    record.probe = TextOnlyBackend().probe()
    return {"fakegpu": record}


def test_a_backend_without_tower_ops_skips_the_towers_and_says_why(folder, text_only_backend):
    summary, _ = summarize(folder)
    plan = make_plan(summary, "mi355x", records=text_only_backend)
    assert not plan.gaps and plan.towers == ()
    assert "varlen_attention: fakegpu: no (varlen_attention: not implemented by this fake)" in plan.towers_skipped["vision"]
    assert "causal_conv1d" in plan.towers_skipped["audio"]
    assert any(n.startswith("the vision tower was not loaded") for n in plan.notes), plan.notes
    assert {c.op for c in plan.ops} == set(TEXT_OPS)


def test_asking_for_the_towers_makes_missing_ops_gaps_or_reference_ops(folder, text_only_backend):
    summary, _ = summarize(folder)
    strict = make_plan(summary, "mi355x", records=text_only_backend, towers=True)
    assert strict.towers == () and len(strict.gaps) == 2, strict.gaps
    assert strict.gaps[0].startswith("vision tower (towers=True): its ops cannot run here")
    with pytest.raises(PlanError, match="audio tower"):
        raise PlanError(strict)
    lenient = make_plan(summary, "mi355x", records=text_only_backend, towers="vision", allow_reference=True)
    assert lenient.towers == ("vision",) and not lenient.gaps
    impl = {c.op: c.implementation for c in lenient.ops}
    assert impl["varlen_attention"] == impl["layer_norm"] == "reference" and impl["attention"] == "fakegpu"
    assert "causal_conv1d" not in impl  # the audio tower was not asked for
    with pytest.raises(ValueError, match=r"unknown tower\(s\) \['speech'\]"):
        make_plan(summary, "mi355x", records=text_only_backend, towers=["speech"])


def test_a_tower_config_the_tower_cannot_run_is_skipped_with_the_field(tmp_path):
    """transformers builds a vision adapter whose input is not the merged width (it fails only when run):
    the text model and the audio tower still load."""
    config = small_config(num_hidden_layers=2, **{**TOWER_CONFIG, "out_hidden_size": 40})
    folder = write_checkpoint(tmp_path / "odd", config, with_towers(config))
    muse = musecore.load(folder, device="cpu", dtype=torch.float32)
    assert muse.vision is None and muse.audio is not None
    assert "out_hidden_size" in muse.plan.towers_skipped["vision"]
    with pytest.raises(PlanError, match="out_hidden_size"):
        musecore.load(folder, device="cpu", towers=True)
