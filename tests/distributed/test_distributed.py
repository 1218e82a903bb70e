"""Tensor, expert and sequence parallelism on gloo: N CPU processes started by torchrun give the
same logits and tokens as one process (musecore.distributed).

Each case launches ``tests/distributed/worker.py`` under ``python -m torch.distributed.run`` with
a bounded timeout; the worker's rank 0 saves every rank's results. Every output element is the
single-device dot product (nothing is summed in a different order across ranks), but a matmul with
fewer output columns or other rows may take another BLAS kernel and round its fp32 sum differently,
which BF16 can amplify: BF16 muse-tiny logits (up to ~18) get one BF16 ulp at 16-32, 0.125
(measured on the 2-core AMD EPYC: 0 for tp2/ep2/ep4, 0.05 for tp2 alone, 0.114 for tp4; on a 2-vCPU
Intel Xeon, model 207, 0.139 for the all-to-all and sequence-parallel cases: more than one ulp, so the
tolerance is two, 0.25), and greedy tokens must agree exactly; fp32 random models: 1e-4 (measured ~3e-5).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import random_tensors, small_config, write_checkpoint

WORKER = Path(__file__).with_name("worker.py")
LAUNCH_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MUSECORE_DIST_TIMEOUT": "60", **extra}


def launch(nproc: int, out: Path, *args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), str(WORKER), "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env(**(extra_env or {})))


def single(out: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), "--out", str(out), *args], capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S, env=env())
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def errors(stderr: str) -> str:
    """The ranks' own error lines (torchrun's summary after them says only which rank died)."""
    keep = [line for line in stderr.splitlines() if "Error" in line or "what()" in line or "enforce" in line]
    return "\n".join(keep[-20:]) or stderr[-3000:]


def run_ranks(nproc: int, out: Path, *args: str, extra_env: dict | None = None) -> dict:
    done = launch(nproc, out, *args, extra_env=extra_env)
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{errors(done.stderr)}"
    return torch.load(out)


def compare(one: dict, many: dict, tol: float) -> None:
    err = (one["logits"] - many["logits"]).abs().max().item()
    assert err <= tol, f"logits differ from one process by {err:.3g} (tolerance {tol})"
    want = one["ranks"][0]["greedy"]
    for r, got in enumerate(many["ranks"]):
        assert got["greedy"] == want, f"rank {r} greedy tokens {got['greedy']} != one process {want}"
        assert got["sampled"] == many["ranks"][0]["sampled"], f"rank {r} sampled other tokens than rank 0"


@pytest.fixture(scope="module")
def tiny_single(tmp_path_factory) -> dict:
    return single(tmp_path_factory.mktemp("one") / "one.pt")


BF16_TOL = 0.25


@pytest.mark.parametrize("mesh, replicated", [
    (("--tp", "2", "--ep", "2"), "64"), (("--tp", "2", "--ep", "2"), "0"), (("--tp", "2", "--ep", "2", "--sp"), "64"),
    (("--ep", "2"), "64"), (("--ep", "2"), "0"), (("--tp", "2"), "64")],
    ids=["tp2-ep2", "tp2-ep2-alltoall", "tp2-ep2-sp", "ep2", "ep2-alltoall", "tp2"])
def test_muse_tiny_two_ranks(tmp_path, tiny_single, mesh, replicated, monkeypatch):
    """``replicated``: MUSECORE_MOE_REPLICATED_TOKENS; 0 sends every MoE layer through the all-to-all path
    (the default, 64, takes one all-reduce at these sizes outside sequence-parallel prefill)."""
    monkeypatch.setenv("MUSECORE_MOE_REPLICATED_TOKENS", replicated)  # the plan below reads it too
    many = run_ranks(2, tmp_path / "many.pt", *mesh, extra_env={"MUSECORE_MOE_REPLICATED_TOKENS": replicated})
    compare(tiny_single, many, BF16_TOL)
    check_against_plan(many, mesh_from(mesh))


def mesh_from(args: tuple[str, ...]):
    from musecore.distributed import Mesh
    value = lambda flag: int(args[args.index(flag) + 1]) if flag in args else 1  # noqa: E731
    return Mesh(value("--tp"), value("--ep"), "--sp" in args)


def check_against_plan(many: dict, mesh) -> None:
    """The plan's per-rank weight bytes within 10% of what each rank holds, and its collective bytes
    (summed over ranks: exact for any routing) equal to what ``Comm`` counted for the worker's
    4-token prefill and 1-token decode."""
    import musecore
    from musecore.config import MuseConfig
    from musecore.planning_mesh import COLLECTIVES, collective_bytes_total

    plan = musecore.plan("muse-tiny", "cpu", tp=mesh.tp, ep=mesh.ep, sp=mesh.sp)
    held = max(r["weight_bytes"] for r in many["ranks"])
    assert abs(held - plan.mesh.weight_bytes) <= 0.1 * held, \
        f"busiest rank holds {held} weight bytes, the plan says {plan.mesh.weight_bytes}"
    config = MuseConfig.from_name("muse-tiny")
    for phase, tokens in (("prefill_traffic", 4), ("decode_traffic", 1)):
        counted = {name: sum(r[phase].get(name, 0) for r in many["ranks"]) for name in COLLECTIVES}
        predicted = collective_bytes_total(config, mesh, tokens=tokens, dtype_bytes=2)
        assert counted == predicted, f"{phase}: Comm counted {counted}, the plan predicts {predicted}"


def test_muse_tiny_four_ranks_kv_heads_replicated(tmp_path, tiny_single):
    """tp=4 > the 2 KV heads: each KV head lives on two ranks."""
    mesh = ("--tp", "4", "--ep", "4", "--sp")
    many = run_ranks(4, tmp_path / "many.pt", *mesh)
    compare(tiny_single, many, BF16_TOL)
    check_against_plan(many, mesh_from(mesh))


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory) -> Path:
    """fp32 random model with dense-MLP layers, 6 query / 3 KV heads (tp=2 splits a KV group: 3 local
    KV slots per rank) and producer per-expert keys (each rank reads only its experts)."""
    config = small_config(num_attention_heads=6, num_key_value_heads=3, vocab_size=98, num_hidden_layers=4, hidden_size=96,
                          mlp_layer_types=["dense", "sparse", "sparse", "dense"])
    tensors = random_tensors(config)
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
        prefix = name[: -len(".gate_up_proj")]
        gate_up, down = tensors.pop(name), tensors.pop(prefix + ".down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            tensors[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :inter].contiguous()
            tensors[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, inter:].contiguous()
            tensors[f"{prefix}.{e}.down_proj.weight"] = down[e].contiguous()
    folder = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "random", config, tensors, shards=2)
    return folder


def test_random_model_dense_layers_uneven_kv_split(tmp_path, random_checkpoint):
    args = ("--model", str(random_checkpoint), "--dtype", "float32", "--vocab-limit", "98")
    one = single(tmp_path / "one.pt", *args)
    compare(one, run_ranks(2, tmp_path / "many.pt", *args, "--tp", "2", "--ep", "2"), 1e-4)
    compare(one, run_ranks(2, tmp_path / "a2a.pt", *args, "--tp", "2", "--ep", "2",
                           extra_env={"MUSECORE_MOE_REPLICATED_TOKENS": "0"}), 1e-4)
    compare(one, run_ranks(2, tmp_path / "sp.pt", *args, "--tp", "2", "--ep", "2", "--sp"), 1e-4)


def test_two_nodes_on_localhost(tmp_path, tiny_single):
    """Two ``torchrun --nnodes 2`` launches meeting at one rendezvous endpoint, one rank each."""
    port, out = free_port(), tmp_path / "nodes.pt"
    cmd = lambda node: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),  # noqa: E731
                        "--nproc-per-node", "1", "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
                        "--master-port", str(port), str(WORKER), "--out", str(out), "--tp", "2", "--ep", "2"]
    nodes = [subprocess.Popen(cmd(n), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
             for n in (0, 1)]
    outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S) for p in nodes]
    for n, (p, (_, err)) in enumerate(zip(nodes, outputs)):
        assert p.returncode == 0, f"node {n} exited {p.returncode}:\n{err[-3000:]}"
    compare(tiny_single, torch.load(out), BF16_TOL)


# -- faults: a clear error on every rank, never a hang ---------------------------------------------

def test_world_size_that_does_not_match_the_mesh(tmp_path):
    done = launch(2, tmp_path / "x.pt", "--tp", "4")
    assert done.returncode != 0
    assert "needs 4 ranks but this launch has 2" in done.stderr, done.stderr[-2000:]


def test_checkpoint_missing_on_one_rank(tmp_path):
    done = launch(2, tmp_path / "x.pt", "--tp", "2", "--model-on-rank1", str(tmp_path / "absent"))
    assert done.returncode != 0
    line = "failed on 1 of 2 ranks: rank 1:"
    assert done.stderr.count(line) == 2, f"expected the error on both ranks:\n{done.stderr[-3000:]}"


def test_rank_that_never_starts_times_out(tmp_path):
    """Rank 0 of a world of 2 whose rank 1 never comes: a DistributedError after MUSECORE_DIST_TIMEOUT."""
    script = ("import musecore\n"
              "musecore.load('muse-tiny', device='cpu', tp=2, ep=2, progress=False)\n")
    e = env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
            MUSECORE_DIST_TIMEOUT="5")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=e)
    assert done.returncode != 0
    assert "rank 0: could not join the process group" in done.stderr, done.stderr[-2000:]


def test_mesh_that_does_not_divide_the_model():
    from musecore.distributed import Mesh, MeshError
    from musecore.config import MuseConfig
    config = MuseConfig.from_name("muse-tiny")
    problems = Mesh(tp=8, ep=8).problems(config)
    assert any("query heads" in p for p in problems) and any("12 experts" in p for p in problems), problems
    with pytest.raises(MeshError, match="does not divide"):
        Mesh(tp=1, ep=8).check(config)


def test_cli_generate_across_ranks_prints_once(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "musecore", "generate", "--model", "muse-tiny", "--device", "cpu", "--tp", "2", "--ep", "2",
           "--prompt", "def fib(n):", "--max-new-tokens", "12", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env())
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    one = subprocess.run([sys.executable, "-m", "musecore", "generate", "--model", "muse-tiny", "--device", "cpu",
                          "--prompt", "def fib(n):", "--max-new-tokens", "12", "--json"],
                         capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env())
    assert len(lines) == 1, done.stdout
    assert lines[0]["completion"] == json.loads(one.stdout)["completion"]


# -- the distributed benchmark (musecore bench --case distributed) ---------------------------------

def test_distributed_bench_rows_on_two_gloo_ranks(monkeypatch):
    """``musecore.distributed_bench.launch``: one layer of muse-tiny on one rank and on TP2/EP2, decode at batch 1
    and 2 and one prefill, each row with both throughputs, the scaling, the all-to-all bus bandwidth measured in the
    run and the largest difference of the sampled logits from one rank (muse-tiny's BF16 tolerance, as above)."""
    from musecore.distributed_bench import launch as bench_launch
    for key, value in env().items():
        monkeypatch.setenv(key, value)
    rows = bench_launch("cpu", 2, "--preset", "muse-tiny", "--layers", "1", "--batches", "1,2", "--prefill", "16",
                        "--steps", "2", timeout_s=LAUNCH_TIMEOUT_S)
    assert [(r["shape"], r["M"]) for r in rows] == [("muse-tiny x1 layers, decode", 1),
                                                  ("muse-tiny x1 layers, decode", 2),
                                                  ("muse-tiny x1 layers, prefill", 16)], rows
    for r in rows:
        assert r["ranks"] == 2 and r["case"] == "distributed" and r["format"] == "bf16", r
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_one_rank"] > 0, r
        assert r["scaling_efficiency"] == pytest.approx(r["tokens_per_s"] / r["tokens_per_s_one_rank"] / 2), r
        assert r["all_to_all_bus_GBps"] > 0 and r["hardware"]["torch"] == torch.__version__, r
        assert r["logits_max_abs_diff_vs_one_rank"] <= BF16_TOL, r


def test_distributed_bench_failure_names_the_ranks_error():
    """A rank that fails (here: an unknown preset) is one clear line, not torchrun's summary of which rank died."""
    from musecore.distributed_bench import launch as bench_launch
    with pytest.raises(RuntimeError) as failed:
        bench_launch("cpu", 2, "--preset", "nope", timeout_s=LAUNCH_TIMEOUT_S)
    message = str(failed.value)
    assert message.startswith("distributed benchmark with 1 rank(s) failed: ValueError: unknown preset 'nope'"), message
    assert "ChildFailedError" not in message and "\n" not in message, message
