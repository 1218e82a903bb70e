"""Which kernels break bench_e2e's generate sequence with PDL on: one process per setting ``PDL[/EARLY]``
(``MUSECORE_CUDA_PDL``: 1 or a comma list of kernel names; ``MUSECORE_CUDA_PDL_EARLY``: 1, 0 or names; see
``musecore_cuda/kernels/pdl.py``; ``default`` sets neither, as shipped), printing the last run reached, the error
and whether the generated tokens equal the first setting's::

    python backends/cuda/lab/scripts/cuda_pdl_bisect.py 0 default 1 1/0 fp4_gemv_mma,moe_finalize/fp4_gemv_mma
"""
import os, subprocess, sys
SETS = sys.argv[1:]
code = r'''
import hashlib
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
            out = model.generate(prompts, max_new_tokens=16)
            torch.cuda.synchronize()
            print("TOKENS", fmt, graphs, batch, hashlib.sha1(repr(out).encode()).hexdigest(), flush=True)
    del model
    torch.cuda.empty_cache()
print("OK")
'''
reference = None
for s in SETS:
    pdl, _, early = s.partition("/")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUSECORE_CUDA_PDL")}
    if s != "default":  # "default": neither variable set, as shipped
        env.update({"MUSECORE_CUDA_PDL": pdl, "MUSECORE_CUDA_PDL_EARLY": early or "1"})
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    lines = (r.stdout + r.stderr).strip().splitlines()
    runs = [l for l in lines if l.startswith("RUN")]
    msg = [l for l in lines if l.startswith("OK") or "Error" in l][:2]
    tokens = [l for l in lines if l.startswith("TOKENS")]
    reference = reference if reference is not None else tokens
    same = tokens == reference
    print(f"{s[:60]:60s} rc={r.returncode} last={runs[-1] if runs else None} tokens same as the first setting: "
          f"{same} {msg}", flush=True)
