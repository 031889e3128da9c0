"""Regenerate the golden counts of the built-in policies: `python tests/sim/golden/regenerate.py`.

Run it when a policy changes on purpose, and commit counts.json with the change; the diff shows
what moved. `--new-trace` also rewrites trace.npz and profile.npz from their synthetic specs
(only needed if the trace format changes: the counts then all move).

The golden set-ups (SETUPS) are shared with tests/sim/test_golden.py, which replays each
built-in policy through them and compares every count with counts.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
TRACE = HERE / "trace.npz"
PROFILE = HERE / "profile.npz"
COUNTS = HERE / "counts.json"

# 3 layers of 8 experts, top-2: 10 requests of 2 to 52 tokens (prompts in chunks of 8);
# the profile is a second sample of the same workload.
TRACE_SPEC = dict(kind="markov", n_layers=3, n_experts=8, top_k=2, n_requests=10,
                  prompt_tokens=(1, 40), decode_tokens=(1, 12), prompt_chunk=8, seed=0)
PROFILE_SPEC = {**TRACE_SPEC, "n_requests": 4, "seed": 100}

KV_ENV = {"STRATA_KV_GROW_INIT": "4", "STRATA_KV_GROW_STEP": "4", "STRATA_KV_GROW_FLOOR": ""}
SETUPS = {
    "fixed": {"slots": 12, "loan_slots": 2, "kv": None},
    # 20 slots of 3 bytes over chunks of 4 (15 chunks), 1 K/V chunk of 4 cells at start,
    # 3 spare chunks: growths take slots, trims refill them.
    "kv-grow": {"slots": 20, "loan_slots": 3,
                "kv": {"max_context": 52, "slot_bytes": 3, "kv_segment_cell_bytes": 1,
                       "kv_segments": 1, "chunk_bytes": 4, "floor_slots": 2,
                       "budget_bytes": 76}},
}
FIELDS = ("path", "accesses", "hits", "misses", "admissions", "evictions", "relocations",
          "refills", "grows", "trims", "gave_up_slots", "kv_shortfalls")


def golden_counts() -> dict:
    """{setup: {policy: {field: value}}} for every built-in policy, and the bounds."""
    import numpy as np

    from strata.policies import load_registry
    from strata.sim import KvConfig, ReplayConfig, belady, load_trace, oracle_static, replay

    trace = load_trace(TRACE)
    with np.load(PROFILE) as z:
        profile = z["counts"]
    registry = load_registry()
    out: dict = {}
    with mock.patch.dict(os.environ, KV_ENV):
        for setup, spec in SETUPS.items():
            kv = None if spec["kv"] is None else KvConfig(**spec["kv"])
            config = ReplayConfig(slots=spec["slots"], loan_slots=spec["loan_slots"], kv=kv)
            results = [replay(trace, registry.create(name), config, profile)
                       for name in registry.names()]
            results += [belady(trace, spec["slots"]), oracle_static(trace, spec["slots"])]
            out[setup] = {r.policy: {k: r.to_dict()[k] for k in FIELDS} for r in results}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-trace", action="store_true",
                        help="rewrite trace.npz and profile.npz from their specs too")
    args = parser.parse_args()
    if args.new_trace:
        import numpy as np

        from strata.sim import SynthSpec, save_trace, synth_trace

        save_trace(synth_trace(SynthSpec(**TRACE_SPEC)), TRACE)
        np.savez(PROFILE, counts=synth_trace(SynthSpec(**PROFILE_SPEC)).routing_counts())
    COUNTS.write_text(json.dumps(golden_counts(), indent=2, sort_keys=True) + "\n")
    print(f"wrote {COUNTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
