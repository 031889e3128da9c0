"""Running bench/agents.py and bench/serve.py (the agent scenario) small, on the CPU."""

from __future__ import annotations

import json

from support.bench_scripts import load_bench

# The STRATA_* variables the benchmarks set from their flags (a test restores them after).
KV_ENV = ("STRATA_KV_GROW_INIT", "STRATA_KV_GROW_STEP", "STRATA_KV_GROW_FLOOR",
          "STRATA_VMM_CHUNK_BYTES")
# The scenario on the tiny model, its docstring's example made smaller: the follow-ups
# (turns 3, 6, 7) add 8 tokens each.
SMALL_SCENARIO = ["--preset", "tiny", "--device", "cpu", "--dtype", "fp32",
                  "--budget-mib", "4", "--max-context", "1024", "--chunk-bytes", "4096",
                  "--kv-init", "64", "--kv-step", "64", "--kv-floor", "2",
                  "--main-tokens", "300", "--side-tokens", "40", "--main2-tokens", "400",
                  "--turn-tokens", "8", "--new-tokens", "4", "--prefill-chunk", "64",
                  "--no-prefill-loan", "--profile-prompts", "1",
                  "--conversation-cache-mib", "64", "--json"]


def run_small_scenario(script: str, capsys, monkeypatch) -> dict:
    """bench/`script`'s main on SMALL_SCENARIO; its JSON report. The variables it sets are
    put back by `monkeypatch` after the test."""
    for name in KV_ENV:
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    assert load_bench(script).main(SMALL_SCENARIO) == 0
    return json.loads(capsys.readouterr().out)
