"""``musecore-quant``: inspect, convert, verify and diff checkpoints from the shell.

Every read command takes ``--json`` (a single JSON document on stdout; its schema is in
``musecore_quant/schemas``); long work reports progress on stderr, as a bar on a terminal and one
line per stage elsewhere (``musecore_quant.progress``). ``convert`` quantizes a Muse checkpoint's
routed experts of layers 1..L-2 by default (``convert.default_include``). Exit codes: 0 ok, 1 a verification or diff failure, 2 bad input or
usage (one line on stderr, no traceback), 3 an internal error (a bug: one line too), 130
interrupted. ``MUSECORE_DEBUG=1`` shows the traceback of errors 2 and 3.

Example::

    musecore-quant inspect Muse-Spark-Open-NVFP4
    musecore-quant convert Muse-Spark-Open-NVFP4 Muse-Spark-Open-MXFP4 --to mxfp4
    musecore-quant verify Muse-Spark-Open-MXFP4
    musecore-quant diff Muse-Spark-Open-NVFP4 Muse-Spark-Open-MXFP4 --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from .api import dequantize
from .checkpoint import CheckpointError, CheckpointReader, open_checkpoint, verify_checkpoint
from .checkpoint.errors import translate
from .metrics import quant_error
from .progress import progress as stage
from .qtensor import QTensor

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
_LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")
# decoder kind -> (block scale role, global scale role, how a stored block scale reads as a number)
_SCALE_ROLES = {
    "dense-nvfp4": ("weight_scale", "weight_scale_2", "value"),
    "ct-nvfp4": ("weight_scale", "weight_global_scale", "value"),
    "dense-mxfp4": ("weight_scale", None, "e8m0"),
    "gpt-oss-mxfp4": ("scales", None, "e8m0"),
    "dense-fp8-tensor": ("weight_scale", None, "value"),
    "int4-gptq": ("scales", None, "value"),
    "int4-awq": ("scales", None, "value"),
}


def _dump(obj: Any) -> str:
    def safe(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: safe(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [safe(v) for v in x]
        return x
    return json.dumps(safe(obj), indent=2)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


# ------------------------------------------------------------------------------------ inspect
def inspect_checkpoint(reader: CheckpointReader, scale_stats: bool = True, progress: bool = False) -> dict[str, Any]:
    """Format, producer, sizes, per-layer formats and scale statistics of an open checkpoint."""
    from .checkpoint.experts import FUSED_EXPERT, PER_EXPERT
    weights, formats, layers, experts = {}, {}, {}, {}
    for name in reader.weight_names():
        e = reader.entry(name)
        m = FUSED_EXPERT.match(name) or PER_EXPERT.match(name)
        if m:  # routed experts per MoE layer: fused [E, 2I, h] / [E, h, I] tensors, or per-expert Linears
            x = experts.setdefault(m["prefix"], {"layout": set(), "experts": 0, "formats": {}})
            fused = "e" not in m.groupdict()
            x["layout"].add("fused" if fused else "per-expert")
            x["experts"] = max(x["experts"], e.shape[0] if fused else int(m["e"]) + 1)
            proj = x["formats"].setdefault(m["proj"], [])
            if e.format not in proj:
                proj.append(e.format)
        weights[name] = {"format": e.format, "shape": list(e.shape), "bytes": e.nbytes,
                         "group_size": e.group_size if e.quantized else None,
                         "tensors": sorted(h.key for h in e.parts.values())}
        f = formats.setdefault(e.format, {"weights": 0, "bytes": 0})
        f["weights"] += 1
        f["bytes"] += e.nbytes
        m = _LAYER.match(name)
        layer = layers.setdefault(m.group(1) if m else "(outside layers)", {})
        layer[e.format] = layer.get(e.format, 0) + 1
    info = {"folder": str(reader.folder), "format": reader.format, "producer": reader.producer,
            "quant_method": reader.quant_method, "total_bytes": reader.tensor_nbytes(),
            "shards": [{"name": s.name, "bytes": s.stat().st_size} for s in reader.shards],
            "formats": formats, "layers": layers, "weights": weights,
            "experts": {p: {**x, "layout": "+".join(sorted(x["layout"]))} for p, x in experts.items()}}
    if scale_stats:
        info["scale_stats"] = _scale_stats(reader, progress)
    return info


def _scale_stats(reader: CheckpointReader, progress: bool = False) -> dict[str, Any]:
    """Min/max/mean of block scales (E8M0 as exponents) and global scales per format; scales only are read."""
    stats: dict[str, dict[str, Any]] = {}
    names = [n for n in reader.weight_names() if reader.entry(n).quantized]
    with stage("scales", total=len(names), unit="weight", enabled=progress) as bar:
        for name in names:
            bar.update(1)
            _scale_stats_of(reader, name, stats)
    for s in stats.values():
        for key in [k for k in s if isinstance(s[k], dict)]:
            acc = s[key]
            acc["mean"] = acc.pop("sum") / max(acc.pop("count"), 1)
    return stats


def _scale_stats_of(reader: CheckpointReader, name: str, stats: dict[str, dict[str, Any]]) -> None:
    """Adds the scales of weight ``name`` to ``stats`` (per format)."""
    e = reader.entry(name)
    block_role, global_role, kind = _SCALE_ROLES.get(e.kind, (e.options.get("scale_role"), None, "value"))
    parts = reader.read_parts(name, [r for r in (block_role, global_role) if r])
    s = stats.setdefault(e.format, {"weights": 0})
    s["weights"] += 1
    block = parts[block_role]
    if kind == "e8m0":
        _accumulate(s, "block_scale_exponent", block.to(torch.int32) - 127)
    else:
        values = block.to(torch.float32)
        _accumulate(s, "block_scale", values)
        s["negative_block_scales"] = s.get("negative_block_scales", 0) + int((values < 0).sum())
        s["zero_block_scales"] = s.get("zero_block_scales", 0) + int((values == 0).sum())
    if global_role:
        g = parts[global_role].to(torch.float32)
        _accumulate(s, "global_scale", 1.0 / g if e.kind == "ct-nvfp4" else g)


def _accumulate(stats: dict[str, Any], key: str, values: torch.Tensor) -> None:
    values = values.to(torch.float64)
    acc = stats.setdefault(key, {"min": math.inf, "max": -math.inf, "sum": 0.0, "count": 0})
    acc["min"] = min(acc["min"], float(values.min()))
    acc["max"] = max(acc["max"], float(values.max()))
    acc["sum"] += float(values.sum())
    acc["count"] += values.numel()


def _cmd_inspect(args: argparse.Namespace) -> int:
    with open_checkpoint(args.checkpoint) as reader:
        info = inspect_checkpoint(reader, scale_stats=not args.no_stats, progress=not args.json)
    if args.json:
        print(_dump(info))
        return EXIT_OK
    print(f"checkpoint  {info['folder']}")
    print(f"format      {info['format']}    producer {info['producer']}"
          + (f" (quant_method {info['quant_method']})" if info["quant_method"] else ""))
    print(f"size        {_mb(info['total_bytes'])} in {len(info['shards'])} shard(s), {len(info['weights'])} weights")
    for fmt, f in sorted(info["formats"].items()):
        print(f"  {fmt:<8} {f['weights']:>6} weights  {_mb(f['bytes']):>12}")
    print("per layer")
    for layer, counts in info["layers"].items():
        print(f"  {layer:<40} " + "  ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    if info["experts"]:
        print("routed experts")
    for prefix, x in info["experts"].items():
        print(f"  {prefix:<40} {x['layout']:<10} E={x['experts']:<4} "
              + "  ".join(f"{p} {'/'.join(f)}" for p, f in x["formats"].items()))
    for fmt, s in info.get("scale_stats", {}).items():
        print(f"scales {fmt} ({s['weights']} weights)")
        for key, acc in s.items():
            if isinstance(acc, dict):
                print(f"  {key:<22} min {acc['min']:.4g}  max {acc['max']:.4g}  mean {acc['mean']:.4g}")
            elif key != "weights":
                print(f"  {key:<22} {acc}")
    return EXIT_OK


# ------------------------------------------------------------------------------------ convert
def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise CheckpointError(f"--option {text!r} is not KEY=VALUE (e.g. --option rounding=away)")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


CALIBRATORS = "musecore_quant.calibrators"  # entry-point group: methods that need a model to calibrate


def _calibrated_convert(args: argparse.Namespace) -> Any:
    """``--method autoround``: tuning needs the model's own activations, which this model-agnostic
    package cannot compute; a package that knows the model registers a calibrator under
    ``musecore_quant.calibrators`` (musecore does: ``musecore.calibrate:cli_calibrator``). A calibrator is called
    ``calibrate(src, dst, calibration=, progress=, resume=)``; one with a ``formats`` attribute (the ``--to``
    formats it produces) also gets ``fmt=``; without it, it produces INT4."""
    from importlib.metadata import entry_points
    found = [ep for ep in entry_points(group=CALIBRATORS) if ep.name == args.method]
    if not found:
        raise CheckpointError(f"--method {args.method} tunes weights on the model's own activations and needs a "
                              f"calibrator plugin ({CALIBRATORS!r} entry point); install musecore, which registers 'gptq' "
                              "and, with its [autoround] extra (pip install -e '.[autoround]'), 'autoround'")
    calibrate = found[0].load()
    declared = getattr(calibrate, "formats", None)  # the --to formats it makes; a calibrator without them makes INT4
    formats = tuple(declared) if declared is not None else ("int4",)
    if args.to not in formats:
        raise CheckpointError(f"--method {args.method} produces {' or '.join(f.upper() for f in formats)}; use "
                              f"--to {' or --to '.join(formats)} (got --to {args.to})")
    if args.calibration is None:
        raise CheckpointError(f"--method {args.method} needs --calibration FILE (.txt, .jsonl or .i16 token ids)")
    extra = {"fmt": args.to} if declared is not None else {}  # only calibrators that declare formats take it
    try:
        return calibrate(args.src, args.dst, calibration=args.calibration, progress=not args.no_progress,
                         resume=not args.no_resume, **extra)
    except ValueError as e:  # the calibrators' bad-input errors (too few calibration tokens, a preset without weights)
        raise CheckpointError(f"--method {args.method}: {e}") from e


def _cmd_convert(args: argparse.Namespace) -> int:
    from .checkpoint.experts import check_layer_count, muse_rule, num_hidden_layers
    from .convert import CLI_DEFAULT_INCLUDE, DEFAULT_EXCLUDE, convert, default_include, unmatched_includes
    chosen = [flag for flag, on in (("--include", bool(args.include)), ("--muse-rule", args.muse_rule),
                                    ("--all-experts", args.all_experts)) if on]
    if len(chosen) > 1:
        raise CheckpointError(f"{' and '.join(chosen)} each choose the weights to quantize; pass one")
    if args.max_shard_bytes is not None and args.max_shard_bytes <= 0:
        raise CheckpointError(f"--max-shard-bytes must be a positive number of bytes, got {args.max_shard_bytes}; "
                              "leave it out for the default (5 GB shards)")
    _check_top(args.top)
    with open_checkpoint(args.src) as reader:  # headers only: what the selection is checked against
        config = dict(reader.config or {})
        names, config_path = reader.weight_names(), reader.folder / "config.json"
        if args.include:
            unmatched = unmatched_includes(reader, args.include)
            if unmatched:
                raise CheckpointError(f"{args.src}: no weight matches include {unmatched[0]!r} (quantizable weights "
                                      "are 2-D '*.weight' or fused expert tensors); nothing was written: fix the "
                                      "pattern (musecore-quant inspect --json lists the weight names)")
    if args.to == "bf16":
        include, selection = None, "every quantized weight dequantized (--to bf16)"
    elif args.include:
        include, selection = args.include, "--include"
    elif args.muse_rule:
        layers = num_hidden_layers(config)
        check_layer_count(layers, names, config_path)
        include, selection = muse_rule(layers), f"--muse-rule: routed experts of layers 1..{layers - 2}"
    elif args.all_experts:
        include, selection = [CLI_DEFAULT_INCLUDE], "--all-experts: every routed expert"
    else:
        include, selection = default_include(config, names, config_path)
    if args.method != "rtn":
        report = _calibrated_convert(args)
    else:
        report = convert(args.src, args.dst, to=args.to, method=args.method,
                         exclude=args.exclude if args.exclude is not None else DEFAULT_EXCLUDE, include=include,
                         quantize_options=dict(_parse_option(o) for o in args.option),
                         progress=not args.no_progress, resume=not args.no_resume, fuse_experts=args.fuse_experts,
                         **({"max_shard_bytes": args.max_shard_bytes} if args.max_shard_bytes is not None else {}))
    report.selection = selection
    if args.json:
        print(_dump(report.to_dict()))
        return EXIT_OK
    summary = report.summary()
    print(f"wrote {report.dst} ({report.to}, {report.shards} shard(s), {_mb(report.output_bytes)}) in "
          f"{report.seconds:.1f} s, {report.throughput_mb_s:.1f} MB/s of source read"
          + (f"; resumed {report.resumed_weights} weights" if report.resumed_weights else ""))
    print(f"selected {report.selection}")
    print("actions  " + "  ".join(f"{k} {v}" for k, v in sorted(summary["actions"].items())))
    for warning in report.warnings:
        print(f"warning: {warning}")
    if report.measured():
        print(f"SQNR     min {summary['min_sqnr_db']} dB  mean {summary['mean_sqnr_db']} dB"
              if summary["min_sqnr_db"] is None else
              f"SQNR     min {summary['min_sqnr_db']:.2f} dB  mean {summary['mean_sqnr_db']:.2f} dB")
        print("worst tensors (full list in conversion_report.json):")
        for t in report.worst(args.top):
            print(f"  {t.sqnr_db:7.2f} dB  max|err| {t.max_abs_error:.3g}  {t.action:<10} "
                  f"{t.source_format}->{t.target_format}  {t.name}")
    return EXIT_OK


# ------------------------------------------------------------------------------------ verify
def _cmd_verify(args: argparse.Namespace) -> int:
    if not Path(args.checkpoint).exists():
        raise CheckpointError(f"{args.checkpoint}: no such checkpoint folder")
    report = verify_checkpoint(args.checkpoint, progress=not (args.json or args.no_progress))
    if args.json:
        print(_dump(report.to_dict()))
    else:
        print(f"{'OK' if report.ok else 'FAILED'}  {report.folder}  ({report.format or '?'}, "
              f"{report.producer or '?'}, {report.weights} weights read, "
              f"{report.sha256_verified}/{report.shards} shard sha256 verified)")
        for note in report.notes:
            print(f"note: {note}")
        for problem in report.problems:
            print(f"problem: {problem}")
    return EXIT_OK if report.ok else EXIT_FAILED


# ------------------------------------------------------------------------------------ diff
def diff_checkpoints(a: CheckpointReader, b: CheckpointReader, progress: bool = False) -> dict[str, Any]:
    """Per-weight error of ``b`` against ``a`` (dequantizing both), plus structural differences."""
    names_b = set(b.weight_names())
    common = [n for n in a.weight_names() if n in names_b]
    result: dict[str, Any] = {"a": str(a.folder), "b": str(b.folder),
                              "only_in_a": [n for n in a.weight_names() if n not in names_b],
                              "only_in_b": sorted(names_b - set(a.weight_names())),
                              "shape_mismatch": [], "tensors": []}
    fp32 = lambda v: dequantize(v) if isinstance(v, QTensor) else v.to(torch.float32)  # noqa: E731
    matching = []
    for n in common:
        if a.weight_shape(n) != b.weight_shape(n):
            result["shape_mismatch"].append({"name": n, "a": list(a.weight_shape(n)), "b": list(b.weight_shape(n))})
        else:
            matching.append(n)
    with stage("diff", total=len(matching), unit="weight", enabled=progress) as bar:
        for _, weights in a.iter_shards(matching):
            for name, value in weights.items():
                other = b.read(name)
                err = quant_error(fp32(value), fp32(other))
                result["tensors"].append({"name": name, "format_a": a.weight_format(name),
                                          "format_b": b.weight_format(name), **err.as_dict()})
                bar.update(1)
    finite = [t["sqnr_db"] for t in result["tensors"] if math.isfinite(t["sqnr_db"])]
    result["summary"] = {"compared": len(result["tensors"]),
                         "identical": sum(1 for t in result["tensors"] if t["sqnr_db"] == math.inf),
                         "min_sqnr_db": min(finite) if finite else None,
                         "mean_sqnr_db": sum(finite) / len(finite) if finite else None}
    return result


def _check_top(top: int) -> None:
    if top < 0:
        raise CheckpointError(f"--top must be 0 or more (how many tensors to list), got {top}")


def _cmd_diff(args: argparse.Namespace) -> int:
    _check_top(args.top)
    if args.min_sqnr is not None and not math.isfinite(args.min_sqnr):
        raise CheckpointError(f"--min-sqnr must be a finite number of dB, got {args.min_sqnr}")
    with open_checkpoint(args.a) as a, open_checkpoint(args.b) as b:
        result = diff_checkpoints(a, b, progress=not args.json)
    below = [t for t in result["tensors"] if args.min_sqnr is not None and t["sqnr_db"] < args.min_sqnr]
    failed = bool(result["only_in_a"] or result["only_in_b"] or result["shape_mismatch"] or below)
    result["ok"] = not failed
    if args.json:
        print(_dump(result))
        return EXIT_FAILED if failed else EXIT_OK
    s = result["summary"]
    sqnr = (f", min SQNR {s['min_sqnr_db']:.2f} dB, mean {s['mean_sqnr_db']:.2f} dB"
            if s["min_sqnr_db"] is not None else "")
    print(f"compared {s['compared']} weights: {s['identical']} identical{sqnr}")
    for t in sorted(result["tensors"], key=lambda t: t["sqnr_db"])[: args.top]:
        if t["sqnr_db"] != math.inf:
            print(f"  {t['sqnr_db']:7.2f} dB  max|err| {t['max_abs_error']:.3g}  "
                  f"{t['format_a']}->{t['format_b']}  {t['name']}")
    for key in ("only_in_a", "only_in_b"):
        if result[key]:
            print(f"{key.replace('_', ' ')}: {len(result[key])} weights, e.g. {result[key][:3]}")
    for m in result["shape_mismatch"]:
        print(f"shape mismatch: {m['name']} {m['a']} vs {m['b']}")
    if below:
        print(f"{len(below)} weights below --min-sqnr {args.min_sqnr} dB")
    return EXIT_FAILED if failed else EXIT_OK


# ------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    from .convert import CLI_DEFAULT_INCLUDE, METHODS, TARGETS
    p = argparse.ArgumentParser(prog="musecore-quant", description="Inspect, convert, verify and diff "
                                "quantized safetensors checkpoints (NVFP4, MXFP4, INT4, FP8, BF16).")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("inspect", help="format, producer, per-layer formats, sizes, scale statistics")
    s.add_argument("checkpoint")
    s.add_argument("--json", action="store_true", help="print one JSON document")
    s.add_argument("--no-stats", action="store_true", help="skip reading scales for statistics")
    s.set_defaults(func=_cmd_inspect)
    s = sub.add_parser("convert", help="convert a checkpoint to another format (atomic, resumable)")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--to", required=True, choices=TARGETS)
    s.add_argument("--method", default="rtn", choices=METHODS,
                   help="rtn (round to nearest), autoround (INT4, tuned per routed expert) or gptq (INT4 or "
                        "MXFP4, Hessian error feedback); the last two need --calibration and musecore's calibrator "
                        "plugins")
    s.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                   help="calibration text for --method autoround/gptq: .txt, .jsonl ({'text': ...} per line) or .i16 "
                        "ids")
    s.add_argument("--include", action="append", metavar="REGEX",
                   help="weights to quantize, replacing the default rule; each pattern must match a weight "
                        "(default: the Muse rule for a Muse checkpoint, see --muse-rule; every routed expert "
                        "for other models, see --all-experts)")
    s.add_argument("--muse-rule", action="store_true",
                   help="quantize the routed experts of layers 1..L-2 only (L = num_hidden_layers of the source "
                        "config); layers 0 and L-1 keep BF16 experts. The default for a config.json whose "
                        "model_type is muse_spark")
    s.add_argument("--all-experts", action="store_true",
                   help=f"quantize every routed expert, fused or per-expert ('{CLI_DEFAULT_INCLUDE}'), the first "
                        "and last layer's too. The default for models other than Muse")
    s.add_argument("--fuse-experts", dest="fuse_experts", action="store_true", default=None,
                   help="with --to bf16: stack per-expert weights into fused experts.gate_up_proj/down_proj "
                        "(transformers 5 layout; default when the source already holds fused experts)")
    s.add_argument("--no-fuse-experts", dest="fuse_experts", action="store_false",
                   help="with --to bf16: keep per-expert weights as they are")
    s.add_argument("--exclude", action="append", metavar="REGEX", help="weights never quantized "
                   "(default: embeddings, lm_head, norms; giving --exclude replaces the defaults)")
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="quantizer option, e.g. rounding=away, group_size=128, block_size=128")
    s.add_argument("--max-shard-bytes", type=int, default=None, metavar="N",
                   help="start a new shard before one would exceed N bytes (N > 0; default 5 GB)")
    s.add_argument("--no-resume", action="store_true", help="discard a partial conversion and start over")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--top", type=int, default=10, help="worst tensors to list")
    s.add_argument("--json", action="store_true", help="print the conversion report as JSON")
    s.set_defaults(func=_cmd_convert)
    s = sub.add_parser("verify", help="sha256, headers, companions, shapes, NaN/Inf; exit 1 on failure")
    s.add_argument("checkpoint")
    s.add_argument("--json", action="store_true")
    s.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (otherwise a bar on a terminal, one line when done elsewhere)")
    s.set_defaults(func=_cmd_verify)
    s = sub.add_parser("diff", help="per-tensor error between two checkpoints of one model")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--min-sqnr", type=float, default=None, metavar="DB", help="fail below this SQNR")
    s.add_argument("--top", type=int, default=20)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_diff)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``musecore-quant`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    debug = os.environ.get("MUSECORE_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except (CheckpointError, NotImplementedError, OSError) as e:
        if debug:
            raise
        error = translate(e, getattr(e, "filename", None) or "musecore-quant", "the command") \
            if isinstance(e, OSError) else e
        _print_error(str(error))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _print_error("interrupted (a conversion resumes where it stopped when rerun with the same arguments)")
        return EXIT_INTERRUPTED
    except Exception as e:  # a bug, not bad input: still one line, with how to get the traceback
        if debug:
            raise
        _print_error(f"internal error ({type(e).__name__}: {e}); this is a bug in musecore-quant: rerun with "
                     "MUSECORE_DEBUG=1 for the traceback and report it")
        return EXIT_INTERNAL


def _print_error(message: str) -> None:
    """One line on stderr, whatever the message holds (lone surrogates from a hostile file are escaped)."""
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    line = " ".join(message.split()).encode(encoding, "backslashreplace").decode(encoding)
    print(f"musecore-quant: error: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
