"""``musecore chat``: talk to a model through its chat template, one line per user turn.

The conversation is kept (each reply is answered with the whole history); ``/reset`` forgets it
(the ``--system`` message stays), end of input (Ctrl-D, or the end of a piped file) leaves. Replies
stream to stdout; the prompt marker is shown only on a terminal, so ``musecore chat < questions.txt``
prints only the replies, one per line.

Media: ``--image/--video/--audio PATH`` attach files to the first message, and the lines
``/image PATH``, ``/video PATH``, ``/audio PATH`` attach one to the next message (media parts first,
then the text, as the command line gives them). They stay in the conversation, so later turns see
them again; the model's encoder cache makes that free (the tower does not run again).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from musecore.commands import MEDIA_KINDS, add_media, add_model, add_sampling, check_media_files, media_parts

HELP = ("commands: /image PATH, /video PATH, /audio PATH attach a file to your next message, /reset forgets the "
        "conversation, /help shows this, /exit (or end of input) leaves; '//' starts a message with '/'")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("chat", help="an interactive chat through the model's chat template",
                                   description="Chat with a Muse model: each line you type is a user turn; the "
                                               f"reply streams back. {HELP}.")
    add_model(parser)
    parser.add_argument("--system", default=None, help="a system message that opens the conversation")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="at most this many tokens per reply "
                                                                        "(default: 256)")
    add_sampling(parser)
    add_media(parser, "attached to your first message")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import musecore
    from musecore.generate import _validate_options

    # Bad options fail here, before a weight is read, with generate()'s own message.
    _validate_options(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    check_media_files(args.media)
    interactive = sys.stdin is not None and sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and up-arrow history for input())
        except ImportError:
            pass
    model = musecore.load(args.model, device=args.device, emulate=args.emulate, quantize_dense=args.quantize_dense,
                          download=args.download, progress=not getattr(args, "quiet", False))
    from musecore.chat import chat_prompt

    opening = [{"role": "system", "content": args.system}] if args.system else []
    chat_prompt(model, opening or [{"role": "user", "content": ""}])  # no template: fail before the first turn
    messages = list(opening)
    pending = media_parts(args.media)  # media for the next user message
    if args.media:  # a checkpoint without the tower fails now, not after the first message is typed
        from musecore.multimodal import MediaPart, check_towers
        check_towers(model, [MediaPart(kind, path, f"--{kind} {path}") for kind, path in args.media])
    if interactive:
        print(f"chatting with {args.model} on {model.plan.device}; {HELP}", file=sys.stderr)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, seed=args.seed)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages, pending = list(opening), []
            print("(conversation reset)", file=sys.stderr)
            continue
        if text == "/help":
            print(f"({HELP})", file=sys.stderr)
            continue
        command, _, path = text.partition(" ")
        if text.startswith("//"):  # an escaped slash: a message, not a command
            line = line.replace("//", "/", 1)
        elif command.startswith("/") and command[1:].isalpha() and command[1:] not in MEDIA_KINDS:  # a mistyped command
            print(f"(unknown command {command}; {HELP})", file=sys.stderr)
            continue
        if command[1:] in MEDIA_KINDS and command.startswith("/"):
            kind, path = command[1:], path.strip()
            if not path:
                print(f"(usage: /{kind} PATH)", file=sys.stderr)
            elif not Path(path).is_file():
                print(f"(/{kind} {path}: no such file)", file=sys.stderr)
            else:
                pending.append({"type": kind, "path": path})
                print(f"({kind} {path} attached to your next message)", file=sys.stderr)
            continue
        if pending:
            messages.append({"role": "user", "content": pending + [{"type": "text", "text": line}]})
            pending = []
        else:
            messages.append({"role": "user", "content": line})

        def show(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        try:
            reply = model.chat(messages, stream=show, **options)
        except ValueError as e:  # bad media or a message the model cannot take: say so, keep the conversation
            if not interactive:
                raise  # (the command's one error line)
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": reply})
