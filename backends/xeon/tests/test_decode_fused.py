"""The decode-size router (logits and selection in one C call), the native softcap (PyTorch's own tanh kernel, the
reference's bits) and the decode attention in every ISA build, against the reference."""

from __future__ import annotations

import ctypes

import pytest
import torch

from musecore.ops import reference as ref
from musecore.ops import tolerance
from musecore.testing import assert_nmse

DTYPES = [torch.bfloat16, torch.float32]
vp, i, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def fast_ops():
    from musecore_xeon import ops as xops
    from musecore_xeon.kernels import native
    fast = xops.fast_ops()
    if fast is None:
        pytest.skip(f"no extension here: {native.binding.UNAVAILABLE or native.UNAVAILABLE}")
    return fast


def router_case(T: int, H: int, E: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(T * 1000 + H + E)
    x = torch.randn(T, H, generator=gen).to(dtype)
    weight = torch.randn(E, H, generator=gen) * H ** -0.5 * 4  # fp32, as the checkpoint stores it
    return x, weight, torch.randn(E, generator=gen) * 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,E,k", [(1, 1536, 64, 8), (8, 1536, 64, 8), (3, 100, 7, 3), (2, 37, 12, 12)])
def test_fused_router_matches_reference_with_the_same_bits_at_every_thread_count(dtype, T: int, H: int, E: int,
                                                                                 k: int) -> None:
    """muse-small's router (H 1536, 64 experts, top 8) and odd widths (the scalar tails, a last block of fewer than 4
    experts): the ids equal the reference's, the weights within router_topk's NMSE tolerance, and the same bits at
    1, 2 and 3 threads."""
    fast = fast_ops()
    x, weight, bias = router_case(T, H, E, dtype)
    for multiplier, scaling in ((0.1767766952966369, 1.0), (1.0, 2.5)):
        w0, i0 = ref.router_topk(x, weight, bias, k, multiplier, scaling)
        outs = [fast.router(x, weight, bias, k, multiplier, scaling, threads) for threads in (1, 2, 3)]
        w1, i1 = outs[0]
        assert torch.equal(i0, i1), f"T={T} E={E} k={k} {dtype}: ids {i1.tolist()} != {i0.tolist()}"
        assert w1.dtype == torch.float32 and w1.shape == (T, k) and i1.dtype == torch.int64
        assert_nmse(w0, w1, tolerance("router_topk"), f"fused router T={T} H={H} E={E} k={k} {dtype}")
        for threads, (w, ids) in zip((2, 3), outs[1:]):
            assert torch.equal(ids, i1) and torch.equal(w, w1), f"{threads} threads differ from 1 ({dtype}, T={T})"
    w0, i0 = ref.router_topk(x, weight, torch.zeros(E), k, 0.5, 1.0)
    w1, i1 = fast.router(x, weight, None, k, 0.5, 1.0, 1)  # no correction bias
    assert torch.equal(i0, i1)
    assert_nmse(w0, w1, tolerance("router_topk"), "fused router without a bias")


def test_fused_router_takes_decode_sizes_only() -> None:
    """More tokens than NATIVE_ATTENTION_MAX_QUERIES (prefill: PyTorch's GEMM), a non-fp32 weight or bias, mismatched
    widths, k outside 1..E: None, and the op takes the matmul path."""
    from musecore_xeon import ops as xops
    fast = fast_ops()
    x, weight, bias = router_case(1, 64, 16, torch.bfloat16)
    many = torch.randn(xops.NATIVE_ATTENTION_MAX_QUERIES + 1, 64, dtype=torch.bfloat16)
    assert fast.router(many, weight, bias, 4, 1.0, 1.0, 1) is None
    assert fast.router(x, weight.bfloat16(), bias, 4, 1.0, 1.0, 1) is None
    assert fast.router(x, weight, bias.bfloat16(), 4, 1.0, 1.0, 1) is None
    assert fast.router(x, weight[:, :32].contiguous(), bias, 4, 1.0, 1.0, 1) is None
    assert fast.router(x, weight, bias[:8], 4, 1.0, 1.0, 1) is None
    assert fast.router(x, weight, bias, 17, 1.0, 1.0, 1) is None
    assert fast.router(x, weight, bias, 0, 1.0, 1.0, 1) is None
    assert fast.router(x.T.contiguous().T, weight, bias, 4, 1.0, 1.0, 1) is not None  # [1, 64]: contiguous
    w0, i0 = ref.router_topk(many, weight, bias, 4, 0.5, 1.0)
    w1, i1 = xops.router_topk(many, weight, bias, 4, 0.5, 1.0)  # the matmul path: the reference's bits
    assert torch.equal(i0, i1) and torch.equal(w0, w1)


def special_logits(n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * 40
    x[:8] = torch.tensor([0.0, -0.0, 1e-40, -3e-39, float("inf"), float("-inf"), float("nan"), 3e38])[: min(8, n)]
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [65536, 4096, 4097, 8191, 13, 1, 100003])
def test_native_softcap_gives_the_reference_bits_at_every_thread_count(dtype, n: int) -> None:
    """Whole, partial and single chunks of the C loop, zeros, subnormals, infinities and NaN: the same bits as
    ``cap * tanh(fp32(x) * multiplier / cap)`` of the reference at 1, 2 and 3 threads (greedy decode must not move)."""
    from musecore_xeon.kernels.binding import torch_tanh_kernel
    fast = fast_ops()
    if torch_tanh_kernel() == (0, 0):
        pytest.skip("this PyTorch's tanh is not MKL VML's vmsTanh (or it gives other bits): the softcap runs PyTorch")
    logits = special_logits(n, dtype).view(1, 1, n)
    want = ref.logit_softcap(logits, 0.2041241452319315, 30.0).view(torch.int32)
    for threads in (1, 2, 3):
        got = fast.logit_softcap(logits, 0.2041241452319315, 30.0, threads)
        assert got is not None and got.dtype == torch.float32 and got.shape == logits.shape
        differ = (got.view(torch.int32) != want).sum().item()
        assert differ == 0, f"{differ} of {n} softcapped logits differ from the reference's bits ({dtype}, {threads} threads)"
    assert fast.logit_softcap(logits.half(), 0.2, 30.0, 1) is None
    assert fast.logit_softcap(torch.randn(4, 3).T, 0.2, 30.0, 1) is None  # not contiguous


def test_the_tanh_kernel_is_checked_against_torch_tanh(monkeypatch) -> None:
    """torch_tanh_kernel passes a kernel only when it reproduces torch.tanh on the probe bit for bit: the kernel it
    returns does, and when torch.tanh's bits differ in one ulp of one probe value the check refuses it. (On Intel
    CPUs VML's LA accuracy mode also gives other bits on the probe; on the AMD EPYC CI machine every mode gives the
    same bits, so the refusal is shown with a perturbed torch.tanh.)"""
    from musecore_xeon.kernels import binding
    address, mode = binding.torch_tanh_kernel()
    if address == 0:
        pytest.skip("no MKL VML tanh in this PyTorch: the softcap runs PyTorch's ops")
    fn = ctypes.CFUNCTYPE(None, vp, vp, vp, vp)(address)
    x = binding.tanh_probe()
    y = torch.empty_like(x)
    n, m = ctypes.c_int(x.numel()), ctypes.c_int64(mode)
    fn(ctypes.addressof(n), x.data_ptr(), y.data_ptr(), ctypes.addressof(m))
    assert torch.equal(y.view(torch.int32), torch.tanh(x).view(torch.int32))
    real = torch.tanh

    def one_ulp_off(t: torch.Tensor) -> torch.Tensor:
        out = real(t)
        bits = out.view(torch.int32).clone()
        bits[len(bits) // 2] += 1
        return bits.view(torch.float32)

    monkeypatch.setattr(torch, "tanh", one_ulp_off)
    assert binding.torch_tanh_kernel.__wrapped__() == (0, 0)  # (uncached: the cached call saw the real bits)


@pytest.mark.parametrize("cap", ["portable", "avx2", "avx512_vnni"])
def test_every_isa_build_of_the_attention_and_router_kernels_matches_reference(cap: str) -> None:
    """The scalar (portable), AVX2 and AVX-512 paths of the decode attention (d = 64, 128 and 40: the 64-column,
    32-column and scalar blocks) and of the fused router, against the reference."""
    from musecore_xeon.kernels import native
    from musecore_xeon.cpu import read_cpu_info
    info = read_cpu_info()
    if cap == "avx2" and not info.has("avx2"):
        pytest.skip("no AVX2 here")
    if cap == "avx512_vnni" and not all(info.has(f) for f in native.AVX512_VNNI_FLAGS):
        pytest.skip("no AVX-512 VNNI here")
    lib = native.load_variant(cap)
    if lib is None:
        pytest.skip(f"no C compiler here: {native.UNAVAILABLE}")
    lib.musecore_router.argtypes = [vp, i, vp, vp] + [i64] * 4 + [f32, f32, vp, vp, i]
    lib.musecore_router.restype = ctypes.c_int
    gen = torch.Generator().manual_seed(5)
    for d in (64, 128, 40):
        B, S, nq, nkv = 2, 37, 8, 2
        q = torch.randn(B, 1, nq, d, generator=gen).bfloat16()
        k, v = (torch.randn(B, S, nkv, d, generator=gen).bfloat16() for _ in range(2))
        k_pos = torch.arange(S)[None].repeat(B, 1)
        k_pos[1, 20:] = -1
        q_pos = torch.tensor([[36], [19]])
        out = torch.empty_like(q)
        lib.musecore_attention(q.data_ptr(), 1, k.data_ptr(), v.data_ptr(), 1, q_pos.data_ptr(), k_pos.data_ptr(), 16,
                               d ** -0.5, out.data_ptr(), B, 1, S, nq, nkv, d, 2)
        assert_nmse(ref.attention(q, k, v, q_pos, k_pos, 16, d ** -0.5), out, tolerance("attention"),
                    f"{cap} attention d={d}")
    x, weight, bias = router_case(3, 1536, 64, torch.bfloat16)
    weights, ids = torch.empty(3, 8), torch.empty(3, 8, dtype=torch.int64)
    assert lib.musecore_router(x.data_ptr(), 1, weight.data_ptr(), bias.data_ptr(), 3, 64, 1536, 8, 0.5, 2.0,
                               weights.data_ptr(), ids.data_ptr(), 2) == 0
    w0, i0 = ref.router_topk(x, weight, bias, 8, 0.5, 2.0)
    assert torch.equal(i0, ids), f"{cap} router ids {ids.tolist()} != {i0.tolist()}"
    assert_nmse(w0, weights, tolerance("router_topk"), f"{cap} router")


@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_kv_write_row_writes_what_the_narrow_copies_write(kv_format: str) -> None:
    """A KV cache with the xeon backend's row writer holds the same entries as one without it after decode steps on
    ring (sliding) and full layers, a batch in step, a batch at different positions (the per-row path) and padding;
    what the writer cannot take returns False."""
    from musecore.config import MuseConfig
    from musecore.kv_cache import KVCache
    from musecore_xeon import ops as xops
    fast_ops()
    config = MuseConfig.from_name("muse-tiny")
    config.sliding_window = 4
    gen = torch.Generator().manual_seed(0)
    taken = []

    def writer(*args):
        taken.append(xops.kv_write_row(*args))
        return taken[-1]

    caches = [KVCache(config, 2, 12, kv_format=kv_format, row_writer=w) for w in (None, writer)]
    nkv, d = config.num_key_value_heads, config.head_dim
    steps = [[3, 3], [4, 4], [5, -1], [6, 2], [7, 7], [8, 8]]
    for positions in steps:
        pos = torch.tensor(positions)[:, None]
        k, v = (torch.randn(2, 1, nkv, d, generator=gen).bfloat16() for _ in range(2))
        for cache in caches:
            for layer in cache.layers:
                kk, vv = layer.encode(k, v)
                layer.update(kk, vv, pos)
    assert taken and all(taken), "the row writer did not take the steps where every row is at one position"
    for i, (a, b) in enumerate(zip(*(c.layers for c in caches))):
        assert a.used == b.used, f"layer {i}"
        for name in ("k", "v", "positions"):
            x, y = getattr(a, name), getattr(b, name)
            same = torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.dtype == torch.float8_e4m3fn else torch.equal(x, y)
            assert same, f"layer {i} ({'ring' if a.ring else 'full'}) {name} differs with the row writer"
    layer = caches[1].layers[0]
    k = torch.randn(2, 1, nkv, d).to(layer.k.dtype)
    assert not xops.kv_write_row(layer.k, layer.v, layer.positions, k.float(), k.float(), 0, 0) or layer.k.dtype == torch.float32
    assert not xops.kv_write_row(layer.k, layer.v, layer.positions, k, k, layer.k.shape[1], 0)  # slot out of range
    assert not xops.kv_write_row(layer.k, layer.v, layer.positions.int(), k, k, 0, 0)
    assert not xops.kv_write_row(layer.k, layer.v, layer.positions, k[:1], k[:1], 0, 0)  # batch mismatch
