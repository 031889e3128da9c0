"""The CPU miss path: the same bytes on the worker as on the calling thread at the same thread
count, call after call; bench/cpu_experts.py runs and reports its ratios.

The thread count itself may change the bytes (fp32 at 64 tokens, 1 against 2 threads, here):
`--cpu-threads` is part of what a run's output depends on."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strata.engine.cache.cpu_experts import CpuExperts
from strata.engine.cache.routed import Routed
from strata.engine.experts import ExpertStore


def _store(dtype):
    gen = torch.Generator().manual_seed(0)
    d, f, e = 64, 96, 8
    typed = (torch.randn(e, 3 * f * d, generator=gen) * 0.1).to(dtype)
    return ExpertStore([typed.view(torch.uint8)], d, f, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_tokens", [1, 64])
def test_worker_and_thread_counts_give_the_same_bytes(dtype, n_tokens):
    store = _store(dtype)
    rng = np.random.default_rng(n_tokens)
    ids = np.stack([rng.choice(store.n_experts, 2, replace=False) for _ in range(n_tokens)])
    routed = Routed.of(ids)
    x_rows = torch.randn(routed.n_rows, store.hidden_size,
                         generator=torch.Generator().manual_seed(1)).to(dtype)
    main_threads = torch.get_num_threads()
    outputs = []
    for threads in (None, 1):
        cpu = CpuExperts(store, threads)
        try:
            torch.set_num_threads(threads or main_threads)
            on_main = cpu.compute(0, x_rows, routed)
            for _ in range(2):
                out, cpu_s = cpu.submit(0, x_rows, routed).result()
                assert cpu_s > 0
                assert torch.equal(out.view(torch.uint8), on_main.view(torch.uint8))
            outputs.append(on_main)
        finally:
            torch.set_num_threads(main_threads)
            cpu.close()
    # Each expert's rows are its output for their inputs, computed over all of them at once.
    f = store.expert_width
    for i, expert in enumerate(routed.experts.tolist()):
        lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
        gate, up, down = store.weights(0, expert)
        h = F.linear(x_rows[lo:hi], torch.cat((gate, up)))
        expected = F.linear(F.silu(h[:, :f]) * h[:, f:], down)
        assert torch.equal(outputs[0][lo:hi], expected)


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
    assert "| fp32 | 1 |" in capsys.readouterr().out
