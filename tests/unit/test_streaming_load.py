"""Streaming load: peak host memory stays near one shard beyond the model itself."""

import json
import os
import subprocess
import sys
import textwrap

import torch

from tests.helpers import random_tensors, small_config, write_checkpoint

PROBE = textwrap.dedent("""
    import json, sys, threading, time, torch
    import musecore, musecore.api, musecore_quant.checkpoint  # imports before the baseline

    def rss():  # resident bytes now (ru_maxrss cannot be reset after the imports' own peak)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    # Warm up: a first load imports everything load touches; freeing it leaves the allocator warm.
    del_me = musecore.load(sys.argv[1], device="cpu", dtype=torch.bfloat16, progress=False)
    del del_me
    import gc; gc.collect()
    before, peak, done = rss(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)
    sampler = threading.Thread(target=sample)
    sampler.start()
    model = musecore.load(sys.argv[1], device="cpu", dtype=torch.bfloat16, progress=False)
    done.set()
    sampler.join()
    print(json.dumps({"before": before, "peak": max(peak[0], rss()), "after": rss()}))
""")


def test_peak_host_memory_is_the_model_plus_about_one_shard(tmp_path):
    config = small_config(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_local_experts=8,
                          moe_hidden_size=256, moe_intermediate_size=512, head_dim=64, num_attention_heads=8,
                          num_key_value_heads=2)
    tensors = random_tensors(config, dtype=torch.bfloat16)
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    shards = 16
    folder = write_checkpoint(tmp_path / "big", config, tensors, shards=shards)
    del tensors
    shard_bytes = max(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert model_bytes > 5 * shard_bytes, "the checkpoint must be several times larger than one shard"
    # glibc keeps freed large blocks in its heap unless they were mmapped: a low mmap threshold makes
    # resident memory follow live memory, which is what this test is about.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True, check=True, env=env)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    transient = m["peak"] - m["before"] - model_bytes
    budget = 2 * shard_bytes + 4 * 2**20  # a naive read-everything loader needs ~model_bytes more
    assert transient < budget, (f"load used {transient / 2**20:.1f} MiB beyond the {model_bytes / 2**20:.1f} MiB model; "
                                f"budget {budget / 2**20:.1f} MiB (one shard is {shard_bytes / 2**20:.1f} MiB)")
