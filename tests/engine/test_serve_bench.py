"""bench/serve.py runs on the CPU (its docstring's example, smaller): the agent scenario
in-process and through `strata serve` processes, both variants, every turn reported, the
prompts and the reuse the same over HTTP as in-process."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

ENV = ("STRATA_KV_GROW_INIT", "STRATA_KV_GROW_STEP", "STRATA_KV_GROW_FLOOR",
       "STRATA_VMM_CHUNK_BYTES")


def _run(capsys):
    """bench/serve.py's main on the tiny model, small; its JSON report."""
    path = Path(__file__).resolve().parents[2] / "bench" / "serve.py"
    spec = importlib.util.spec_from_file_location("bench_serve", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--dtype", "fp32",
                       "--budget-mib", "4", "--max-context", "1024", "--chunk-bytes", "4096",
                       "--kv-init", "64", "--kv-step", "64", "--kv-floor", "2",
                       "--main-tokens", "300", "--side-tokens", "40", "--main2-tokens", "400",
                       "--turn-tokens", "8", "--new-tokens", "4", "--prefill-chunk", "64",
                       "--no-prefill-loan", "--profile-prompts", "1",
                       "--conversation-cache-mib", "64", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_agent_scenario_over_http(capsys, monkeypatch):
    for name in ENV:  # the bench sets them from its flags; monkeypatch restores them after
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    # One torch thread, here and in the servers: the tiny model's ops are too small to share,
    # and on two busy cores a spinning thread team slows its rounds 50 times.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = _run(capsys)
    finally:
        torch.set_num_threads(threads)
    for name in ("without", "kv-grow"):
        rows = report["runs"][name]
        assert [r["turn"] for r in rows] == report["turns"]
        # The same prompts over HTTP as in-process, the same tokens reused: the follow-ups
        # (turns 3, 6, 7) restored, everything but their new tokens.
        assert [r["http_reused_tokens"] for r in rows] == [r["reused_tokens"] for r in rows]
        for i in (3, 6, 7):
            assert rows[i]["http_reused_tokens"] == rows[i]["prompt_tokens"] - 8
        assert all(r["client_ttft_s"] >= r["server_first_token_s"] > 0 for r in rows)
        assert all(r["overhead_ttft_s"] is not None for r in rows)
