"""bench/agents.py runs on the CPU (its docstring's example, smaller) and reports every turn of
both variants, so a GPU session does not find it broken."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ENV = ("STRATA_KV_GROW_INIT", "STRATA_KV_GROW_STEP", "STRATA_KV_GROW_FLOOR",
       "STRATA_VMM_CHUNK_BYTES")


def test_the_agent_scenario_restores_and_trims(capsys, monkeypatch):
    for name in ENV:  # the bench sets them from its flags; monkeypatch restores them after
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    path = Path(__file__).resolve().parents[2] / "bench" / "agents.py"
    spec = importlib.util.spec_from_file_location("bench_agents", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--dtype", "fp32",
                       "--budget-mib", "4", "--max-context", "1024", "--chunk-bytes", "4096",
                       "--kv-init", "64", "--kv-step", "64", "--kv-floor", "2",
                       "--main-tokens", "300", "--side-tokens", "40", "--main2-tokens", "400",
                       "--turn-tokens", "8", "--new-tokens", "4", "--prefill-chunk", "64",
                       "--no-prefill-loan", "--profile-prompts", "1",
                       "--conversation-cache-mib", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for name in ("without", "kv-grow"):
        turns = report["runs"][name]["turns"]
        assert [t["turn"] for t in turns] == report["turns"]
        # The follow-ups (turns 3, 6, 7) were restored: everything but the new tokens reused.
        for i in (3, 6, 7):
            assert turns[i]["reused_tokens"] == turns[i]["prompt_tokens"] - 8
        assert all(t["ttft_s"] > 0 for t in turns)
    grown = report["runs"]["kv-grow"]["turns"]
    assert grown[0]["grows"] >= 1 and sum(t["trims"] for t in grown) >= 1
    assert grown[1]["cells_mapped"] < grown[0]["cells_mapped"]  # the side agent's trim
    assert len(report["ttft_ratio"]) == len(report["turns"])
