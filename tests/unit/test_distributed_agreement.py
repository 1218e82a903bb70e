"""Ranks of one launch that were given different options refuse with one line on every rank, and a rank that dies
mid-generation is one DistributedError line on the others (musecore.distributed.Comm.agree_on, agree_request,
Comm._collective).

The multi-rank cases launch a short script under ``python -m torch.distributed.run`` on gloo, bounded as
tests/distributed/test_distributed.py bounds its launches (LAUNCH_TIMEOUT_S, MUSECORE_DIST_TIMEOUT).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from musecore.distributed import Comm, DistributedError, Mesh
from tests.distributed.test_distributed import LAUNCH_TIMEOUT_S, env, free_port

PRELUDE = """
import os, sys
import musecore
from musecore.distributed import DistributedError
RANK = int(os.environ["RANK"])
def report(line):
    with open(os.path.join(sys.argv[1], f"rank{RANK}.txt"), "w") as f:
        f.write(line)
"""


def launch_script(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, dict[int, str]]:
    script = tmp_path / "ranks.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(script), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                          env=env(MUSECORE_DIST_TIMEOUT="30"))
    reports = {r: (tmp_path / f"rank{r}.txt").read_text() for r in (0, 1) if (tmp_path / f"rank{r}.txt").exists()}
    return done, reports


def test_ranks_given_different_meshes_refuse_to_load_naming_the_mesh_on_every_rank(tmp_path):
    done, reports = launch_script(tmp_path, """
        try:
            musecore.load("muse-tiny", device="cpu", tp=2, ep=2 if RANK == 0 else 1, progress=False)
            report("loaded")
        except DistributedError as e:
            report(str(e))
    """)
    assert sorted(reports) == [0, 1], done.stderr[-3000:]
    for rank, line in reports.items():
        assert "different mesh" in line and "rank 0: 'tp=2 ep=2" in line and "rank 1: 'tp=2 ep=1" in line, (rank, line)
        assert "\n" not in line


def test_ranks_asked_different_generations_refuse_before_any_collective_of_the_step(tmp_path):
    done, reports = launch_script(tmp_path, """
        from musecore.distributed import agree_request
        model = musecore.load("muse-tiny", device="cpu", tp=2, progress=False)
        agree_request(model.comm, [[1, 2, 3]], 4, 0.0, 1.0, 0, None, None)  # the same request: no error
        lines = []
        for change in ({"temperature": 1.5, "seed": 7}, {"max_new_tokens": 5}, {"prompt_ids": [[1, 2, 4]]}):
            request = {"prompt_ids": [[1, 2, 3]], "max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                       "seed": None, "stop": None, **(change if RANK == 1 else {})}
            try:
                agree_request(model.comm, **request)
                lines.append("agreed")
            except DistributedError as e:
                lines.append(str(e))
        report("\\n".join(lines))
    """)
    assert sorted(reports) == [0, 1], done.stderr[-3000:]
    for rank, text in reports.items():
        temperature, max_new_tokens, prompt = text.split("\n")
        assert "different temperature (rank 0: 0.0, rank 1: 1.5)" in temperature, (rank, temperature)
        assert "different max_new_tokens (rank 0: 4, rank 1: 5)" in max_new_tokens, (rank, max_new_tokens)
        assert "different prompt" in prompt, (rank, prompt)


def test_a_rank_that_dies_mid_generation_is_one_distributed_error_line_on_the_others(tmp_path):
    done, reports = launch_script(tmp_path, """
        model = musecore.load("muse-tiny", device="cpu", tp=2, progress=False)
        if RANK == 1:
            os._exit(0)  # gone without a word: rank 0's next collective finds the connection closed
        try:
            model.generate([1, 2, 3], max_new_tokens=8)
            report("generated")
        except DistributedError as e:
            report(f"{str(e)}\\ncause: {type(e.__cause__).__name__}")
    """)
    assert 0 in reports, done.stderr[-3000:]
    line, cause = reports[0].split("\n")
    assert line.startswith("rank 0: collective ") and "another rank probably died or stalled" in line, line
    assert "MUSECORE_DIST_TIMEOUT" in line and cause != "cause: NoneType", reports[0]


def test_a_failed_collective_becomes_a_distributed_error_keeping_the_original():
    comm = Comm(Mesh(2), rank=1)

    def closed(*_args, **_kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234\nmore lines")

    with pytest.raises(DistributedError) as info:
        comm._collective("all_gather", closed)
    message = str(info.value)
    assert "\n" not in message and "Connection closed" in message, message
    assert message.startswith("rank 1: collective all_gather failed ("), message
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_rank_started_without_the_mesh_makes_the_others_refuse_at_once(tmp_path):
    """Rank 1 loads alone (no tp/ep) while rank 0 was given tp=2: rank 0 refuses naming rank 1 instead of waiting for
    it until the rendezvous timeout (30 s here; the whole launch must end well before), and rank 1 loads alone."""
    import time
    start = time.monotonic()
    done, reports = launch_script(tmp_path, """
        try:
            if RANK == 0:
                musecore.load("muse-tiny", device="cpu", tp=2, ep=2, progress=False)
            else:
                musecore.load("muse-tiny", device="cpu", progress=False)
            report("loaded")
        except Exception as e:
            report(f"{type(e).__name__}: {e}")
    """)
    took = time.monotonic() - start
    assert reports.get(0, "").startswith("MeshError: rank 0 was given mesh tp=2 ep=2 but rank 1 of this launch loads "
                                         "the model alone"), (reports, done.stderr[-3000:])
    assert took < 25, f"the launch took {took:.1f} s: rank 0 waited for the rendezvous timeout (30 s)"


def test_ranks_that_all_load_alone_each_get_the_whole_model(tmp_path):
    """Independent replicas under torchrun (data parallel): no rank waits for another, every rank loads."""
    done, reports = launch_script(tmp_path, """
        musecore.load("muse-tiny", device="cpu", progress=False)
        report("loaded")
    """)
    assert reports == {0: "loaded", 1: "loaded"}, done.stderr[-3000:]
