"""bench/serve.py runs on the CPU (its docstring's example, smaller): the agent scenario
in-process and through `strata serve` processes, both variants, every turn reported, the
prompts and the reuse the same over HTTP as in-process."""

from __future__ import annotations

import torch

from support.agent_bench import run_small_scenario


def test_the_agent_scenario_over_http(capsys, monkeypatch):
    # One torch thread, here and in the servers: the tiny model's ops are too small to share,
    # and on two busy cores a spinning thread team slows its rounds 50 times.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = run_small_scenario("serve.py", capsys, monkeypatch)
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
