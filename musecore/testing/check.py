"""Running one conformance case on a backend and judging it against the reference backend.

ggml's ``test-backend-ops`` rules: the backend's output and the reference's (same inputs, same
prepared-from-the-same-QTensor weights) are compared by normalised MSE against
``musecore.ops.tolerance(op, spec)``; NaN/Inf where the reference is finite, a wrong shape or
dtype, integer outputs (ids) that differ, or an exception from a backend that said it supports
the case, all fail. A case the backend's ``supports`` declines, or an op it does not implement,
is skipped with the backend's reason: never a failure.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch

from musecore.ops import tolerance
from musecore.testing.cases import ConformanceCase, conformance_cases
from musecore.testing.inputs import build

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


def nmse(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """``sum((actual - reference)^2) / sum(reference^2)`` in float64 (ggml's NMSE).

    0 when both are equal (also when the reference is all zeros); ``inf`` when the reference is
    all zeros and ``actual`` is not. Non-finite elements make it NaN: check finiteness first.
    """
    ref = reference.detach().to("cpu", torch.float64)
    act = actual.detach().to("cpu", torch.float64)
    noise = float(((act - ref) ** 2).sum())
    signal = float((ref ** 2).sum())
    if noise == 0.0:
        return 0.0
    return noise / signal if signal > 0.0 else math.inf


@dataclass
class CaseResult:
    """The outcome of one case: status, measured NMSE against its tolerance, and why."""

    case: ConformanceCase
    backend: str
    status: str                 # passed | failed | skipped
    nmse: Optional[float]
    tolerance: float
    reason: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def message(self) -> str:
        measured = "" if self.nmse is None else f"NMSE {self.nmse:.3e} (tolerance {self.tolerance:.1e})"
        return f"{self.backend} {self.case.id}: {self.status} {measured}{'; ' if measured and self.reason else ''}{self.reason}"

    def to_dict(self) -> dict[str, Any]:
        c = self.case
        return {"case": c.id, "op": c.op, "size": c.size, "variant": c.variant, "weight_format": c.weight_format,
                "act_format": c.act_format, "kv_format": c.kv_format, "backend": self.backend,
                "status": self.status, "nmse": self.nmse, "tolerance": self.tolerance, "reason": self.reason,
                "seconds": round(self.seconds, 4)}


def assert_nmse(reference: torch.Tensor, actual: torch.Tensor, tol: float, what: str) -> float:
    """Shape, finiteness and NMSE <= ``tol``; prints the measured NMSE so a passing run shows its margin."""
    assert tuple(actual.shape) == tuple(reference.shape), \
        f"{what}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    assert torch.isfinite(actual.float()).all(), f"{what}: output has NaN/Inf"
    err = nmse(reference.float(), actual.float())
    print(f"{what}: NMSE {err:.3e} (tolerance {tol:.1e})")
    assert err <= tol, f"{what}: NMSE {err:.3e} > tolerance {tol:.1e}"
    return err


def _outputs(value: Any) -> tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def compare(case: ConformanceCase, expected: Any, actual: Any, tol: float) -> tuple[bool, float, str]:
    """(ok, worst NMSE over float outputs, what is wrong) for one case's outputs."""
    exp, act = _outputs(expected), _outputs(actual)
    if len(exp) != len(act):
        return False, math.inf, f"returned {len(act)} output(s), the reference returns {len(exp)}"
    worst, problems = 0.0, []
    for i, (e, a) in enumerate(zip(exp, act)):
        label = f"output {i}" if len(exp) > 1 else "output"
        if not isinstance(a, torch.Tensor):
            return False, math.inf, f"{label} is a {type(a).__name__}, expected a tensor"
        if tuple(a.shape) != tuple(e.shape):
            return False, math.inf, f"{label} has shape {list(a.shape)}, the reference {list(e.shape)}"
        if a.dtype != e.dtype:
            problems.append(f"{label} is {a.dtype}, the contract (reference) gives {e.dtype}")
        a = a.detach().cpu()
        if not (e.is_floating_point() or e.is_complex()):
            mismatched = int((a.to(e.dtype) != e).sum())
            if mismatched:
                problems.append(f"{label}: {mismatched} of {e.numel()} integer values differ from the reference")
            continue
        bad = int((~torch.isfinite(a.float()) & torch.isfinite(e.float())).sum())
        if bad:
            problems.append(f"{label}: {bad} NaN/Inf values where the reference is finite")
            worst = math.inf
            continue
        err = nmse(e, a)
        worst = max(worst, err)
        if not err <= tol:
            problems.append(f"{label}: NMSE {err:.3e} > tolerance {tol:.1e}")
    return not problems, worst, "; ".join(problems)


def _reference_backend() -> Any:
    from musecore.backends.reference import ReferenceBackend
    return ReferenceBackend("cpu")


def check_op(backend: Any, case: ConformanceCase, *, dtype: Optional[torch.dtype] = None,
             reference: Any = None, device_name: str = "") -> CaseResult:
    """Run ``case`` on ``backend`` and on the reference (CPU) and judge it; never raises for the
    backend's faults (they become a failed result with the traceback's last line).

    ``dtype`` is the activation dtype the backend wants its inputs in (default bf16; e.g. fp16 for
    a Triton-interpreter run on a CPU). ``device_name`` fills ``OpSpec.device`` for backends that
    answer ``supports`` per catalog device.

    Example::

        result = check_op(MyBackend("cuda"), conformance_cases(["tiny"], ops=["linear"])[0])
        assert result.status != "failed", result.message()
    """
    dtype = dtype or torch.bfloat16
    spec = case.spec(dtype, device_name)
    tol = tolerance(case.op, spec)
    name = getattr(backend, "name", type(backend).__name__) or type(backend).__name__
    started = time.perf_counter()
    try:
        answer = backend.supports(case.op, spec)
    except Exception as err:  # a supports() that raises is the backend's bug: shown, not hidden
        return CaseResult(case, name, FAILED, None, tol, f"supports() raised {type(err).__name__}: {err}")
    if not answer.ok:
        return CaseResult(case, name, SKIPPED, None, tol, answer.reason or "supports() said no (no reason given)")
    if getattr(backend, case.op, None) is None:
        return CaseResult(case, name, SKIPPED, None, tol,
                          f"backend implements no {case.op!r} method (the plan falls back to another backend)")
    built = build(case, dtype)
    try:
        actual = built.run(backend)
        _sync(actual)  # an asynchronous kernel's error surfaces here, inside this case
    except Exception as err:
        where = traceback.extract_tb(err.__traceback__)[-1]
        return CaseResult(case, name, FAILED, None, tol,
                          f"raised {type(err).__name__}: {err} (at {where.filename}:{where.lineno}); supports() "
                          f"said {answer.tier.value}: {answer.reason}", time.perf_counter() - started)
    expected = built.run(reference or _reference_backend())
    ok, worst, problems = compare(case, expected, actual, tol)
    return CaseResult(case, name, PASSED if ok else FAILED, worst, tol, problems, time.perf_counter() - started)


def _sync(value: Any) -> None:
    for t in _outputs(value):
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
            return


def run_conformance(backend: Any, cases: Optional[Sequence[ConformanceCase]] = None, *,
                    sizes: Optional[Iterable[str]] = None, dtype: Optional[torch.dtype] = None,
                    device_name: str = "", progress: bool = False) -> list[CaseResult]:
    """Every case (default: ``conformance_cases(sizes)``) on ``backend``; what ``musecore matrix``
    tabulates per backend.

    Example::

        results = run_conformance(ReferenceBackend(), sizes=["tiny"])
        print(sum(r.status == "failed" for r in results), "failures")
    """
    cases = list(cases) if cases is not None else conformance_cases(sizes)
    reference = _reference_backend()
    results = []
    from tqdm import tqdm
    for case in tqdm(cases, desc=f"conformance {getattr(backend, 'name', '')}", disable=not progress, unit="case"):
        results.append(check_op(backend, case, dtype=dtype, reference=reference, device_name=device_name))
    return results
