"""The cost model: counts to time per round and tok/s, by hand."""

import json

import numpy as np
import pytest

from strata.formats.trace import DECODE, PROMPT, Trace
from strata.sim.cost import Bandwidths, CostModel
from strata.sim.result import ReplayResult


def two_step_result():
    """2 layers: a 2-token prompt step, then one decode step; counts set by hand."""
    ids = np.zeros((3, 2, 1), np.int32)
    trace = Trace(4, ids, [0, 2, 3], np.array([PROMPT, DECODE], np.uint8), [0, 2])
    result = ReplayResult.empty(trace, policy="p", name="p", options={}, path="generic",
                                slots=1)
    result.steps.distinct_hits[...] = [[1, 0], [2, 1]]
    result.steps.distinct_misses[...] = [[1, 2], [0, 3]]
    result.steps.uploads[...] = [0, 4]
    return trace, result


def test_estimate_by_hand():
    trace, result = two_step_result()
    # B = 1 GB: a hit costs 1/100 s on the device, a miss 1/10 s on the CPU, an upload 1/20 s.
    model = CostModel(Bandwidths(device_gbps=100, host_gbps=10, pcie_gbps=20),
                      expert_bytes=10**9, dense_bytes=2 * 10**9)
    seconds = model.step_seconds(result)
    # prompt: dense 0.02 + max(0.01, 0.1) + max(0, 0.2) = 0.32
    # decode: dense 0.02 + max(0.02, 0) + max(0.01, 0.3) + 4 uploads * 0.05 = 0.54
    assert seconds.tolist() == pytest.approx([0.32, 0.54])
    estimate = model.estimate(result, trace.step_tokens)
    assert estimate["decode_round_ms"] == pytest.approx(540.0)
    assert estimate["decode_tok_s"] == pytest.approx(1 / 0.54)
    assert estimate["prompt_tok_s"] == pytest.approx(2 / 0.32)


def test_no_decode_steps_gives_none():
    ids = np.zeros((2, 1, 1), np.int32)
    trace = Trace(2, ids, [0, 2], [PROMPT], [0, 1])
    result = ReplayResult.empty(trace, policy="p", name="p", options={}, path="generic",
                                slots=0)
    model = CostModel(Bandwidths(1, 1, 1), expert_bytes=1)
    estimate = model.estimate(result, trace.step_tokens)
    assert estimate["decode_round_ms"] is None and estimate["decode_tok_s"] is None


def test_bandwidths_from_json(tmp_path):
    path = tmp_path / "bw.json"
    path.write_text(json.dumps({"device_gbps": 3000, "host_gbps": 80.5, "pcie_gbps": 25,
                                "measured_by": "engine"}))
    assert Bandwidths.from_json(path) == Bandwidths(3000, 80.5, 25)
    path.write_text(json.dumps({"device_gbps": 3000}))
    with pytest.raises(ValueError, match=r"the keys \['host_gbps', 'pcie_gbps'\] are missing"):
        Bandwidths.from_json(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="want a JSON object"):
        Bandwidths.from_json(path)
    with pytest.raises(ValueError, match="cannot read bandwidths"):
        Bandwidths.from_json(tmp_path / "none.json")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device_gbps": 0}, r"device_gbps must be a finite number > 0 \(GB/s\)"),
    ({"host_gbps": float("inf")}, "host_gbps must be a finite number"),
    ({"pcie_gbps": "25"}, "pcie_gbps must be a finite number"),
])
def test_bad_bandwidths(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Bandwidths(**{"device_gbps": 1.0, "host_gbps": 1.0, "pcie_gbps": 1.0, **kwargs})


def test_bad_cost_model():
    with pytest.raises(ValueError, match="expert_bytes must be an int >= 1"):
        CostModel(Bandwidths(1, 1, 1), expert_bytes=0)
    with pytest.raises(ValueError, match="dense_bytes must be an int >= 0"):
        CostModel(Bandwidths(1, 1, 1), expert_bytes=1, dense_bytes=-1)
