"""Time ResidencyTable.lookup against the pure-Python reference the tests use.

The table is a 48-layer, 128-expert model with half its experts resident (3072 slots), filled
hottest first from a skewed synthetic profile; routing draws K = 8 distinct experts per token from
the same skew, so about three lookups in four hit. Cases: one layer's lookup of a decode batch
[1, 8] (allocating its outputs, and into preallocated ones), of a prompt batch [2048, 8], a whole
decode round (48 layers × [1, 8], preallocated outputs), and `record` of [1, 8] for context.

Each figure is the best of several repeats of a loop long enough to time (µs per call).
Targets: a decode round's lookups under 50 µs, and at least 20× the reference.

    python bench/residency.py          # a table
    python bench/residency.py --json   # one JSON object
"""

import argparse
import json
import platform
import sys
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from strata._residency import ResidencyTable
from support.reference_residency import ReferenceResidency

N_LAYERS, N_EXPERTS, TOP_K = 48, 128, 8
N_SLOTS = N_LAYERS * N_EXPERTS // 2
SLOT_BYTES = 3 * 2048 * 768 * 2  # gate, up, down of a 2048 × 768 bf16 expert
CHUNK_BYTES = 2 << 20
PROMPT_TOKENS = 2048
ROUND_TARGET_US, RATIO_TARGET = 50.0, 20.0


def route(rng, log_p, n_tokens):
    """[n_tokens, K] distinct experts per token, drawn by the Gumbel top-k trick from p."""
    keys = log_p + rng.gumbel(size=(n_tokens, log_p.size))
    return np.argsort(-keys, axis=1)[:, :TOP_K].astype(np.int64)


def build(seed=0):
    rng = np.random.default_rng(seed)
    # Per-layer popularity: a Zipf-like skew over a random order of the experts.
    popularity = 1.0 / np.arange(1, N_EXPERTS + 1) ** 0.8
    log_p = np.stack([np.log(popularity[rng.permutation(N_EXPERTS)]) for _ in range(N_LAYERS)])
    shape = (N_LAYERS, N_EXPERTS, N_SLOTS, SLOT_BYTES, CHUNK_BYTES)
    table, ref = ResidencyTable(*shape), ReferenceResidency(*shape)
    table.set_rank_from_counts(log_p)
    hottest = np.argsort(table.rank.reshape(-1))[:N_SLOTS]  # flat ids, hottest first
    layers, experts = hottest // N_EXPERTS, hottest % N_EXPERTS
    table.assign_many(np.arange(N_SLOTS), layers, experts)
    ref.assign_many(np.arange(N_SLOTS), layers, experts)
    decode = [route(rng, log_p[layer], 1) for layer in range(N_LAYERS)]
    prompt = route(rng, log_p[0], PROMPT_TOKENS)
    return table, ref, decode, prompt


def per_call_us(stmt, names, min_seconds=0.2, repeats=5):
    """Best µs per run of `stmt` (source, so no wrapper call is timed) over `repeats` timings."""
    timer = timeit.Timer(stmt, globals=names)
    number, _ = timer.autorange()
    number = max(1, int(number * min_seconds / 0.2))
    return min(timer.repeat(repeats, number)) / number * 1e6


def measure():
    table, ref, decode, prompt = build()
    outs = [(np.empty((1, TOP_K), np.int32), np.empty((1, TOP_K), np.bool_)) for _ in decode]
    names = {
        "lookup": table.lookup, "record": table.record, "ids": decode[0], "prompt": prompt,
        "out_slots": outs[0][0], "out_hit": outs[0][1],
        "ref_lookup": ref.lookup, "ref_record": ref.record,
        "layers": [(layer, decode[layer], *outs[layer]) for layer in range(N_LAYERS)],
        "ref_layers": list(enumerate(decode)),
    }
    # The two must agree before their times mean anything.
    for layer, layer_ids in enumerate(decode):
        np.testing.assert_array_equal(table.lookup(layer, layer_ids)[0],
                                      ref.lookup(layer, layer_ids)[0])
    np.testing.assert_array_equal(table.lookup(0, prompt)[0], ref.lookup(0, prompt)[0])
    hit_rate = table.hits / table.lookups

    round_name = f"decode round ({N_LAYERS} × [1, 8])"
    cases = {  # name: (strata statement, reference statement or None)
        "lookup [1, 8]": ("lookup(0, ids)", "ref_lookup(0, ids)"),
        "lookup [1, 8], preallocated": ("lookup(0, ids, out_slots, out_hit)", "ref_lookup(0, ids)"),
        f"lookup [{PROMPT_TOKENS}, 8]": ("lookup(0, prompt)", "ref_lookup(0, prompt)"),
        round_name: ("for layer, ids, slots, hit in layers: lookup(layer, ids, slots, hit)",
                     "for layer, ids in ref_layers: ref_lookup(layer, ids)"),
        "record [1, 8]": ("record(0, ids)", "ref_record(0, ids)"),
    }
    rows = []
    for name, (fast, slow) in cases.items():
        us, ref_us = per_call_us(fast, names), per_call_us(slow, names)
        rows.append({"case": name, "strata_us": us, "reference_us": ref_us, "ratio": ref_us / us})
    lookup_ratios = [row["ratio"] for row in rows if row["case"] != "record [1, 8]"]
    round_us = rows[3]["strata_us"]
    return {
        "table": {"n_layers": N_LAYERS, "n_experts": N_EXPERTS, "n_slots": N_SLOTS,
                  "top_k": TOP_K, "hit_rate": round(hit_rate, 3)},
        "machine": {"python": platform.python_version(), "numpy": np.__version__,
                    "processor": platform.processor() or platform.machine()},
        "rows": rows,
        "targets": {
            "round_us": ROUND_TARGET_US, "round_met": round_us < ROUND_TARGET_US,
            "ratio": RATIO_TARGET, "min_lookup_ratio": min(lookup_ratios),
            "ratio_met": min(lookup_ratios) >= RATIO_TARGET,
        },
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = measure()
    if args.json:
        print(json.dumps(result))
        return 0
    t = result["table"]
    print(f"{t['n_layers']} layers × {t['n_experts']} experts, {t['n_slots']} slots, "
          f"K = {t['top_k']}, hit rate {t['hit_rate']:.1%}")
    print(f"{'case':<32} {'strata µs':>10} {'reference µs':>13} {'ratio':>8}")
    for row in result["rows"]:
        print(f"{row['case']:<32} {row['strata_us']:10.3f} {row['reference_us']:13.2f} "
              f"{row['ratio']:7.1f}×")
    goals = result["targets"]
    round_met = "met" if goals["round_met"] else "NOT met"
    ratio_met = "met" if goals["ratio_met"] else "NOT met"
    print(f"targets: decode round < {goals['round_us']:.0f} µs: {round_met}; lookups >= "
          f"{goals['ratio']:.0f}× the reference: {ratio_met} "
          f"(lowest {goals['min_lookup_ratio']:.1f}×)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
