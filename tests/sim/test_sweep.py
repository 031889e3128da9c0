"""strata.sim.sweep: several policies at several sizes beside the bounds, as `strata simulate`
runs them, called without the command line."""

import pytest

from strata.policies import OptionError, load_registry
from strata.policies.registry import UnknownPolicyError
from strata.sim import SynthSpec, belady, oracle_static, replay, sweep, synth_trace
from strata.sim.replay import ReplayConfig
from strata.sim.sweep import sweep_steps


@pytest.fixture(scope="module")
def trace():
    return synth_trace(SynthSpec(kind="markov", n_layers=3, n_experts=8, top_k=2, n_requests=2,
                                 prompt_tokens=(4, 12), decode_tokens=(5, 9), prompt_chunk=8))


def test_results_come_per_size_policies_then_bounds(trace):
    registry = load_registry()
    specs = [("lru", ["max_admits=1"]), ("static", {})]
    results = sweep(trace, specs, [4, 6], registry=registry, profile=trace.routing_counts(),
                    bounds=["belady", "oracle-static", "belady-per-layer"])
    assert len(results) == 2 * (len(specs) + 3)
    for size, chunk in zip([4, 6], [results[:5], results[5:]], strict=True):
        config = ReplayConfig(slots=size)
        alone = replay(trace, registry.create("lru", ["max_admits=1"]), config,
                       trace.routing_counts())
        assert chunk[0].to_dict() == alone.to_dict()
        assert chunk[2].to_dict() == belady(trace, size).to_dict()
        assert chunk[3].to_dict() == oracle_static(trace, size).to_dict()
        assert chunk[4].to_dict() == belady(trace, size, scope="per-layer").to_dict()


def test_progress_callbacks(trace):
    steps, replays = [], []
    sweep(trace, [("lru", [])], [2, 4], bounds=(), on_step=steps.append,
          on_replay=lambda label, slots: replays.append((label, slots)))
    assert sum(steps) == sweep_steps(trace, 1, 2) == 2 * trace.n_steps
    assert replays == [("lru", 2), ("lru", 4)]


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"loan_slots": -1}, ValueError, "loan_slots must be >= 0, got -1"),
    ({"loan_slots": 5}, ValueError, "loan_slots 5 exceeds a cache of 4 slots"),
    ({"bounds": ["optimal"]}, ValueError, "unknown bound 'optimal'"),
    ({"policies": [("nope", [])]}, UnknownPolicyError, "unknown policy 'nope'"),
    ({"policies": [("lru", ["speed=9"])]}, OptionError, "unknown option 'speed'"),
])
def test_bad_arguments_are_refused(trace, kwargs, error, message):
    arguments = {"policies": [("lru", [])], **kwargs}
    with pytest.raises(error, match=message):
        sweep(trace, arguments.pop("policies"), [4], **arguments)
