"""The conformance suite's tower cases (``musecore.testing.cases.tower_cases``): their shapes are the presets'
tower sizes (816b = transformers' MuseSparkVisionConfig / MuseSparkAudioConfig defaults), and the checker
fails a backend that attends across segments, ignores the conv state or returns a wrong state."""

from __future__ import annotations

import pytest
import torch

from musecore.backends.reference import ReferenceBackend
from musecore.ops import TOWER_OPS
from musecore.ops import reference as ref
from musecore.testing import check_op, conformance_cases


def tower(size: str, op: str) -> list:
    return conformance_cases([size], ops=[op])


def test_every_size_covers_every_tower_op():
    for size in ("tiny", "small", "816b"):
        assert {c.op for c in conformance_cases([size], ops=list(TOWER_OPS))} == set(TOWER_OPS), size


def test_816b_tower_cases_have_the_transformers_default_tower_sizes():
    transformers = pytest.importorskip("transformers")
    vision, audio = transformers.MuseSparkVisionConfig(), transformers.MuseSparkAudioConfig()
    top = transformers.MuseSparkConfig()
    d = vision.hidden_size // vision.num_attention_heads
    attention = tower("816b", "varlen_attention")
    assert {(c.dim("heads"), c.dim("head_dim")) for c in attention} == {(vision.num_attention_heads, d)} == {(16, 96)}
    window = vision.pos_emb_height * vision.pos_emb_width  # 32x32 patches
    segments = {c.variant: c.option("segments") for c in attention}
    assert segments["window"] == (window,) == (1024,)
    packed = segments["packed"]
    assert 0 in packed and 1 in packed and any(n % 2 for n in packed if n > 1), packed
    assert {c.dim("width") for c in tower("816b", "layer_norm")} == {vision.hidden_size}
    assert {c.dim("width") for c in tower("816b", "gelu")} == {
        vision.intermediate_size, top.projector_hidden_size, int(audio.hidden_sizes[-1] * audio.mlp_ratio)}
    conv = tower("816b", "causal_conv1d")
    assert {c.dim("channels") for c in conv} == set(audio.hidden_sizes) == {256, 512, 1024, 2048}
    assert {c.dim("kernel") for c in conv} == {audio.conv_kernel_size} == {7}
    assert any(c.dim("time") % 2 for c in conv), "odd lengths"
    streaming = [c for c in conv if c.option("state")]
    assert {c.dim("time") for c in streaming} >= {1, 5}, "chunks of one token and shorter than K-1"
    assert {(c.dim("heads"), c.dim("head_dim")) for c in tower("816b", "rope")} == {(16, 96)}


class AttendsAcrossSegments(ReferenceBackend):
    name = "attends-across-segments"

    @staticmethod
    def varlen_attention(q, k, v, cu_seqlens, scale):
        n = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        return ref.varlen_attention(q, k, v, n, scale)  # one segment: every token sees every other


class IgnoresTheState(ReferenceBackend):
    name = "ignores-state"

    @staticmethod
    def causal_conv1d(x, weight, bias, state=None):
        return ref.causal_conv1d(x, weight, bias, None)


class KeepsTheOldState(ReferenceBackend):
    name = "keeps-old-state"

    @staticmethod
    def causal_conv1d(x, weight, bias, state=None):
        y, new = ref.causal_conv1d(x, weight, bias, state)
        return y, (state if state is not None else torch.zeros_like(new))


def test_attention_across_segments_fails():
    result = check_op(AttendsAcrossSegments(), tower("tiny", "varlen_attention")[0])
    assert result.status == "failed" and "NMSE" in result.reason, result.message()


def test_a_conv_that_ignores_or_keeps_its_state_fails():
    streaming = [c for c in tower("tiny", "causal_conv1d") if c.option("state")]
    for backend in (IgnoresTheState(), KeepsTheOldState()):
        failed = [check_op(backend, c) for c in streaming]
        assert all(r.status == "failed" for r in failed), [r.message() for r in failed]
    new_state = check_op(KeepsTheOldState(), streaming[0])
    assert "output 1" in new_state.reason, new_state.message()
