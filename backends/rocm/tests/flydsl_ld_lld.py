"""An ``ld.lld`` for FlyDSL's compile-only mode built on the LLD that Triton's AMD backend embeds.

FlyDSL's ROCDL serialisation runs ``$ROCM_PATH/llvm/bin/ld.lld -shared kernel.o -o kernel.hsaco``.
Debian 12's ``lld`` (14) rejects the code object FlyDSL 0.5 emits ("unknown abi version"), and no
ROCm is installed on CI machines, so the test points ``ROCM_PATH`` at a folder whose ``ld.lld``
runs this file, which links with ``triton._C.libtriton.amd.link_hsaco`` (Triton's own LLD). Not
used on a ROCm host, where ``/opt/rocm/llvm/bin/ld.lld`` exists.
"""

import sys

from triton._C.libtriton import amd


def main(args: list[str]) -> None:
    out = args[args.index("-o") + 1]
    objects = [a for a in args if a.endswith(".o")]
    if len(objects) != 1:
        raise SystemExit(f"flydsl_ld_lld links one object into a code object; got {args}")
    amd.link_hsaco(objects[0], out)


if __name__ == "__main__":
    main(sys.argv[1:])
