"""One rank of the distributed tests (started by torchrun from tests/distributed/test_distributed.py).

Loads a model with the mesh given on the command line, runs a forward pass over a fixed batch,
a greedy generation and a sampled one, and has rank 0 save what every rank computed (rank 0's
logits, every rank's tokens, the bytes each collective moved) with ``torch.save``.
"""

import argparse
import os
import sys

import torch

import musecore


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="muse-tiny")
    p.add_argument("--model-on-rank1", default=None, help="rank 1 loads this instead (fault tests)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--ep", type=int, default=None)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--random", default=None, help="a preset loaded with random weights instead of --model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vocab-limit", type=int, default=None, help="fold the prompts' ids below this")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.model_on_rank1 is not None and int(os.environ.get("RANK", 0)) == 1:
        args.model = args.model_on_rank1
    if args.random:
        model = musecore.api.load_random(args.random, device=args.device, tp=args.tp, ep=args.ep, sp=args.sp,
                                         dtype=dtype)
    else:
        model = musecore.load(args.model, device=args.device, tp=args.tp, ep=args.ep, sp=args.sp, progress=False,
                              dtype=dtype)
    comm = model.comm
    ids = torch.tensor([[1, 414, 286, 300, 17, 9, 1000, 5], [3, 2, 1, 77, 88, 99, 11, 12]])
    if args.vocab_limit:
        ids = ids % (args.vocab_limit - 4)  # below the multimodal placeholder ids
    logits = model.forward(ids)
    prompt = ids[0, :4].tolist()
    if comm is not None:
        comm.reset_traffic()
    cache = model.new_cache(1, 64)
    model.forward(torch.tensor([prompt]), cache=cache)
    prefill_traffic = dict(comm.traffic) if comm is not None else {}
    if comm is not None:
        comm.reset_traffic()
    model.forward(ids[:1, 4:5], cache=cache)
    decode_traffic = dict(comm.traffic) if comm is not None else {}
    greedy = model.generate(prompt, max_new_tokens=12)
    sampled = model.generate(prompt, max_new_tokens=12, temperature=0.9, top_p=0.9)
    rank = comm.rank if comm is not None else 0
    everyone = [None] * (comm.world if comm is not None else 1)
    mine = {"greedy": greedy, "sampled": sampled, "prefill_traffic": prefill_traffic,
            "decode_traffic": decode_traffic, "weight_bytes": model.weight_bytes()}
    if comm is not None:
        comm.dist.all_gather_object(everyone, mine, group=comm.group)
    else:
        everyone = [mine]
    if rank == 0:
        torch.save({"logits": logits, "ranks": everyone}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
