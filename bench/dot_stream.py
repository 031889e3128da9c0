"""How fast streams of weight rows go through strata's CPU dot products, per thread and
together: the memory side of the CPU kernel's passes, without the passes, team or engine.

Builds bench/dot_stream.c against src/strata/_cpu_experts_dot.h (the kernel's own dot products,
with the flags the extension is built with) and runs it over a grid: the weights' format, the
row's bytes (pass 2's rows of down are F elements long, pass 1's gate and up rows D: 768 and
2,048 int8 bytes on qwen3-30b-a3b), the rows read at once (`strata_dots_*`: 1, 2, 4), adjacent
or half a block apart, the prefetch distance (`PREFETCH_BYTES`), the threads, how the rows
reach them (`--schedules`: "parts", each thread its own part of the rows in order; "dynamic",
blocks handed out one at a time, as the kernel's default schedule hands out its tasks) and the
rows a block (`--block-rows`; the kernel's tasks are 16), over `--weight-mib` in memory
(several times the CPU's last-level cache, so that no pass finds the last one's rows there).
Each line's GB/s is the best of `--repeat` passes over all the weights; its ratio is against
one row at a time with the same format, row, prefetch, threads, schedule and block. Every run's
`checksum` (the XOR of each row's dot product's bits) must be the same for a format, row and
thread count at any rows at once, layout, prefetch, schedule and block: each row's sum takes
the same steps.

    python bench/dot_stream.py
    python bench/dot_stream.py --threads 1,16 --weight-mib 2048 --json

"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HEADER_DIR = Path(__file__).resolve().parent.parent / "src" / "strata"
SOURCE = Path(__file__).resolve().parent / "dot_stream.c"


def build(out_dir: Path) -> Path:
    """Compile dot_stream.c into out_dir with the C compiler the extension is built with."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        compiler = "cc"
    binary = out_dir / "dot_stream"
    subprocess.run([compiler, "-O3", "-fopenmp", "-I", str(HEADER_DIR), str(SOURCE), "-o",
                    str(binary)], check=True)
    return binary


def run(binary: Path, fmt: str, row_bytes: int, rows: int, layout: str, prefetch: int,
        threads: int, weight_mib: int, repeat: int, schedule: str, block_rows: int) -> dict:
    """One run's JSON object (dot_stream.c's line)."""
    done = subprocess.run([str(binary), fmt, str(row_bytes), str(rows), layout, str(prefetch),
                           str(threads), str(weight_mib), str(repeat), schedule,
                           str(block_rows)],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def _ints(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        parser.error(f"{flag} takes comma-separated integers >= 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="int8", help="comma-separated: int8, bf16")
    parser.add_argument("--row-bytes", default="768,2048",
                        help="comma-separated multiples of 64: a row's bytes")
    parser.add_argument("--rows", default="1,2,4", help="comma-separated 1, 2, 4: rows at once")
    parser.add_argument("--layouts", default="adjacent,apart",
                        help="comma-separated: adjacent, apart (rows at once > 1 only)")
    parser.add_argument("--prefetch", default="0,4096",
                        help="comma-separated multiples of 64: bytes ahead to prefetch")
    parser.add_argument("--threads", default=f"1,{os.cpu_count() or 1}",
                        help="comma-separated thread counts (default: 1 and every CPU)")
    parser.add_argument("--schedules", default="parts,dynamic",
                        help="comma-separated: parts, dynamic")
    parser.add_argument("--block-rows", default="16",
                        help="comma-separated multiples of 4: rows a block (a task)")
    parser.add_argument("--weight-mib", type=int, default=1024,
                        help="MiB of weights, split between the threads (default 1024)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    formats, layouts = args.formats.split(","), args.layouts.split(",")
    schedules = args.schedules.split(",")
    row_bytes, rows = _ints(parser, "--row-bytes", args.row_bytes), _ints(parser, "--rows",
                                                                          args.rows)
    prefetches = _ints(parser, "--prefetch", args.prefetch)
    threads = _ints(parser, "--threads", args.threads)
    blocks = _ints(parser, "--block-rows", args.block_rows)
    if set(formats) - {"int8", "bf16"} or set(layouts) - {"adjacent", "apart"} \
            or set(schedules) - {"parts", "dynamic"} \
            or set(rows) - {1, 2, 4} or any(n % 64 or n < 64 for n in row_bytes) \
            or any(n % 64 for n in prefetches) or min(threads) < 1 or args.weight_mib < 1 \
            or any(n % 4 or n < 4 for n in blocks) \
            or args.repeat < 1:
        parser.error("--formats int8,bf16; --layouts adjacent,apart; --schedules parts,dynamic; "
                     "--rows 1, 2, 4; --block-rows multiples of 4; "
                     "--row-bytes and --prefetch multiples of 64; --threads, --weight-mib "
                     "and --repeat >= 1")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        for fmt, size, prefetch, n_threads, schedule, block in itertools.product(
                formats, row_bytes, prefetches, threads, schedules, blocks):
            shapes = [(1, "adjacent")] + [(k, layout) for k in rows if k > 1
                                          for layout in layouts]
            line = [run(binary, fmt, size, k, layout, prefetch, n_threads, args.weight_mib,
                        args.repeat, schedule, block) for k, layout in shapes]
            for r in line:
                r["ratio"] = r["gb_s"] / line[0]["gb_s"]
            runs.extend(line)
    result = {"command": " ".join(["python", "bench/dot_stream.py", *(argv or sys.argv[1:])]),
              "date": datetime.date.today().isoformat(),
              "machine": platform.processor() or platform.machine(), "runs": runs}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['command']}  ({result['machine']})")
    print("| format | row bytes | prefetch | threads | schedule | block rows | rows at once | "
          "layout | GB/s | ratio |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: |")
    for r in runs:
        print(f"| {r['format']} | {r['row_bytes']} | {r['prefetch_bytes']} | {r['threads']} | "
              f"{r['schedule']} | {r['block_rows']} | {r['rows_at_once']} | {r['layout']} | "
              f"{r['gb_s']:.1f} | "
              f"{r['ratio']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
