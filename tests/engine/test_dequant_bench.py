"""bench/dequant.py runs on the CPU (its docstring's first example, on a small shape): torch's
path and the copy are timed for every format (the kernels run on CUDA only; their bytes against
torch's are tests/engine/test_dequant_kernels.py's)."""

from __future__ import annotations

import json

import pytest

from support.bench_scripts import load_bench


def test_the_dequant_bench_times_each_format(tmp_path, capsys):
    bench = load_bench("dequant.py")
    out = tmp_path / "dequant.json"
    assert bench.main(["--preset", "small", "--formats", "int8,int4-g32,int4-g64",
                       "--repeat", "2", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["format"] for row in result["rows"]] == ["int8", "int4-g32", "int4-g64"]
    # the kernels run on CUDA only: nothing compared here, and none is claimed
    assert all(row["same_bytes"] is None and row["ms"]["torch"] > 0 and row["ms"]["copy"] > 0
               and "kernels" not in row["ms"] for row in result["rows"])
    assert "| - | - | - | - | - |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--preset", "small", "--formats", "int4"])  # int4-g32 or int4-g64
