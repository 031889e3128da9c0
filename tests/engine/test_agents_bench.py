"""bench/agents.py runs on the CPU (its docstring's example, smaller) and reports every turn of
both variants, so a GPU session does not find it broken."""

from __future__ import annotations

from support.agent_bench import run_small_scenario


def test_the_agent_scenario_restores_and_trims(capsys, monkeypatch):
    report = run_small_scenario("agents.py", capsys, monkeypatch)
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
