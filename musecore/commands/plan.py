"""``musecore plan``: what would run where and why, for any catalog device, without hardware."""

from __future__ import annotations

from musecore.cli import UsageError
from musecore.commands import add_mesh, add_quantize_dense


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="show the plan (conversions, op implementations, memory, mesh) for a model "
                                    "on a device")
    p.add_argument("--model", default="muse-tiny", help="checkpoint folder or preset name (default: muse-tiny)")
    p.add_argument("--device", default="auto", help="catalog device (musecore devices), 'auto' or a torch device")
    p.add_argument("--emulate", action="store_true", help="plan the device's numerics on local reference kernels")
    p.add_argument("--allow-emulation", action="store_true", help="accept a backend's emulated ops")
    add_quantize_dense(p)
    p.add_argument("--allow-reference", action="store_true", help="accept the plain PyTorch reference for missing ops")
    p.add_argument("--kv-format", default="bf16", choices=("bf16", "fp8"))
    p.add_argument("--checkpoint-format", default="bf16", choices=("bf16", "fp8", "nvfp4", "mxfp4", "int4"),
                   help="for a preset name without weights: the format of its quantized experts")
    add_mesh(p)  # the plan shows each rank's memory and traffic; without them it proposes a mesh if needed
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    import musecore.api as api

    try:
        the_plan = api.plan(args.model, args.device, emulate=args.emulate, allow_emulation=args.allow_emulation,
                            allow_reference=args.allow_reference, kv_format=args.kv_format,
                            checkpoint_format=args.checkpoint_format, quantize_dense=args.quantize_dense,
                            tp=args.tp, ep=args.ep, sp=args.sp)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    print(the_plan.to_json() if args.json else the_plan)
    return 1 if the_plan.gaps else 0
