"""The graphed decode step (shared :mod:`musecore_triton.graphs`, HIP graphs on ROCm): its construction with
torch's graph API faked on the CPU, the fallback to plain ``forward`` where graphs are unavailable, and the
real capture on a GPU (``-m gpu``; on an NVIDIA machine it checks the shared code, not HIP)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from musecore_rocm import RocmBackend
from musecore_triton import graphs


class FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: remembers the work "captured" in it and re-runs it on replay."""

    capturing: list["FakeGraph"] = []

    def __init__(self) -> None:
        self.work: list = []
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for run in self.work:
            run()


class FakeStream:
    def wait_stream(self, other) -> None:
        pass


@contextlib.contextmanager
def fake_capture(graph: FakeGraph):
    FakeGraph.capturing.append(graph)
    try:
        yield
    finally:
        FakeGraph.capturing.pop()


class TinyModel:
    """A decode step with static outputs: logits from the ids and positions, and a cache write at valid
    positions (padding at -1 goes nowhere), like the real model on a static cache."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []

    def forward(self, ids, positions, cache):
        out = torch.empty(ids.shape[0], 1, 5)

        def run():
            self.calls.append(positions.clone())
            valid = positions >= 0
            cache.written[valid.squeeze(1)] += 1
            cache.next_position.copy_(torch.where(valid, positions + 1, cache.next_position[:, None]).squeeze(1))
            out.copy_(torch.sin(ids[..., None].float() + torch.arange(5) + positions[..., None].float()))

        run()
        if FakeGraph.capturing:
            FakeGraph.capturing[-1].work.append(run)
        return out


class TinyCache:
    def __init__(self, batch: int) -> None:
        self.next_position = torch.full((batch,), 7)
        self.written = torch.zeros(batch, dtype=torch.long)


@pytest.fixture
def fake_graph_api(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)


def test_graphed_step_captures_on_padding_positions_and_replays_the_forward(fake_graph_api):
    model, cache = TinyModel(), TinyCache(batch=2)
    scopes = []

    @contextlib.contextmanager
    def scope(batch):
        scopes.append(batch)
        yield

    step = graphs.make_graphed_decode_step(model, cache, scope=scope)
    assert scopes == [2]
    assert len(model.calls) == 3 and all((p == -1).all() for p in model.calls)  # 2 warm-ups + capture, padding only
    assert torch.equal(cache.next_position, torch.full((2,), 7)) and not cache.written.any()  # cache left as it was
    ids, positions = torch.tensor([[3], [4]]), torch.tensor([[7], [7]])
    got = step(ids, positions).clone()
    want = TinyModel().forward(ids, positions, TinyCache(2))
    assert torch.equal(got, want)
    assert cache.written.tolist() == [1, 1] and cache.next_position.tolist() == [8, 8]
    got2 = step(torch.tensor([[1], [2]]), torch.tensor([[8], [8]]))
    assert torch.equal(got2, TinyModel().forward(torch.tensor([[1], [2]]), torch.tensor([[8], [8]]), TinyCache(2)))


def test_graphed_prefill_takes_whole_prompts_and_returns_the_last_positions_logits(fake_graph_api):
    """The serve engine's prefill graphs: static inputs ``[B, tokens]``, captured on padding positions only, replayed
    with ``last_only`` (logits ``[B, 1, V]``); each replay runs the captured forward on the new inputs."""
    calls = []

    class PrefillModel:
        device = torch.device("cpu")

        def forward(self, ids, positions, cache, last_only=False):
            assert last_only and ids.shape == positions.shape == (2, 4)
            out = torch.empty(2, 1, 3)

            def run():
                calls.append(positions.clone())
                out.copy_((ids * (positions >= 0)).sum(1, keepdim=True)[..., None].float() + torch.arange(3))

            run()
            if FakeGraph.capturing:
                FakeGraph.capturing[-1].work.append(run)
            return out

    cache = TinyCache(batch=2)
    step = graphs.make_graphed_prefill_step(PrefillModel(), cache, 4)
    assert len(calls) == 3 and all((p == -1).all() for p in calls)  # 2 warm-ups + capture, padding only
    ids = torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4]])
    positions = torch.tensor([[-1, 0, 1, 2], [0, 1, 2, 3]])
    got = step(ids, positions)
    assert got.shape == (2, 1, 3) and got[:, 0, 0].tolist() == [18.0, 10.0]
    assert torch.equal(calls[-1], positions)


def test_cuda_backend_uses_the_shared_capture_with_its_pdl_scope(fake_graph_api, monkeypatch):
    cuda_graphs = pytest.importorskip("musecore_cuda.graphs", reason="musecore-cuda is not installed")
    seen = []
    real = graphs.make_graphed_decode_step
    monkeypatch.setattr(graphs, "make_graphed_decode_step",
                        lambda model, cache, scope: seen.append(scope) or real(model, cache, scope=scope))
    step = cuda_graphs.make_graphed_decode_step(TinyModel(), TinyCache(1))
    assert seen and callable(step)
    from musecore_cuda.kernels import finish_workspace, pdl
    with seen[0](1):  # the decode capture's scope: PDL at batch 1, and split-K finish's kept graph workspace
        assert pdl._scope.get() and finish_workspace._in_graph_scope.get()
    assert not finish_workspace._in_graph_scope.get()


def test_graphs_are_unavailable_off_the_gpu_and_the_backend_falls_back_to_forward():
    reason = graphs.graph_unavailable(torch.device("cpu"))
    assert reason and "GPU" in reason
    be = RocmBackend("cpu")
    assert be.wants_static_cache is False  # the core then gives it ordinary (dynamic) caches
    assert be.make_decode_step(TinyModel(), TinyCache(1)) is None  # the core calls model.forward each step


def test_graphs_are_unavailable_without_a_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sees no GPU" in graphs.graph_unavailable(torch.device("cuda"))
    assert RocmBackend("cuda").make_decode_step(TinyModel(), TinyCache(1)) is None


@pytest.mark.gpu
def test_captured_step_on_a_gpu_equals_eager_steps():
    """A real capture (HIP graph on ROCm, CUDA graph elsewhere) of a static-shape step, replayed twice."""
    w = torch.randn(16, 16, device="cuda")

    class GpuModel:
        device = torch.device("cuda")

        def forward(self, ids, positions, cache):
            x = torch.nn.functional.one_hot(ids.clamp(0, 15), 16).float() @ w
            valid = (positions >= 0).squeeze(1)
            cache.next_position.copy_(torch.where(valid, positions.squeeze(1) + 1, cache.next_position))
            return torch.tanh(x + positions[..., None].float())

    class Cache:
        next_position = torch.full((2,), 5, device="cuda")

    model, cache = GpuModel(), Cache()
    step = graphs.make_graphed_decode_step(model, cache)
    assert cache.next_position.tolist() == [5, 5]
    for ids, pos in ((torch.tensor([[1], [2]]), torch.tensor([[5], [5]])), (torch.tensor([[3], [9]]), torch.tensor([[6], [6]]))):
        got = step(ids.cuda(), pos.cuda()).clone()
        want = torch.tanh(torch.nn.functional.one_hot(ids.cuda(), 16).float() @ w + pos.cuda()[..., None].float())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert cache.next_position.tolist() == [7, 7]
