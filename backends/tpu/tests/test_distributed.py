"""Distributed runs on TPU hosts go through musecore's collectives module (``musecore.distributed.Comm``) over
TorchTPU's ``tpu`` process group. No TPU is here, so the choice is checked with fakes: ``connect`` asks
``init_process_group`` for ``tpu`` when the ranks' tensors live on the ``tpu`` device and torch_tpu has
registered its backend with c10d (what ``torch_tpu/_loader.py`` does on load), says why in one line when it has
not, and keeps gloo for the CPU. No collective has run over the TPU process group."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from musecore import distributed
from musecore.api import TORCH_DEVICE_TYPE
from musecore.distributed import Comm, DistributedError, Mesh, connect, process_group_backend


@pytest.fixture
def fake_launch(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Rank 0 of 2 under torchrun, with a process group and device mesh that record what they were asked."""
    seen: dict[str, Any] = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.setdefault("backend", backend))
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)

    class FakeMesh:
        def get_group(self, name: str) -> str:
            return f"group {name}"

    import torch.distributed.device_mesh as device_mesh
    monkeypatch.setattr(device_mesh, "init_device_mesh",
                        lambda device_type, shape, mesh_dim_names: seen.setdefault("mesh", device_type) and FakeMesh())
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda i: seen.setdefault("device_index", i))
    return seen


def test_tpu_ranks_join_torch_tpu_s_process_group(fake_launch: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist.Backend, "backend_list", dist.Backend.backend_list + ["tpu"])  # torch_tpu loaded
    comm = connect(Mesh(tp=2), "tpu")
    assert fake_launch == {"backend": "tpu", "mesh": "tpu", "device_index": 0}
    assert isinstance(comm, Comm) and comm.group == "group model" and comm.world == 2


def test_cpu_ranks_keep_gloo(fake_launch: dict) -> None:
    comm = connect(Mesh(tp=2), "cpu")
    assert fake_launch == {"backend": "gloo", "mesh": "cpu"}
    assert comm.rank == 0


def test_tpu_without_the_registered_backend_is_a_one_line_error() -> None:
    assert "tpu" not in dist.Backend.backend_list  # torch_tpu is not loaded in this environment
    with pytest.raises(DistributedError, match="TorchTPU's 'tpu' process group, which is not registered"):
        process_group_backend("tpu")
    assert process_group_backend("cpu") == "gloo" and process_group_backend("cuda") == "nccl"


def test_the_tpu_backend_s_tensors_live_on_the_tpu_device() -> None:
    """``musecore.api.join`` passes the plan's torch device type to ``connect``: ``tpu`` for the TPU backend
    (TorchTPU's name for its device), so a TPU launch gets the ``tpu`` process group above."""
    assert TORCH_DEVICE_TYPE["tpu"] == "tpu"
