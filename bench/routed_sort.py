"""A prompt chunk's routing grouped by expert on the host: the narrow sort keys against int64.

`Routed.of` sorts a layer call's routed rows by expert, stably, on the engine's thread: for a
prompt chunk through the expert cache twice a layer (the hits, the misses), 32,768 rows at
4,096 tokens of top-8. numpy sorts 8- and 16-bit integers by radix and int64 by merge sort, so
`routed.sort_keys` hands it the narrowest unsigned type that holds the ids. This times
`Routed.of` with them against the same call sorting the int64 ids (the baseline, in the same
run), checks both give the same rows, starts and experts, and prints the ratio. Host time,
median of `--repeat` after one warm-up, one thread (the engine's).

    python bench/routed_sort.py
    python bench/routed_sort.py --tokens 512,4096,16384 --json-out routed-sort.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import sys
from unittest import mock

import numpy as np

from _common import median_ms
from strata.engine.experts import routed
from strata.engine.experts.routed import Routed
from strata.engine.model.presets import get_preset


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="olmoe-1b-7b,qwen3-30b-a3b")
    parser.add_argument("--tokens", default="512,4096,16384")
    parser.add_argument("--miss-share", type=float, default=0.78,
                        help="the share of rows that miss (the cache's other call: the rest)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    if not 0 < args.miss_share < 1 or args.repeat < 1:
        parser.error("--miss-share must be in (0, 1) and --repeat >= 1")
    rows = []
    for name in args.presets.split(","):
        p = get_preset(name)
        for n_tokens in (int(t) for t in args.tokens.split(",")):
            rng = np.random.default_rng(n_tokens)
            ids = rng.integers(0, p.n_experts, (n_tokens, p.top_k))  # [T, K]
            missed = rng.random(ids.shape) < args.miss_share  # [T, K]
            for call, mask in (("misses", missed), ("hits", ~missed)):
                call_of = functools.partial(Routed.of, ids, mask)
                narrow = call_of()
                with mock.patch.object(routed, "sort_keys", lambda keys: keys):
                    wide = call_of()
                    wide_us = median_ms(call_of, args.repeat) * 1e3
                narrow_us = median_ms(call_of, args.repeat) * 1e3
                same = all(np.array_equal(getattr(narrow, f), getattr(wide, f))
                           for f in ("experts", "starts", "rows"))
                rows.append({"preset": name, "tokens": n_tokens, "call": call,
                             "rows": int(mask.sum()), "int64_us": wide_us,
                             "narrow_us": narrow_us, "ratio": narrow_us / wide_us,
                             "same": same})
    result = {"command": "python bench/routed_sort.py " + " ".join(argv or sys.argv[1:]),
              "machine": platform.processor() or platform.machine(),
              "numpy": np.__version__, "date": datetime.date.today().isoformat(), "rows": rows}
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(result, out)
    print(f"{result['command']}  ({result['machine']}, numpy {np.__version__})")
    print("| preset | tokens | call | rows | int64 keys us | narrow keys us | narrow / int64 "
          "| same |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        print(f"| {row['preset']} | {row['tokens']} | {row['call']} | {row['rows']} | "
              f"{row['int64_us']:.0f} | {row['narrow_us']:.0f} | {row['ratio']:.2f}x | "
              f"{row['same']} |")
    return 0 if all(row["same"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
