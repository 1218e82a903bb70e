"""The dependency edges of a captured CUDA graph, read through the driver API (issue 26, session 52).

Session 52 (run 68) found programmatic dependent launch (PDL) worth 85 us per muse-small token in a process's first
greedy graph and 50 in every later one, with the same nodes, kernels and launch shapes (torch's DOT dump, run 64: it
does not print an edge's type). Here each edge's type and ports (``cuGraphGetEdges_v2``, CUDA 12.3+): a kernel
launched with the PDL attribute under stream capture hangs on the kernel before it by a *programmatic* edge (type 1,
from port 1 or 2); a default edge (type 0) makes it wait for the whole kernel before. If later captures have fewer
programmatic edges, the driver turned some launches back into plain ones; if they have the same, the difference is at
run time.

The graph must be kept after capture: ``torch.cuda.CUDAGraph(keep_graph=True)`` (``cuda_capture_probe.DebugGraph``);
``raw_cuda_graph()`` is then its ``cudaGraph_t``.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from typing import Any


class EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def _libcuda() -> Any:
    import torch
    return torch.cuda._utils._get_gpu_runtime_library()


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with CUresult {status}")


def node_name(cuda: Any, node: int) -> str:
    """A kernel node's function name, else its node type (``memcpy`` and the like)."""
    kind = ctypes.c_int()
    _check(cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
    if kind.value != 0:  # CU_GRAPH_NODE_TYPE_KERNEL
        return {1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty"}.get(kind.value, f"node type {kind.value}")
    params = KernelNodeParams()
    _check(cuda.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params)),
           "cuGraphKernelNodeGetParams_v2")
    name = ctypes.c_char_p()
    if params.func and cuda.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)) == 0 and name.value:
        return name.value.decode(errors="replace")
    if params.kern and cuda.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern)) == 0 and name.value:
        return name.value.decode(errors="replace")
    return "kernel"


def edges(graph: Any) -> list[dict]:
    """Every edge of ``graph`` (a ``torch.cuda.CUDAGraph`` kept after capture): ``{"from", "to"}`` (the nodes' names),
    ``type`` (0 default, 1 programmatic), ``from_port`` (0 default, 1 programmatic, 2 launch order), ``to_port``; in
    the graph's order from its root when it is a chain (a decode step is), else as the driver lists them."""
    cuda = _libcuda()
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    _check(cuda.cuGraphGetEdges_v2(handle, None, None, None, ctypes.byref(count)), "cuGraphGetEdges_v2 (count)")
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (EdgeData * n)()
    _check(cuda.cuGraphGetEdges_v2(handle, src, dst, data, ctypes.byref(count)), "cuGraphGetEdges_v2")
    names: dict = {}

    def name(node: int) -> str:
        if node not in names:
            names[node] = node_name(cuda, node)
        return names[node]
    out = {src[i]: (dst[i], data[i]) for i in range(n)}
    rows = []
    starts = set(out) - {dst[i] for i in range(n)}
    if len(out) == n and len(starts) == 1:  # a chain: walk it from its root
        node = starts.pop()
        while node in out:
            nxt, d = out[node]
            rows.append((node, nxt, d))
            node = nxt
    else:
        rows = [(src[i], dst[i], data[i]) for i in range(n)]
    return [{"from": name(a)[:60], "to": name(b)[:60], "type": d.type, "from_port": d.from_port,
             "to_port": d.to_port} for a, b, d in rows]


def summary(rows: list[dict]) -> dict:
    """How many edges of each (type, from port, to port)."""
    return {f"type{t}/from{f}/to{p}": c for (t, f, p), c in
            sorted(Counter((r["type"], r["from_port"], r["to_port"]) for r in rows).items())}


def differences(first: list[dict], other: list[dict]) -> list[str]:
    """The edges (by position) whose type or ports differ between two graphs."""
    if [(r["from"], r["to"]) for r in first] != [(r["from"], r["to"]) for r in other]:
        return [f"the graphs' nodes differ ({len(first)} against {len(other)} edges)"]
    return [f"{i}: {a['from']} -> {a['to']}: type {a['type']}/{b['type']}, from port {a['from_port']}/{b['from_port']}"
            for i, (a, b) in enumerate(zip(first, other))
            if (a["type"], a["from_port"], a["to_port"]) != (b["type"], b["from_port"], b["to_port"])]


def describe(graph: Any) -> tuple[list[dict], str]:
    """``(edges, one line)``: the edges, or none and the reason they could not be read (never raises: a probe keeps
    going without them)."""
    try:
        rows = edges(graph)
    except Exception as e:  # noqa: BLE001  (an older driver, a graph not kept)
        return [], f"edges not read: {type(e).__name__}: {e}"
    return rows, f"{len(rows)} edges: {summary(rows)}"
