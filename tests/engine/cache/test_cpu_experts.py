"""The CPU miss path: each expert once over its rows, the same bytes call after call at the
set thread count; bench/cpu_experts.py runs and reports its ratios.

The thread count itself may change the bytes (fp32 at 64 tokens, 1 against 2 threads, here):
`--cpu-threads` is part of what a run's output depends on."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strata.engine.experts import ExpertStore
from strata.engine.experts.cpu import CpuExperts
from strata.engine.experts.routed import Routed


def _store(dtype):
    gen = torch.Generator().manual_seed(0)
    d, f, e = 64, 96, 8
    typed = (torch.randn(e, 3 * f * d, generator=gen) * 0.1).to(dtype)
    return ExpertStore([typed.view(torch.uint8)], d, f, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_tokens", [1, 64])
def test_each_expert_runs_once_over_its_rows_at_the_set_thread_count(dtype, n_tokens):
    store = _store(dtype)
    rng = np.random.default_rng(n_tokens)
    ids = np.stack([rng.choice(store.n_experts, 2, replace=False) for _ in range(n_tokens)])
    routed = Routed.of(ids)
    x_rows = torch.randn(routed.n_rows, store.hidden_size,
                         generator=torch.Generator().manual_seed(1)).to(dtype)
    caller_threads = torch.get_num_threads()
    f = store.expert_width
    for threads in (None, 1):
        cpu = CpuExperts(store, threads)
        first = cpu.compute(0, x_rows, routed)
        assert torch.get_num_threads() == caller_threads  # the caller's count is given back
        assert torch.equal(cpu.compute(0, x_rows, routed).view(torch.uint8),
                           first.view(torch.uint8))
        # Each expert's rows are its output for their inputs, computed over all of them at
        # once, at the thread count of the call (the count may change the bytes).
        torch.set_num_threads(threads or caller_threads)
        try:
            for i, expert in enumerate(routed.experts.tolist()):
                lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
                gate, up, down = store.weights(0, expert)
                h = F.linear(x_rows[lo:hi], torch.cat((gate, up)))
                expected = F.linear(F.silu(h[:, :f]) * h[:, f:], down)
                assert torch.equal(first[lo:hi], expected)
        finally:
            torch.set_num_threads(caller_threads)


def test_a_bad_thread_count_is_refused():
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="cpu_threads must be None or an int >= 1"):
            CpuExperts(_store(torch.float32), bad)


def test_the_cpu_experts_bench_runs_and_reports(capsys):
    path = Path(__file__).resolve().parents[3] / "bench" / "cpu_experts.py"
    spec = importlib.util.spec_from_file_location("bench_cpu_experts", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--preset", "tiny", "--repeat", "1", "--tokens", "1,4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(run["dtype"], run["tokens"]) for run in result["runs"]] == [
        ("bf16", 1), ("bf16", 4), ("fp32", 1), ("fp32", 4)]
    for run in result["runs"]:
        assert run["experts"] >= 1 and run["rows"] == run["tokens"] * 2
        assert run["ratio_to_bare"]["bare"] == 1.0
        assert set(run["us_per_expert"]) == {"bare", "compute-main", "compute-worker",
                                             "worker-main-busy"}
    assert bench.main(["--preset", "tiny", "--repeat", "1", "--dtypes", "fp32",
                       "--tokens", "1"]) == 0
    assert "| pageable | fp32 | 1 |" in capsys.readouterr().out
