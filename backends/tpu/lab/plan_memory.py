"""What the 816B model needs on the TPU profiles, current catalog vs the one INTEGRATION.md proposes.

Run from the repository root: ``python backends/tpu/lab/plan_memory.py``. The proposed profiles are patched into
the catalog in this process only (musecore/devices.py is not this package's file)."""

from __future__ import annotations

import dataclasses

import musecore.devices as devices
from musecore.api import preset_summary
from musecore.config import MuseConfig
from musecore.planning import make_plan

W4A16 = devices._rules(
    bf16=("bf16", None), fp8=("bf16", None, "no FP8 weight kernel yet: dequantized to BF16"),
    nvfp4=("nvfp4", None, "W4A16: NVFP4 codes and E4M3 scales kept packed, decoded in VMEM (Pallas)"),
    mxfp4=("mxfp4", None, "W4A16: MXFP4 codes and E8M0 scales kept packed, decoded in VMEM (Pallas)"),
    int4=("int4", None, "W4A16: INT4 codes kept packed, f32 group scales, decoded in VMEM (Pallas)"))


def main() -> None:
    config = MuseConfig.from_name("muse-spark-open-816b-a42b")
    for label in ("current", "proposed"):
        for name in ("tpu-v6e", "tpu-v7"):
            if label == "proposed":
                devices.CATALOG[name] = dataclasses.replace(devices.CATALOG[name], conversions=W4A16,
                                                            weight_formats=("bf16", "int4", "mxfp4", "nvfp4"),
                                                            activation_formats=())
            for fmt in ("bf16", "nvfp4", "mxfp4", "int4"):
                plan = make_plan(preset_summary("816b", config, fmt), name, emulate=True)
                weights = sum(g.bytes for g in plan.groups)
                print(f"{label:8s} {name:8s} {fmt:5s} checkpoint: weights {weights / 1e9:6.1f} GB, with KV "
                      f"{plan.memory_bytes / 1e9:6.1f} GB -> {plan.devices_needed} chips")


if __name__ == "__main__":
    main()
