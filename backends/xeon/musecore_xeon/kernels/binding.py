"""The bound GEMVs (INT4 and BF16 weights), the decode-size norms, the router selection and the decode attention
called from Python without ctypes: a small CPython extension (``musecore_xeon/csrc/binding.cpp``, C++ with PyTorch's
headers) that takes ``x``, allocates ``y`` with ``at::empty`` and calls the C kernel (``musecore_int4_linear`` /
``musecore_bf16_linear``, ...) by its address. The GEMVs go through one shared C++ call (``call_linear``: checks,
``at::empty``, the kernel without the GIL); they differ only in the weight struct.

Why: at decode sizes the call around the kernel cost as much as the kernel: ctypes' argument conversion, a
``torch.empty`` from Python and the Python checks took about as long as a small weight's GEMV. One METH_FASTCALL
function (unpack the tensor, check it, ``at::empty``, release the GIL, call) roughly halves such a call.

Build: the C++ compiler (``$CXX``, ``c++`` or ``g++``) with PyTorch's and Python's headers, linked against
``libtorch_python`` (~17 s, once; the shared object is kept in the per-user compile cache beside the C kernels,
keyed by the source, the compiler, the flags and the PyTorch and Python versions). When it cannot be built (no
C++ compiler, no ``Python.h``, headers missing from the PyTorch install) a RuntimeWarning gives the reason and the
GEMVs are called through ctypes (same results, a few us more per call); ``MUSECORE_XEON_BINDING=0`` chooses ctypes
explicitly.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from musecore_xeon.kernels.compile import compile_cached

BINDING_ENV = "MUSECORE_XEON_BINDING"
MODULE_NAME = "musecore_xeon_binding"

SOURCE = "binding.cpp"  # in musecore_xeon/csrc


UNAVAILABLE: list[str] = []  # why the GEMVs are called through ctypes, once known


def disabled() -> bool:
    return os.environ.get(BINDING_ENV, "").strip().lower() in ("0", "off", "no", "false", "ctypes")


def cxx_compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def compile_flags() -> list[str]:
    """The flags before the source file (language, ABI, include directories)."""
    include = Path(torch.__file__).parent / "include"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-O2", "-std=c++20", "-fPIC", "-shared", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-I{sysconfig.get_paths()['include']}"]


def link_flags() -> list[str]:
    """The flags after the source file (PyTorch's libraries, found at run time through the rpath)."""
    lib = Path(torch.__file__).parent / "lib"
    return [f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib}"]


def build_command(cxx: str, source: Path, target: Path) -> list[str]:
    return [cxx, *compile_flags(), "-o", str(target), str(source), *link_flags()]


def build() -> Optional[Path]:
    """The extension's shared object (in the per-user compile cache), or None without a C++ compiler or
    ``Python.h``. Raises ``CacheError`` for a cache directory that is not private, ``OSError`` / ``SubprocessError``
    when the build fails."""
    cxx = cxx_compiler()
    if cxx is None:
        return None
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return None
    return compile_cached("binding", (SOURCE,), SOURCE, cxx, [*compile_flags(), *link_flags()],
                          lambda src, obj: build_command(cxx, src, obj), torch.__version__, sys.version)


def _unavailable(reason: str) -> None:
    UNAVAILABLE.append(reason)
    warnings.warn(f"musecore-xeon: {reason}; the INT4 and BF16 GEMVs are called through ctypes (same results, ~7 us more per "
                  f"call). Set {BINDING_ENV}=0 to choose that explicitly.", RuntimeWarning, stacklevel=3)


# MKL VML's mode as PyTorch's vml.h passes it (VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE)
VML_TORCH_MODE = 0x2 | 0x140000 | 0x100


def tanh_probe() -> torch.Tensor:
    """fp32 inputs on which PyTorch's tanh and the kernel found by :func:`torch_tanh_kernel` must agree bit for bit:
    random values over several scales (an odd count, so VML's tail path runs too), signed zeros, subnormals, values
    where tanh saturates, the infinities and NaN."""
    gen = torch.Generator().manual_seed(0)
    random = torch.cat([torch.randn(4097, generator=gen) * s for s in (1e-3, 0.5, 2.0, 8.0, 40.0)])
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-30, 9.0, -9.0, 10.0, 88.0, -88.0, 1e30,
                            float("inf"), float("-inf"), float("nan")])
    return torch.cat([random, special])


@functools.cache
def torch_tanh_kernel() -> tuple[int, int]:
    """``(address, mode)`` of the kernel ``torch.tanh`` runs on fp32 CPU tensors in this PyTorch (MKL VML's
    ``vmsTanh`` through its Fortran entry ``VMSTANH_``, exported by ``libtorch_cpu``), or ``(0, 0)`` when there is none
    or it does not give torch.tanh's bits on :func:`tanh_probe` (a build without MKL, or one that computes tanh
    another way): the xeon softcap then runs PyTorch's ops."""
    import ctypes
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        fn = lib.VMSTANH_
    except (OSError, AttributeError):
        return 0, 0
    x = tanh_probe()
    y = torch.empty_like(x)
    fn.argtypes = [ctypes.c_void_p] * 4
    fn.restype = None
    n, mode = ctypes.c_int(x.numel()), ctypes.c_int64(VML_TORCH_MODE)
    fn(ctypes.addressof(n), x.data_ptr(), y.data_ptr(), ctypes.addressof(mode))
    if not torch.equal(torch.tanh(x).view(torch.int32), y.view(torch.int32)):
        return 0, 0
    return ctypes.cast(fn, ctypes.c_void_p).value, VML_TORCH_MODE


@functools.cache
def load(int4_address: int, bf16_address: int) -> Optional[ModuleType]:
    """The extension calling the C kernels at ``int4_address`` (``musecore_int4_linear``) and ``bf16_address``
    (``musecore_bf16_linear``), or None (disabled, no compiler or headers, or the build failed: announced once).
    Called by :func:`musecore_xeon.kernels.native.linear_binding` (one pair of kernels per process: the addresses
    are globals of the extension).

    Example::

        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value
        fast = load(address(lib.musecore_int4_linear), address(lib.musecore_bf16_linear))
        y = fast.int4_linear(ctypes.addressof(weight_args), x_bf16)
    """
    if disabled():
        UNAVAILABLE.append(f"disabled by {BINDING_ENV}")
        return None
    try:
        target = build()
        if target is None:
            _unavailable("no C++ compiler or no Python.h to build the GEMV binding")
            return None
        spec = importlib.util.spec_from_file_location(MODULE_NAME, target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        _unavailable(f"building/loading the GEMV binding failed ({type(err).__name__}: {err} "
                     f"{detail.decode(errors='replace')[-500:]})")
        return None
    module.set_kernels(int4_address, bf16_address)
    return module
