"""bench/kv_grow.py runs on the CPU (its docstring's example, smaller) and reports the table's
figures for both variants, so a GPU session does not find it broken."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from strata.cli.main import main

# The bench sets these from its flags; monkeypatch restores them after each test.
ENV = ("STRATA_KV_GROW_INIT", "STRATA_KV_GROW_STEP", "STRATA_KV_GROW_FLOOR",
       "STRATA_VMM_CHUNK_BYTES", "STRATA_LOAN_KEEP_SLOTS")


@pytest.fixture
def run_bench(capsys, monkeypatch):
    for name in ENV:
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    path = Path(__file__).resolve().parents[3] / "bench" / "kv_grow.py"
    spec = importlib.util.spec_from_file_location("bench_kv_grow", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def run(argv: list[str]) -> dict:
        assert bench.main([*argv, "--device", "cpu", "--no-prefill-loan", "--rounds", "1",
                           "--profile-prompts", "1", "--chat-new", "4", "--long-new", "4",
                           "--json"]) == 0
        out, err = capsys.readouterr()
        return {**json.loads(out), "stderr": err}
    return run


def test_the_slots_are_the_window_arithmetic(run_bench):
    report = run_bench(["--preset", "tiny", "--budget-mib", "1.875", "--max-context", "2048",
                        "--chunk-bytes", "4096", "--kv-init", "64", "--kv-step", "64",
                        "--kv-floor", "2", "--long-tokens", "300", "--prefill-chunk", "32",
                        "--burn-in", "0"])
    table = report["table"]
    # 5 slots beside the whole window's K/V (512 KiB); 15 beside its first 64 cells.
    assert (table["without"]["slots"], table["kv-grow"]["slots"]) == (5, 15)
    assert report["ratios"]["slots"] == 3.0
    kv = report["runs"]["kv-grow"][0]["kv"]
    assert kv["grows"] == 1 and kv["cells_mapped"] == 320 and kv["init_cells"] == 64
    assert report["runs"]["without"][0]["kv"] is None
    for row in table.values():
        assert row["chat_decode_tok_s"] > 0 and row["long_prefill_s"] > 0
    assert "burn-in" not in report["stderr"]


def test_a_skewed_checkpoint_with_a_burn_in(run_bench, tmp_path, capsys):
    # As bench/gpu_session.sh runs it: a checkpoint written by `strata init-model`, reused.
    ckpt = tmp_path / "skewed"
    assert main(["init-model", "--preset", "small", "--router-skew", "0.5", str(ckpt)]) == 0
    capsys.readouterr()  # its "wrote ..." line
    report = run_bench(["--model", str(ckpt), "--budget-mib", "12", "--chunk-bytes", "65536",
                        "--kv-init", "128", "--kv-step", "128", "--kv-floor", "4",
                        "--long-tokens", "600", "--prefill-chunk", "64"])
    assert report["stream_misses"] == 0  # strata generate's default off CUDA
    assert report["router_skew"] == 0.5 and report["burn_in"] == 1
    assert report["stderr"].count("burn-in done") == 2  # one untimed run of each variant
    assert all(len(runs) == 1 for runs in report["runs"].values())
    without, grown = report["table"]["without"], report["table"]["kv-grow"]
    assert grown["slots"] > without["slots"]
    kv = report["runs"]["kv-grow"][0]["kv"]
    assert kv["grows"] == 1 and kv["slots_given_up"] > 0
    assert report["runs"]["without"][0]["kv"] is None



def test_int8_cells_against_bf16_in_one_run(run_bench):
    report = run_bench(["--preset", "tiny", "--budget-mib", "2.875", "--max-context", "2048",
                        "--chunk-bytes", "4096", "--kv-init", "64", "--kv-step", "64",
                        "--kv-floor", "2", "--long-tokens", "300", "--prefill-chunk", "32",
                        "--burn-in", "0", "--kv-dtype", "bf16,int8"])
    table = report["table"]
    assert list(table) == ["without bf16", "kv-grow bf16", "without int8", "kv-grow int8"]
    assert report["kv_dtypes"] == ["bf16", "int8"]
    assert [report["runs"][name][0]["kv_dtype"] for name in table] == [
        "bf16", "bf16", "int8", "int8"]
    kv = report["runs"]["kv-grow int8"][0]["kv"]
    # int8 cells are 32 bytes: a 4 KiB chunk holds 128 of a segment, the policy's grid.
    assert kv["init_cells"] == 128 and kv["cells_mapped"] == 384 and kv["grows"] == 1
    assert set(report["ratios"]) >= {"slots", "chat_decode_tok_s"}  # bf16's, as before
    ratios = report["kv_dtype_ratios"]
    assert list(ratios) == ["without int8", "kv-grow int8"]
    assert all(r["long_prefill_tok_s"] > 0 and r["chat_decode_tok_s"] > 0
               for r in ratios.values())
