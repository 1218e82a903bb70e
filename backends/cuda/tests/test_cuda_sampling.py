"""``CudaBackend.sample``: greedy sampling through the shared Triton argmax when ``TRITON_ARGMAX`` is on (the
default; in the interpreter on a CPU machine, natively on a GPU), the reference's sampling otherwise."""

from __future__ import annotations

import pytest
import torch

from musecore_triton.kernels.sampling import argmax
from musecore_triton.testing import DEVICE

from musecore_cuda import backend as cuda_backend


def test_the_cuda_backend_samples_greedily_through_it_when_switched_on(monkeypatch):
    """``CudaBackend.sample`` with ``TRITON_ARGMAX``: temperature 0 gives torch's argmax through the kernel (here in
    the interpreter, or natively on a GPU); a temperature still samples through the reference."""
    be = cuda_backend.CudaBackend(DEVICE if DEVICE != "cpu" else "cpu")
    if DEVICE == "cpu" and not be.interpreted:
        pytest.skip("the CPU backend object runs Triton only under TRITON_INTERPRET=1")
    monkeypatch.setattr(cuda_backend, "TRITON_ARGMAX", True)
    calls = []
    monkeypatch.setattr(cuda_backend.sampling, "argmax", lambda x, f=argmax: calls.append(x.shape) or f(x))
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert torch.equal(be.sample(x, 0.0).cpu(), x.cpu().argmax(-1)) and calls == [(3, 5000)]
    torch.manual_seed(0)
    got = be.sample(x, 0.7, 5, 1.0, torch.Generator(device=x.device).manual_seed(1))
    assert got.shape == (3,) and len(calls) == 1, "a temperature goes through the reference's sampling"


def test_argmax_into_writes_the_greedy_tokens_where_sample_would_use_the_kernel(monkeypatch):
    """``CudaBackend.argmax_into`` (the greedy graph's ``argmax_into``): with ``TRITON_ARGMAX`` the argmax lands in the
    given buffer (True); without it nothing is written (False: the graph samples and copies)."""
    be = cuda_backend.CudaBackend(DEVICE if DEVICE != "cpu" else "cpu")
    if DEVICE == "cpu" and not be.interpreted:
        pytest.skip("the CPU backend object runs Triton only under TRITON_INTERPRET=1")
    x = torch.randn(2, 3000, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    tokens = torch.full((2,), -1, dtype=torch.long, device=DEVICE)
    monkeypatch.setattr(cuda_backend, "TRITON_ARGMAX", False)
    assert be.argmax_into(x, tokens) is False and tokens.tolist() == [-1, -1]
    monkeypatch.setattr(cuda_backend, "TRITON_ARGMAX", True)
    assert be.argmax_into(x, tokens) is True and torch.equal(tokens.cpu(), x.cpu().argmax(-1))
