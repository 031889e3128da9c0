"""bench/dequant.py runs on the CPU (its docstring's first example, on a small shape): its
candidate gives `dequantize_blobs`' bytes for every format, and each row is timed."""

from __future__ import annotations

import json

import pytest

from support.bench_scripts import load_bench


def test_the_dequant_bench_checks_its_candidate_and_times_it(tmp_path, capsys):
    bench = load_bench("dequant.py")
    out = tmp_path / "dequant.json"
    assert bench.main(["--preset", "small", "--formats", "int8,int4-g32,int4-g64",
                       "--repeat", "2", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["format"] for row in result["rows"]] == ["int8", "int4-g32", "int4-g64"]
    assert all(row["same_bytes"] and row["ms"]["one_pass"] > 0 and row["ms"]["float32_copy"] > 0
               for row in result["rows"])
    assert "| int4-g64 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--preset", "small", "--formats", "int4"])  # int4-g32 or int4-g64
