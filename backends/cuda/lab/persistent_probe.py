"""Is a persistent decode kernel worth writing? A chain of dependent 16-bit GEMVs run two ways (issue 26, session 53).

muse-small's decode step is ~133 dependent kernels (16 layers of q/k/v/gate, attention, o_proj, router + pooler,
expert up and down, finalize, unpooler); at ~5 us each it runs near 26% of its bandwidth limit, and 50% needs the
step in ~370 us. Every kernel boundary costs a launch, the ramp of a new grid and the tail of the old one, which
programmatic dependent launch (PDL) only partly overlaps. A persistent kernel replaces the boundaries with grid-wide
barriers and can fetch the next phase's weights while it waits, since weights depend on no activation. Whether that
wins on the H200 is an open question: session 45's per-assignment hand-off and session 51's attention in the
q/k/v/gate launch, both intra-kernel dependencies, measured slower than kernel boundaries under PDL.

The probe answers it on the simplest chain that has the decode step's shape: ``P`` phases ``y[p + 1] = W[p] @ y[p]``
(``W [P, D, D]`` 16-bit, ``y [P + 1, D]``), each phase a GEMV whose input is the phase before's output:

* ``chain``: ``P`` launches of the backend's ``dense_gemv`` (its cut, its PDL hooks), in one CUDA graph, with PDL
  and without;
* ``persistent``: one launch of :func:`persistent_chain_kernel` whose programs take ``dense_gemv``'s row blocks
  (``dense_gemv.gemv_program``, the same cut and body) and meet at a grid-wide barrier between phases
  (:func:`barrier_arrive`, :func:`barrier_wait`); ``PREFETCH`` has each program fetch its next phase's weight rows
  into L2 between its arrival and its wait;
* ``hold``: :func:`persistent_hold_kernel`, one program per row block holding its next phase's rows in registers
  while it waits, as a persistent decode kernel would.

Same weights, same cut, same body: the difference is the kernel boundary against the barrier. The barrier spins at
most ``spin_limit`` times (65536 acquire reads by default: tens of milliseconds, against a phase's few microseconds),
then raises ``flag`` and goes on (a grid too large to be resident fails, it does not hang).
The timing script is ``scripts/cuda_persistent_probe.py``; the interpreter test ``tests/test_persistent_probe.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from musecore_triton import hooks
from musecore_triton.kernels.dense_gemv import gemv_blocks, gemv_program, last_ticket, NUM_WARPS

LINE = 64  # 16-bit elements per 128-byte line (one L2 prefetch each)


@triton.jit
def barrier_arrive(count_ptr):
    """This program's arrival at the barrier on ``count``: every thread's stores issued, then one release add (the
    program's stores before it). Returns the count it made. Loads issued after it (the next phase's weights) are not
    held back by its release, so they stream while the program waits (:func:`barrier_wait`)."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr, 1, sem="release") + 1


@triton.jit
def barrier_wait(count_ptr, seen, target, spin_limit, flag_ptr):
    """Acquire reads of ``count`` until ``target`` programs have arrived or ``spin_limit`` reads went by (then
    ``flag`` is set to 1 and the program goes on: the caller checks it)."""
    spins = tl.full((), 0, tl.int32)
    while (seen < target) & (spins < spin_limit):
        seen = tl.atomic_add(count_ptr, 0, sem="acquire")
        spins += 1
    if seen < target:
        tl.store(flag_ptr, 1)
    tl.debug_barrier()


@triton.jit
def grid_barrier(count_ptr, target, spin_limit, flag_ptr):
    """:func:`barrier_arrive`, then :func:`barrier_wait`."""
    barrier_wait(count_ptr, barrier_arrive(count_ptr), target, spin_limit, flag_ptr)


@triton.jit
def _prefetch_rows(w_ptr, pid, programs, nblocks, D, BLOCK_N: tl.constexpr, LINES: tl.constexpr, LINE: tl.constexpr):
    """Every line of this program's row blocks of the ``[D, D]`` weight at ``w_ptr``, into L2."""
    cols = tl.arange(0, LINES) * LINE
    for rb in range(pid, nblocks, programs):
        rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = w_ptr + rows[:, None].to(tl.int64) * D + cols[None, :]
        hooks.prefetch_l2(ptrs, (rows[:, None] < D) & (cols[None, :] < D))


@triton.jit
def persistent_chain_kernel(w_ptr, y_ptr, count_ptr, flag_ptr, D, P, spin_limit,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STATIC: tl.constexpr,
                            PREFETCH: tl.constexpr, LINES: tl.constexpr, LINE: tl.constexpr):
    """``P`` phases ``y[p + 1] = W[p] @ y[p]`` in one launch: program ``pid`` of ``programs`` computes row blocks
    ``pid, pid + programs, ..`` of each phase (``dense_gemv``'s ``BLOCK_N`` rows each), then waits at the barrier.
    ``count`` holds two int32: the barrier's arrivals (monotonic over the phases) and the exit tickets; the last
    program out resets both, so the next launch starts from zero."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    nblocks = tl.cdiv(D, BLOCK_N)
    row = D.to(tl.int64)
    for p in range(P):
        x = y_ptr + p * row
        w = w_ptr + p * row * D
        for rb in range(pid, nblocks, programs):
            gemv_program(rb, pid * 0, nblocks, x, w, w, count_ptr, x + row, D, D, D, 0, 1,
                         count_ptr, x, x, x, x, x, x, x, 0.0, 0.0, BLOCK_N, BLOCK_K, False, False, False, False,
                         False, 0, False, False, 1, False, K_STATIC)
        if p + 1 < P:
            seen = barrier_arrive(count_ptr)
            if PREFETCH:  # after the arrival: its release does not wait for them
                _prefetch_rows(w + row * D, pid, programs, nblocks, D, BLOCK_N, LINES, LINE)
            barrier_wait(count_ptr, seen, programs * (p + 1), spin_limit, flag_ptr)
    if last_ticket(count_ptr + 1, programs):
        tl.store(count_ptr, 0)


@triton.jit
def persistent_hold_kernel(w_ptr, y_ptr, count_ptr, flag_ptr, D, P, spin_limit,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The chain with each program's next-phase weights in registers before it waits: program ``pid`` owns row block
    ``pid`` of every phase (the grid is ``cdiv(D, BLOCK_N)`` programs, all resident), holds its ``[BLOCK_N, D]`` rows
    of the next phase (``BLOCK_K >= D``), arrives, loads them, waits, then reads only the phase's input. What a
    persistent decode kernel would do; its fp32 sums are grouped as one ``tl.sum`` per row (not ``gemv_program``'s
    chunks), so it matches the chain to rounding, not bit for bit."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    row = D.to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < D) & (cols[None, :] < D)
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    w_next = tl.load(w_ptr + offs, mask=mask, other=0.0)
    for p in range(P):
        w_cur = w_next
        # volatile: the phase's input was written by other programs after the barrier; a plain load may be served
        # from a line this SM cached in an earlier phase (rows of D 16-bit elements need not start on a line), or be
        # issued ahead of the wait
        x = tl.load(y_ptr + p * row + cols, mask=cols < D, other=0.0, volatile=True)
        acc = tl.sum(w_cur.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(y_ptr + (p + 1) * row + rows, acc.to(y_ptr.dtype.element_ty), mask=rows < D)
        if p + 1 < P:
            seen = barrier_arrive(count_ptr)
            w_next = tl.load(w_ptr + (p + 1) * row * D + offs, mask=mask, other=0.0)  # streams while it waits
            barrier_wait(count_ptr, seen, programs * (p + 1), spin_limit, flag_ptr)
    if last_ticket(count_ptr + 1, programs):
        tl.store(count_ptr, 0)


def chain_inputs(P: int, D: int, dtype: torch.dtype, device: torch.device, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W [P, D, D], y [P + 1, D])``: weights scaled so each phase keeps its input's norm, ``y[0]`` the input."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(P, D, D, generator=g) / D ** 0.5).to(dtype).to(device)
    y = torch.zeros(P + 1, D, dtype=dtype, device=device)
    y[0] = torch.randn(D, generator=g).to(dtype)
    return w, y


def reference_chain(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The chain in fp32 with each phase's output rounded to the weights' dtype, as the kernels store it."""
    y = x.float()
    for p in range(w.shape[0]):
        y = (w[p].float() @ y).to(w.dtype).float()
    return y


def persistent_chain(w: torch.Tensor, y: torch.Tensor, counters: torch.Tensor, flag: torch.Tensor, programs: int,
                     prefetch: bool = False, spin_limit: int = 1 << 16,
                     blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Run :func:`persistent_chain_kernel` on ``programs`` programs (every one of them must be resident at once on
    a GPU; one in the interpreter) with ``dense_gemv``'s cut, or ``blocks = (BLOCK_N, BLOCK_K, K_STATIC)`` as
    ``dense_gemv(blocks=)`` takes it. ``counters``: two int32 zeros (left zero); ``flag``: one int32, set to 1 when
    a barrier gave up. Returns ``y[P]``."""
    launch(w, y, counters, flag, programs, prefetch, spin_limit, blocks)
    return y[w.shape[0]]


def launch(w: torch.Tensor, y: torch.Tensor, counters: torch.Tensor, flag: torch.Tensor, programs: int,
           prefetch: bool = False, spin_limit: int = 1 << 16, blocks: tuple[int, int, int] | None = None):
    """:func:`persistent_chain`'s launch; returns what Triton's launch returns (on a GPU the compiled kernel, whose
    ``n_regs`` and ``metadata`` say how many programs can be resident)."""
    P, D, _ = w.shape
    block_n, block_k, k_static = blocks or gemv_blocks(D)
    return persistent_chain_kernel[(programs,)](
        w, y, counters, flag, D, P, spin_limit, BLOCK_N=block_n, BLOCK_K=block_k, K_STATIC=k_static,
        PREFETCH=prefetch and hooks.l2_warm(w.device), LINES=triton.next_power_of_2(triton.cdiv(D, LINE)), LINE=LINE,
        num_warps=NUM_WARPS)


def persistent_hold(w: torch.Tensor, y: torch.Tensor, counters: torch.Tensor, flag: torch.Tensor, block_n: int,
                    num_warps: int = NUM_WARPS, spin_limit: int = 1 << 16, programs: int | None = None):
    """Run :func:`persistent_hold_kernel` (``cdiv(D, block_n)`` programs, which must all be resident on a GPU; one
    in the interpreter, where ``D <= block_n``). ``programs=1`` runs the first row block only, which is always
    resident: a compile, whose kernel says how many programs fit. Returns what Triton's launch returns (the compiled
    kernel on a GPU)."""
    P, D, _ = w.shape
    return persistent_hold_kernel[(programs or triton.cdiv(D, block_n),)](
        w, y, counters, flag, D, P, spin_limit, BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(D),
        num_warps=num_warps)


def row_blocks(D: int, blocks: tuple[int, int, int] | None = None) -> int:
    """How many programs ``dense_gemv`` launches for a ``[D, D]`` weight (one row block each) with its cut or
    ``blocks``."""
    return triton.cdiv(D, (blocks or gemv_blocks(D))[0])
