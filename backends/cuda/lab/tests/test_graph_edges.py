"""``backends/cuda/lab/scripts/graph_edges.py`` against a fake driver (no GPU here): a three-node chain (kernel, memcpy,
kernel) read in chain order whatever order the driver lists its edges, each edge's type and ports, each kernel node's
launch and function attributes, a refused query kept as its error, and the differences between two graphs."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # backends/cuda/lab/scripts
import graph_edges as ge  # noqa: E402

ROOT, COPY, LAST = 101, 102, 103
FUNCS = {ROOT: 7001, LAST: 7002}
NAMES = {7001: b"decode_embed_kernel", 7002: b"dense_gemv_kernel"}


class FakeDriver:
    """The driver calls graph_edges makes, on one graph: ROOT -(programmatic)-> COPY -(default)-> LAST, listed out of
    order; ``priority`` is the last kernel's priority attribute; ``refuse`` an attribute id every node refuses."""

    def __init__(self, priority: int = 0, refuse: int = 14, programmatic: bool = True) -> None:
        self.edges = [(COPY, LAST, ge.EdgeData(0, 0, 0)),
                      (ROOT, COPY, ge.EdgeData(1, 0, 1) if programmatic else ge.EdgeData(0, 0, 0))]
        self.priority, self.refuse = priority, refuse
        self.launched: list = []

    def cuGraphGetEdges_v2(self, handle, src, dst, data, count):
        count._obj.value = len(self.edges)
        if src is not None:
            for i, (a, b, d) in enumerate(self.edges):
                src[i], dst[i], data[i] = a, b, d
        return 0

    def cuGraphNodeGetType(self, node, kind):
        kind._obj.value = 1 if node.value == COPY else 0
        return 0

    def cuGraphKernelNodeGetParams_v2(self, node, params):
        params._obj.func = FUNCS[node.value]
        return 0

    def cuFuncGetName(self, name, func):
        name._obj.value = NAMES[func.value]
        return 0

    def cuKernelGetName(self, name, kern):
        return 1

    def cuGraphKernelNodeGetAttribute(self, node, attr, value):
        if attr == self.refuse:
            return 1  # CUDA_ERROR_INVALID_VALUE
        value._obj.words[0] = self.priority if (attr == 8 and node.value == LAST) else attr * 10
        return 0

    def cuFuncGetAttribute(self, value, attr, func):
        value._obj.value = 128 if attr == 4 else 0
        return 0

    def cuGraphInstantiateWithFlags(self, exec_, graph, flags):
        assert graph.value == 55 and flags.value == 0
        exec_._obj.value = 9000
        return 0

    def cuGraphLaunch(self, exec_, stream):
        self.launched.append((exec_.value, stream.value))
        return 0 if exec_.value else 400  # CUDA_ERROR_INVALID_HANDLE

    def cuGraphExecDestroy(self, exec_):
        return 0


class FakeGraph:
    def raw_cuda_graph(self) -> int:
        return 55


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(ge, "_libcuda", lambda: fake)
    return fake


def test_edges_in_chain_order_with_types_and_ports(driver):
    rows = ge.edges(FakeGraph())
    assert [(r["from"], r["to"]) for r in rows] == [("decode_embed_kernel", "memcpy"), ("memcpy", "dense_gemv_kernel")]
    assert [(r["type"], r["from_port"], r["to_port"]) for r in rows] == [(1, 1, 0), (0, 0, 0)]
    assert ge.summary(rows) == {"type0/from0/to0": 1, "type1/from1/to0": 1}


def test_node_attributes_and_their_differences(driver, monkeypatch):
    first = ge.node_attributes(FakeGraph())
    assert [r["name"] for r in first] == ["decode_embed_kernel", "memcpy", "dense_gemv_kernel"]
    assert "attrs" not in first[1], "a memcpy node has no kernel attributes"
    kernel = first[2]
    assert kernel["attrs"]["priority"] == [0, 0, 0, 0] and kernel["attrs"]["mem_sync_domain"] == [100, 0, 0, 0]
    assert kernel["attrs"]["preferred_shared_memory_carveout"] == "error 1", "a refused query is kept as its error"
    assert kernel["func"]["num_regs"] == 128
    assert ge.attribute_differences(first, first) == []
    monkeypatch.setattr(ge, "_libcuda", lambda: FakeDriver(priority=3))
    other = ge.node_attributes(FakeGraph())
    diffs = ge.attribute_differences(first, other)
    assert len(diffs) == 1 and diffs[0].startswith("2: dense_gemv_kernel: attrs") and "[3, 0, 0, 0]" in diffs[0]


def test_edge_differences_name_the_edge(driver, monkeypatch):
    first = ge.edges(FakeGraph())
    monkeypatch.setattr(ge, "_libcuda", lambda: FakeDriver(programmatic=False))
    diffs = ge.differences(first, ge.edges(FakeGraph()))
    assert diffs == ["0: decode_embed_kernel -> memcpy: type 1/0, from port 1/0"]


def test_describe_never_raises(monkeypatch):
    class Broken:
        def __getattr__(self, name):
            return lambda *args: 999

    monkeypatch.setattr(ge, "_libcuda", lambda: Broken())
    rows, line = ge.describe_nodes(FakeGraph())
    assert rows == [] and "999" in line
    rows, line = ge.describe(FakeGraph())
    assert rows == [] and "999" in line


def test_attribute_value_is_the_drivers_64_bytes():
    assert ctypes.sizeof(ge.AttrValue) == 64 and ctypes.sizeof(ge.EdgeData) == 8


def test_exec_instantiates_launches_and_closes(driver):
    ex = ge.Exec(FakeGraph())
    ex.replay(stream=77)
    assert driver.launched[-1] == (9000, 77)
    ex.close()
    with pytest.raises(RuntimeError, match="cuGraphLaunch failed with CUresult 400"):
        ex.replay(stream=77)



def test_compare_prints_each_graph_and_where_it_differs(driver, monkeypatch, capsys):
    first = ge.compare(FakeGraph(), "graph 0")
    assert first[2] == [] and "graph 0 edges: 2 edges" in capsys.readouterr().out
    monkeypatch.setattr(ge, "_libcuda", lambda: FakeDriver(priority=3, programmatic=False))
    edge_rows, node_rows, attributes = ge.compare(FakeGraph(), "graph 1", first[:2])
    out = capsys.readouterr().out
    assert "edges differ from the first graph's at 0: decode_embed_kernel -> memcpy: type 1/0" in out, out
    assert len(attributes) == 1 and attributes[0].startswith("2: dense_gemv_kernel: attrs") and attributes[0] in out
    assert [r["type"] for r in edge_rows] == [0, 0] and len(node_rows) == 3
