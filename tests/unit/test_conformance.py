"""The conformance suite (``musecore.testing``): the reference passes it, and the checker catches
backends that are wrong, a little noisy, non-finite, mistyped or that raise; unsupported = skipped.

The reference-vs-reference run covers the ``tiny`` preset shapes by default (seconds on a CPU);
``MUSECORE_CONFORMANCE_SIZES=tiny,small,816b`` runs the rest.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from musecore.backends.base import Support
from musecore.backends.reference import ReferenceBackend
from musecore.ops import OPS
from musecore.testing import (SIZES_ENV, build, check_op, conformance_cases, make_conformance_tests, nmse,
                              projection_shapes)
from musecore.testing.cases import MATMUL_FORMATS, selected_sizes

UNIT_SIZES = None if os.environ.get(SIZES_ENV) else ("tiny",)

test_reference_backend_conforms = make_conformance_tests(ReferenceBackend, sizes=UNIT_SIZES)


def cases(op: str, **match):
    found = [c for c in conformance_cases(["tiny"], ops=[op])
             if all(getattr(c, k) == v for k, v in match.items())]
    assert found, f"no tiny {op} case with {match}"
    return found


# -- the measure -------------------------------------------------------------------------------

def test_nmse_is_zero_for_equal_tensors_one_for_zero_output_and_the_relative_power_of_the_error():
    x = torch.tensor([1.0, -2.0, 3.0])
    assert nmse(x, x.clone()) == 0.0
    assert nmse(x, torch.zeros(3)) == pytest.approx(1.0)
    assert nmse(x, 1.1 * x) == pytest.approx(0.01, rel=1e-5), nmse(x, 1.1 * x)  # 1.1 is inexact in fp32
    assert nmse(torch.zeros(2), torch.zeros(2)) == 0.0
    assert nmse(torch.zeros(2), torch.ones(2)) == math.inf
    assert nmse(x.bfloat16(), x.double()) == 0.0, "dtypes are compared by value, in float64"


# -- toy backends that the checker must catch ---------------------------------------------------

class ForgetsTheTranspose(ReferenceBackend):
    name = "forgets-transpose"

    @staticmethod
    def linear(x, w):
        return (x.float() @ w.data.float()).to(x.dtype)  # x @ W instead of x @ W.T


class NoisyNorm(ReferenceBackend):
    name = "noisy-norm"
    relative_noise = 0.0

    def rms_norm(self, x, weight, eps, scale_first=False):
        y = super().rms_norm(x.float(), weight, eps, scale_first=scale_first)
        gen = torch.Generator().manual_seed(1)
        return (y * (1 + self.relative_noise * torch.randn(y.shape, generator=gen))).to(x.dtype)


class Misbehaving(ReferenceBackend):
    name = "misbehaving"

    def head_norm_gate(self, o, gate, eps):
        out = super().head_norm_gate(o, gate, eps)
        out[0, 0, 0, 0] = float("nan")
        return out

    def residual_norm(self, residual, out, post, alpha, beta, nxt, post_eps, eps):
        new_residual, normed = super().residual_norm(residual, out, post, alpha, beta, nxt, post_eps, eps)
        return new_residual.float(), normed  # fp32 where the contract says residual.dtype

    def router_topk(self, x, weight, bias, k, multiplier, scaling):
        weights, ids = super().router_topk(x, weight, bias, k, multiplier, scaling)
        return weights, ids.flip(-1)  # right weights, ids in the wrong slots

    def embedding(self, ids, table):
        raise RuntimeError("kernel launch failed")


def test_a_linear_that_forgets_the_transpose_fails_every_linear_case():
    picked = cases("linear", weight_format="bf16") + cases("linear", weight_format="nvfp4", act_format=None)
    results = [check_op(ForgetsTheTranspose(), c) for c in picked]
    passed = [r.case.id for r in results if r.status != "failed"]
    assert not passed, f"x @ W (no transpose) was not caught in {passed}"
    square = next(r for r in results if r.case.dim("in") == r.case.dim("out"))
    assert square.nmse > 0.5 and "NMSE" in square.reason, square.message()  # wrong numbers, same shape
    rect = next(r for r in results if r.case.dim("in") != r.case.dim("out"))
    assert "raised" in rect.reason, rect.message()  # a shape error is a failure, not a crash


@pytest.mark.parametrize("noise, status", [(1e-4, "passed"), (1e-2, "failed")])
def test_noise_below_the_tolerance_passes_and_above_it_fails(noise, status):
    backend = NoisyNorm()
    backend.relative_noise = noise
    case = cases("rms_norm", variant="hidden")[0]
    result = check_op(backend, case, dtype=torch.float32)
    assert result.status == status, result.message()
    assert result.nmse == pytest.approx(noise ** 2, rel=0.3), f"NMSE {result.nmse:.3e} for relative noise {noise}"


def test_nan_wrong_dtype_wrong_ids_and_exceptions_are_failures_that_say_what_is_wrong():
    backend = Misbehaving()
    nan = check_op(backend, cases("head_norm_gate")[0])
    assert nan.status == "failed" and "NaN/Inf" in nan.reason, nan.message()
    dtype = check_op(backend, cases("residual_norm")[0])
    assert dtype.status == "failed" and "torch.float32" in dtype.reason and "bfloat16" in dtype.reason, dtype.message()
    ids = check_op(backend, cases("router_topk", variant="tiebreak_only")[0])
    assert ids.status == "failed" and "integer values differ" in ids.reason, ids.message()
    raised = check_op(backend, cases("embedding")[0])
    assert raised.status == "failed" and "RuntimeError: kernel launch failed" in raised.reason, raised.message()


# -- what is skipped, never failed ---------------------------------------------------------------

class NoInt4(ReferenceBackend):
    name = "no-int4"
    moe = None  # implements a subset: moe is left to another backend

    def supports(self, op, spec):
        if spec.weight_format == "int4":
            return Support.no("INT4 needs the AMX kernels of musecore-xeon")
        return super().supports(op, spec)

    @staticmethod
    def linear(x, w):
        raise AssertionError("an unsupported case must never run")


def test_an_unsupported_case_is_skipped_with_the_backends_reason():
    result = check_op(NoInt4(), cases("linear", weight_format="int4")[0])
    assert result.status == "skipped" and "AMX kernels of musecore-xeon" in result.reason, result.message()
    test = make_conformance_tests(NoInt4, sizes=["tiny"], ops=["linear"], formats=["int4"])
    with pytest.raises(pytest.skip.Exception, match="AMX kernels of musecore-xeon"):
        test(test.cases[0])


def test_an_op_the_backend_does_not_implement_is_skipped():
    result = check_op(NoInt4(), cases("moe", weight_format="bf16")[0])
    assert result.status == "skipped" and "implements no 'moe'" in result.reason, result.message()


def test_the_generated_test_fails_with_the_measured_nmse():
    test = make_conformance_tests(ForgetsTheTranspose, sizes=["tiny"], ops=["linear"], formats=["bf16"])
    square = next(c for c in test.cases if c.dim("in") == c.dim("out"))
    with pytest.raises(AssertionError, match=r"NMSE \d\.\d+e[+-]\d+ > tolerance 1\.0e-04"):
        test(square)


# -- what the cases cover ------------------------------------------------------------------------

def test_cases_cover_every_op_and_every_weight_format_of_linear_and_moe_in_every_size():
    all_cases = conformance_cases(["tiny", "small", "816b"])
    for size in ("tiny", "small", "816b"):
        ops = {c.op for c in all_cases if c.size == size}
        assert ops == set(OPS), f"{size} lacks {set(OPS) - ops}"
        for op in ("linear", "moe"):
            formats = {(c.weight_format, c.act_format) for c in all_cases if c.size == size and c.op == op}
            assert formats == set(MATMUL_FORMATS), f"{op} {size}: {sorted(formats, key=str)}"
    assert len({c.id for c in all_cases}) == len(all_cases), "case ids must be unique"


def test_816b_cases_use_the_full_models_projection_shapes():
    shapes = projection_shapes("816b")
    want = {"q_proj": (8192, 8192), "kv_proj": (8192, 1024), "o_proj": (8192, 8192), "gate_proj": (8192, 8192),
            "pooler": (8192, 4096), "unpooler": (4096, 8192), "expert_gate_up": (4096, 8192),
            "expert_down": (4096, 4096)}
    assert shapes == want, shapes
    linear = {(c.dim("in"), c.dim("out")) for c in conformance_cases(["816b"], ops=["linear"])}
    assert linear == set(want.values())
    assert all(c.dim("tokens") <= 6 for c in conformance_cases(["816b"], ops=["linear", "moe"]))


def test_attention_cases_cover_prefill_decode_windows_gqa_fp8_left_padding_and_empty_slots():
    tiny = cases("attention")
    assert {c.kv_format for c in tiny} == {"bf16", "fp8"}
    assert any(c.dim("tokens") == 1 for c in tiny) and any(c.dim("tokens") > 1 for c in tiny)
    assert {c.option("window") is None for c in tiny} == {True, False}
    assert all(c.dim("q_heads") > c.dim("kv_heads") for c in tiny), "GQA"
    q_pos, k_pos = {}, {}

    class Recorder(ReferenceBackend):
        def attention(self, q, k, v, qp, kp, window, scale, k_scale=None, v_scale=None):
            q_pos[case.variant, case.kv_format], k_pos[case.variant, case.kv_format] = qp, kp
            assert k.dtype == (torch.float8_e4m3fn if case.kv_format == "fp8" else q.dtype)
            return super().attention(q, k, v, qp, kp, window, scale, k_scale, v_scale)

    for case in tiny:
        assert check_op(Recorder(), case).passed
    assert (q_pos["prefill-leftpad", "bf16"][1, :4] == -1).all(), "left padding marks queries -1"
    assert (k_pos["decode-full-emptyslots", "fp8"][0] == -1).sum() == 5, "empty cache slots are -1"
    ring = k_pos["decode-sliding-ring", "bf16"][1, :8]
    assert sorted(ring.tolist()) == list(range(21, 29)) and ring.tolist() != sorted(ring.tolist()), "ring order"


def test_inputs_are_deterministic_per_case():
    case = cases("moe", weight_format="nvfp4", act_format="nvfp4")[0]
    first, second = build(case).run(ReferenceBackend()), build(case).run(ReferenceBackend())
    assert torch.equal(first, second)
    other = cases("moe", weight_format="nvfp4", act_format=None)[0]
    assert not torch.equal(first, build(other).run(ReferenceBackend())), "cases must not share inputs"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_backend_can_ask_for_its_input_dtype(dtype):
    seen = {}

    class Fp16Only(ReferenceBackend):
        def supports(self, op, spec):
            seen["spec"] = spec.dtype
            return super().supports(op, spec)

        def linear(self, x, w):
            seen["x"], seen["w"] = x.dtype, w.data.dtype
            return super().linear(x, w)

    result = check_op(Fp16Only(), cases("linear", weight_format="bf16")[0], dtype=dtype)
    assert result.passed, result.message()
    assert seen == {"spec": dtype, "x": dtype, "w": dtype}, seen


def test_sizes_come_from_the_environment_and_unknown_sizes_are_refused(monkeypatch):
    monkeypatch.setenv(SIZES_ENV, "tiny, 816b")
    assert selected_sizes() == ("tiny", "816b")
    monkeypatch.delenv(SIZES_ENV)
    assert selected_sizes() == ("tiny", "small", "816b")
    with pytest.raises(ValueError, match="unknown conformance size.*'huge'.*choose from"):
        conformance_cases(["huge"])
