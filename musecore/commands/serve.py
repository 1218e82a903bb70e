"""``musecore serve``: an OpenAI-compatible HTTP server (``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, ``/health``, ``/metrics``) with continuous batching, run by uvicorn.

Needs the ``serve`` extra (FastAPI and uvicorn): ``pip install -e ".[serve]"`` from the repository.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from musecore.commands import add_model


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching",
                                   description="Serve a Muse model over an OpenAI-compatible HTTP API. Requests "
                                               "join the running decode batch at the next step and leave when done.")
    add_model(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id clients send and /v1/models lists (default: --model)")
    parser.add_argument("--max-batch", type=int, default=16,
                        help="requests decoded together at most; more wait for a free row (default: 16)")
    parser.add_argument("--max-waiting", type=int, default=64,
                        help="requests waiting at most; beyond that a request gets HTTP 429 (default: 64)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length per request, prompt plus completion (default: the model's "
                             "max_position_embeddings)")
    parser.add_argument("--prefill-graphs", default="short", choices=("short", "all", "off"),
                        help="where decode steps replay graphs (CUDA, ROCm), which prompt prefills are captured when "
                             "the server starts: 'short' (default) the one-prompt buckets of up to 32 tokens, the "
                             "others when first needed (that request waits for the capture); 'all' every bucket "
                             "(a longer start); 'off' none (every prefill runs eagerly)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's log level (default: info)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from musecore.cli import UsageError

    try:
        import uvicorn

        from musecore.serve.app import make_app
    except ImportError as e:
        raise UsageError(f"musecore serve needs FastAPI and uvicorn ({e}); install them from the repository with "
                         "pip install -e \".[serve]\"") from None
    if args.max_batch < 1 or args.max_waiting < 0:
        raise UsageError("--max-batch must be >= 1 and --max-waiting >= 0")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise UsageError(f"--max-model-len must be >= 1 (or left out: the model's context); got {args.max_model_len}")
    check_listen(args.host, args.port)  # before the load, which can take minutes
    import os

    from musecore.threads import NUM_THREADS_ENV, configure_threads

    # Every usable core unless MUSECORE_NUM_THREADS says otherwise, not the free-cores rule of the other
    # commands: on the shared 2-core CI machine (load 7-8) benchmarks/serve_bench.py --device xeon ran
    # 252/280 tokens/s at 1 client and 527/557 at 16 with 2 threads, 115/81 and 289/397 with 1 (two
    # interleaved runs each), while `generate` there was 20x faster with 1 thread; the cause is not known.
    os.environ.setdefault(NUM_THREADS_ENV, "all")  # read again by the xeon backend as the model loads
    configure_threads()
    import musecore

    model = musecore.load(args.model, device=args.device, emulate=args.emulate, quantize_dense=args.quantize_dense,
                          download=args.download, progress=not getattr(args, "quiet", False))
    if model.tokenizer is None:
        raise UsageError(f"{args.model} has no tokenizer.json; the server takes text, so it needs one")
    name = args.served_model_name or str(args.model)
    app = make_app(model, name, max_batch=args.max_batch, max_waiting=args.max_waiting,
                   max_model_len=args.max_model_len, prefill_graphs=args.prefill_graphs)
    print(f"serving {name} on {model.plan.device} at http://{args.host}:{args.port}/v1", file=sys.stderr)
    engine = app.state.engine
    if engine.graphs:  # Engine.start (at the app's startup) captures them before the first request is taken
        rows = [r for r, _ in engine.start_buckets()]
        prefills = engine.start_prefills()
        print(f"capturing the decode steps for {len(rows)} batch sizes ({', '.join(map(str, rows))}) and "
              f"{len(prefills)} prompt prefill buckets (--prefill-graphs {args.prefill_graphs}) before the first "
              "request (seconds each; other buckets are captured when first needed; -v logs every capture)",
              file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def check_listen(host: str, port: int) -> None:
    """A UsageError when the server could not listen on ``host:port`` (a port out of range, a host that does not
    resolve, an address in use), found by binding a socket as uvicorn will and closing it."""
    import socket

    from musecore.cli import UsageError

    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0..65535; got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r} does not resolve ({e.strerror}); pass an address of this machine") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port} ({e.strerror}); pass another --port or --host, or stop "
                             "what holds it") from None
