"""The dependency edges of a captured CUDA graph, read through the driver API (issue 26, session 52).

Session 52 (run 68) found programmatic dependent launch (PDL) worth 85 us per muse-small token in a process's first
greedy graph and 50 in every later one, with the same nodes, kernels and launch shapes (torch's DOT dump, run 64: it
does not print an edge's type). Here each edge's type and ports (``cuGraphGetEdges_v2``, CUDA 12.3+): a kernel
launched with the PDL attribute under stream capture hangs on the kernel before it by a *programmatic* edge (type 1,
from port 1 or 2); a default edge (type 0) makes it wait for the whole kernel before. If later captures have fewer
programmatic edges, the driver turned some launches back into plain ones; if they have the same, the difference is at
run time.

Session 53 adds each kernel node's launch attributes and its function's attributes (:func:`node_attributes`), which
neither the DOT (it prints the access policy window, cooperative and priority only) nor the edges show: the memory
synchronization domain and its map, cluster shape and scheduling preference, the shared-memory carveout, registers.

:class:`Exec` instantiates a kept graph again through the driver and launches that executable instead of torch's:
is a later capture's loss in what was captured, or in when it was instantiated (``cuda_capture_probe.py
--reinstantiate``)?

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


# CUlaunchAttributeID values a kernel node takes (cuGraphKernelNodeGetAttribute); the programmatic ones are edges.
NODE_ATTRIBUTES = {1: "access_policy_window", 2: "cooperative", 4: "cluster_dimension",
                   5: "cluster_scheduling_policy", 8: "priority", 9: "mem_sync_domain_map", 10: "mem_sync_domain",
                   11: "preferred_cluster_dimension", 13: "device_updatable", 14: "preferred_shared_memory_carveout"}
# CUfunction_attribute values (cuFuncGetAttribute) of the node's function.
FUNC_ATTRIBUTES = {1: "shared_size_bytes", 3: "local_size_bytes", 4: "num_regs", 8: "max_dynamic_shared_size_bytes",
                   9: "preferred_shared_memory_carveout", 11: "required_cluster_width",
                   14: "non_portable_cluster_size_allowed", 15: "cluster_scheduling_policy_preference"}


class AttrValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes
    _fields_ = [("words", ctypes.c_uint * 16)]


def _chain(cuda: Any, handle: Any) -> tuple[list, list]:
    """``(nodes, edges)``: the graph's nodes from its root when it is a chain (a decode step is), else as the driver
    lists them; ``edges`` as ``(from, to, EdgeData)`` in the same order."""
    count = ctypes.c_size_t(0)
    _check(cuda.cuGraphGetEdges_v2(handle, None, None, None, ctypes.byref(count)), "cuGraphGetEdges_v2 (count)")
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (EdgeData * n)()
    _check(cuda.cuGraphGetEdges_v2(handle, src, dst, data, ctypes.byref(count)), "cuGraphGetEdges_v2")
    out = {src[i]: (dst[i], data[i]) for i in range(n)}
    starts = set(out) - {dst[i] for i in range(n)}
    if len(out) == n and len(starts) == 1:  # a chain: walk it from its root
        node, rows = starts.pop(), []
        while node in out:
            nxt, d = out[node]
            rows.append((node, nxt, d))
            node = nxt
        return [r[0] for r in rows] + ([rows[-1][1]] if rows else []), rows
    rows = [(src[i], dst[i], data[i]) for i in range(n)]
    nodes = list(dict.fromkeys([a for a, _, _ in rows] + [b for _, b, _ in rows]))
    return nodes, rows


def node_attributes(graph: Any) -> list[dict]:
    """Each node of ``graph`` (kept after capture), in :func:`edges`' order: ``name``, and for a kernel node ``attrs``
    (each of :data:`NODE_ATTRIBUTES` as the value's first four 32-bit words, or ``"error N"`` where the driver
    refuses the query) and ``func`` (each of :data:`FUNC_ATTRIBUTES` of its function, where it has a handle)."""
    cuda = _libcuda()
    nodes, _ = _chain(cuda, ctypes.c_void_p(graph.raw_cuda_graph()))
    rows = []
    for node in nodes:
        row = {"name": node_name(cuda, node)[:60]}
        kind = ctypes.c_int()
        _check(cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == 0:
            attrs = {}
            for attr, label in NODE_ATTRIBUTES.items():
                value = AttrValue()
                status = cuda.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), attr, ctypes.byref(value))
                attrs[label] = list(value.words[:4]) if status == 0 else f"error {status}"
            row["attrs"] = attrs
            params = KernelNodeParams()
            _check(cuda.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params)),
                   "cuGraphKernelNodeGetParams_v2")
            if params.func:
                func = {}
                for attr, label in FUNC_ATTRIBUTES.items():
                    value = ctypes.c_int()
                    status = cuda.cuFuncGetAttribute(ctypes.byref(value), attr, ctypes.c_void_p(params.func))
                    func[label] = value.value if status == 0 else f"error {status}"
                row["func"] = func
        rows.append(row)
    return rows


def attribute_differences(first: list[dict], other: list[dict]) -> list[str]:
    """The nodes (by position) whose launch or function attributes differ between two graphs."""
    if [r["name"] for r in first] != [r["name"] for r in other]:
        return [f"the graphs' nodes differ ({len(first)} against {len(other)})"]
    return [f"{i}: {a['name']}: {key} {a.get(key)} / {b.get(key)}" for i, (a, b) in enumerate(zip(first, other))
            for key in ("attrs", "func") if a.get(key) != b.get(key)]


def edges(graph: Any) -> list[dict]:
    """Every edge of ``graph`` (a ``torch.cuda.CUDAGraph`` kept after capture): ``{"from", "to"}`` (the nodes' names),
    ``type`` (0 default, 1 programmatic), ``from_port`` (0 default, 1 programmatic, 2 launch order), ``to_port``; in
    the graph's order from its root when it is a chain (a decode step is), else as the driver lists them."""
    cuda = _libcuda()
    _, rows = _chain(cuda, ctypes.c_void_p(graph.raw_cuda_graph()))
    names: dict = {}

    def name(node: int) -> str:
        if node not in names:
            names[node] = node_name(cuda, node)
        return names[node]
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


def describe_nodes(graph: Any) -> tuple[list[dict], str]:
    """``(node attributes, one line)`` as :func:`describe` does for edges (never raises)."""
    try:
        rows = node_attributes(graph)
    except Exception as e:  # noqa: BLE001
        return [], f"node attributes not read: {type(e).__name__}: {e}"
    kernels = [r for r in rows if "attrs" in r]
    kinds = {repr(sorted(r["attrs"].items())) for r in kernels}
    return rows, f"{len(rows)} nodes, {len(kernels)} kernels, {len(kinds)} distinct launch-attribute sets"


def compare(graph: Any, label: str, first: tuple[list, list] | None = None, most: int = 20
            ) -> tuple[list[dict], list[dict], list[str]]:
    """Print ``label``'s edges and node attributes (:func:`describe`, :func:`describe_nodes`: one line each) and, given
    ``first = (edges, nodes)`` of another graph, the first ``most`` places where they differ from it. Returns
    ``(edges, nodes, attribute differences)`` (never raises)."""
    edge_rows, line = describe(graph)
    print(f"{label} edges: {line}", flush=True)
    node_rows, line = describe_nodes(graph)
    print(f"{label} nodes: {line}", flush=True)
    attributes: list[str] = []
    if first is not None:
        for d in differences(first[0], edge_rows)[:most]:
            print(f"  edges differ from the first graph's at {d}")
        attributes = attribute_differences(first[1], node_rows)[:most]
        for d in attributes:
            print(f"  attributes differ from the first graph's at {d}")
    return edge_rows, node_rows, attributes


class Exec:
    """A new executable of a graph kept after capture (``cuGraphInstantiateWithFlags``, no flags), launched on the
    current stream by :meth:`replay` (``cuGraphLaunch``): a stand-in for ``torch.cuda.CUDAGraph`` wherever only
    ``replay()`` is called. :meth:`close` destroys it."""

    def __init__(self, graph: Any) -> None:
        self.cuda = _libcuda()
        self.handle = ctypes.c_void_p()
        _check(self.cuda.cuGraphInstantiateWithFlags(ctypes.byref(self.handle), ctypes.c_void_p(graph.raw_cuda_graph()),
                                                     ctypes.c_ulonglong(0)), "cuGraphInstantiateWithFlags")

    def replay(self, stream: int | None = None) -> None:
        """Launch on ``stream`` (a ``CUstream`` handle), by default torch's current stream."""
        if stream is None:
            import torch
            stream = torch.cuda.current_stream().cuda_stream
        _check(self.cuda.cuGraphLaunch(self.handle, ctypes.c_void_p(stream)), "cuGraphLaunch")

    def close(self) -> None:
        if self.handle:
            _check(self.cuda.cuGraphExecDestroy(self.handle), "cuGraphExecDestroy")
            self.handle = ctypes.c_void_p()

