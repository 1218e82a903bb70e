"""``musecore generate``: load a model, continue a prompt, stream the text, report tokens/s.

The quickest end-to-end check that a device works: it goes through the same ``musecore.load``
and ``model.generate`` a user calls. Text streams to stdout as it is produced and the throughput
goes to stderr, so ``musecore generate ... > out.txt`` captures only the completion; ``--json``
prints one object instead, for scripts.

With ``--image``/``--video``/``--audio`` the prompt becomes one user turn of the checkpoint's chat
template, the media parts first (in command-line order), then the text, and the output is the
assistant's reply: ``musecore generate --model muse-tiny-mm --image shapes.png "What shape is this?"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from musecore.commands import add_media, add_mesh, add_model, add_sampling, check_media_files, media_parts


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("generate", help="continue a prompt, streaming the text",
                                   description="Continue a prompt with a Muse model, streaming the text to stdout "
                                               "and the throughput to stderr.")
    add_model(parser)
    add_mesh(parser)
    parser.add_argument("prompt_text", nargs="?", default=None, metavar="PROMPT",
                        help="the text to continue (or --prompt TEXT; default: read from stdin)")
    parser.add_argument("--prompt", help="the text to continue (default: read from stdin)")
    add_media(parser, "to put in the prompt (the prompt is then a chat turn through the chat template)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (default: 64)")
    add_sampling(parser)
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="stop at this text (repeatable); it is not printed")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object {completion, prompt_tokens, new_tokens, tokens_per_s}")
    parser.set_defaults(run=run)
    return parser


def _read_prompt(args: argparse.Namespace) -> str:
    from musecore.cli import UsageError

    if args.prompt is not None and args.prompt_text is not None:
        raise UsageError("the prompt was given twice (as --prompt and as an argument); give it once")
    if args.prompt_text is not None:
        return args.prompt_text
    if args.prompt is not None:
        return args.prompt
    if args.tp or args.ep:
        raise UsageError("pass the prompt with --prompt when running across ranks (torchrun gives stdin to one rank)")
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: pass --prompt TEXT or pipe the text on stdin")
    return sys.stdin.read()


def _load(args: argparse.Namespace) -> Any:
    import musecore
    from musecore.cli import UsageError

    model = musecore.load(args.model, device=args.device, emulate=args.emulate, quantize_dense=args.quantize_dense,
                          download=args.download, progress=not getattr(args, "quiet", False), tp=args.tp,
                          ep=args.ep, sp=args.sp)
    if model.tokenizer is None:
        raise UsageError(f"{args.model} has no tokenizer.json, so it cannot take a text prompt; "
                         "use model.generate(list_of_token_ids) from Python instead")
    return model


def run(args: argparse.Namespace) -> int:
    from musecore.generate import _validate_options

    # Bad options fail here, before a weight is read (or stdin waited on), with generate()'s own message.
    _validate_options(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    prompt = _read_prompt(args)
    if not prompt and not args.media:
        from musecore.cli import UsageError
        raise UsageError("the prompt is empty: pass the text with --prompt or on stdin")
    check_media_files(args.media)
    model = _load(args)
    if args.media:  # one user turn: the media parts, then the text; the reply is the completion
        content = media_parts(args.media) + ([{"type": "text", "text": prompt}] if prompt else [])
        prompt = [{"role": "user", "content": content}]
    stream = None
    if model.comm is not None and model.comm.rank != 0:  # every rank computes the same tokens; rank 0 prints
        model.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       top_k=args.top_k, seed=args.seed, stop=args.stop)
        return 0
    if not args.json:
        def stream(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

    completion = model.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop, stream=stream)
    stats = model.last_generation_stats
    if args.json:
        print(json.dumps({"completion": completion, "prompt_tokens": stats.prompt_tokens,
                          "new_tokens": stats.new_tokens, "tokens_per_s": round(stats.decode_tokens_per_s, 3)}))
        return 0
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"{stats.new_tokens} new tokens from a {stats.prompt_tokens}-token prompt: "
          f"prefill {stats.prefill_seconds:.3f} s, decode {stats.decode_tokens_per_s:.1f} tokens/s",
          file=sys.stderr)
    return 0
