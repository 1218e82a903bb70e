"""``musecore bench``'s printed table: which backend and path a row measured (a peer's rows beside ours on the same
shape), and why a row that could not be measured was not."""

from __future__ import annotations

from musecore.commands import bench


def test_the_table_names_backend_path_and_errors(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps to the terminal's width
    rows = [{"backend": "cuda", "case": "linear", "format": "nvfp4", "path": "mma", "shape": "q_proj 8192->8192",
             "M": 1, "time_us": 19.96, "speedup_vs_bf16": 1.76, "pct_memory_ceiling": 50.9},
            {"backend": "gemlite", "case": "linear", "format": "nvfp4", "path": "A16W4_NVFP",
             "shape": "q_proj 8192->8192", "M": 1, "time_us": 30.5, "speedup_vs_bf16": 1.15, "pct_memory_ceiling": 33.3},
            {"backend": "gemlite", "case": "linear", "error": "gemlite is not importable: ModuleNotFoundError"}]
    bench.print_table("cuda gemlite", rows)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "q_proj" in line or "importable" in line]
    assert len(lines) == 3, out
    assert "cuda" in lines[0] and "mma" in lines[0] and " 20 " in lines[0], out  # time_us to 3 digits
    assert "gemlite" in lines[1] and "A16W4_NVFP" in lines[1], out
    assert "error: gemlite is not importable" in lines[2], out
