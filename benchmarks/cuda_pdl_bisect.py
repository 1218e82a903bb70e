"""Which kernels break bench_e2e's generate sequence with PDL on: one process per MUSECORE_CUDA_PDL setting
(1, or a comma list of kernel names), printing the last run reached and the error::

    python benchmarks/cuda_pdl_bisect.py 1 fp4_gemv_mma,moe_finalize
"""
import os, subprocess, sys
SETS = sys.argv[1:]
code = r'''
import torch
from musecore.api import load_random
from musecore_cuda.bench import memory_ceiling_gbps
memory_ceiling_gbps()
for fmt in ("bf16", "nvfp4"):
    model = load_random("muse-small", "h200", checkpoint_format=fmt)
    for graphs in ((True, False) if fmt == "nvfp4" else (True,)):
        model.backend.wants_static_cache = graphs
        for batch in (1, 32):
            gen = torch.Generator().manual_seed(batch)
            prompts = torch.randint(0, model.config.vocab_size, (batch, 32), generator=gen).tolist()
            print("RUN", fmt, graphs, batch, flush=True)
            model.generate(prompts, max_new_tokens=4)
            torch.cuda.synchronize()
            model.generate(prompts, max_new_tokens=16)
            torch.cuda.synchronize()
    del model
    torch.cuda.empty_cache()
print("OK")
'''
for s in SETS:
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MUSECORE_CUDA_PDL": s}, capture_output=True, text=True, timeout=240)
    lines = (r.stdout + r.stderr).strip().splitlines()
    runs = [l for l in lines if l.startswith("RUN")]
    msg = [l for l in lines if l.startswith("OK") or "Error" in l][:2]
    print(f"{s[:70]:70s} rc={r.returncode} last={runs[-1] if runs else None} {msg}", flush=True)
