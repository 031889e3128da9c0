"""Whether a weight read ahead stays in the GPU's L2 cache across a decode layer's expert reads.

A decode layer's q/k/v product reads its weight (25 MiB at olmoe-1b-7b's shape) at the
device's bandwidth, after the experts (about 100 MiB) and before attention, the router and
the next experts, whose kernels leave the memory bus mostly idle for microseconds. If that
weight were read into L2 (50 MiB on the H100 and H200) in such a gap and kept there while the
experts stream past (their loads marked `evict_first`, the weight's `evict_last`), the next
layer's product would read it from L2. This probe times the real product kernel
(`products.linear`, one token) reading a weight [N, K]:

- cold: after a read of `--flush-mib` MiB (the weight is not in L2);
- hot: right after a read of the weight itself (L2's best case);
- kept: after a read of the weight marked evict_last, then `--stream-mib` MiB of other
  reads, marked evict_first ("kept, stream evict_first") or not ("kept, stream plain");
- prefetched: after the weight was asked into L2 by a few programs, as a latency-bound
  kernel's programs could ask for the next layer's weight, by one `prefetch.global.L2` a
  128-byte line ("lines") or 32-byte sector ("sectors"), or one `cp.async.bulk.prefetch.L2` a
  16 KiB chunk ("bulk"), with the evict_last hint or without: then the stream, or at once.
  (Marked evict_last, prefetches brought a third of the weight on an H100,
  bench/results/l2-ahead-h100-2026-12-06.md; lines marked so may be held to the persisting
  part of L2, which is empty unless `cudaLimitPersistingL2CacheSize` sets one.)

It also times the stream alone with and without the evict_first mark (whether the mark slows
the expert reads), and the prefetching kernel alone (how long its programs take to ask). CUDA
events, the median of `--repeat`, the figures as ratios against cold in the same run.

`--persisting-mib` sets aside that much of L2 for lines marked evict_last first (the
context's persisting L2 limit, 0 by default): whether the hinted prefetches then stay.

    python bench/l2_keep.py --json out.json          # on the GPU machine
    python bench/l2_keep.py --persisting-mib 30 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch

from _common import add_persisting_argument, check_persisting_argument, set_persisting_l2

BLOCK = 4096  # elements a program reads a step
PREFETCH_PROGRAMS = (16, 64)  # an attention kernel's kv heads; a router kernel's splits
# The bytes one prefetch instruction asks for: a bulk prefetch's chunk (a multiple of 16), an
# L2 line, an L2 sector.
CHUNK_BYTES = {"bulk": 16384, "lines": 128, "sectors": 32}
STEP = 256  # chunks a program asks for a step: one for each thread of 8 warps


def _kernels():
    """(read, prefetch): the probe's Triton kernels, made here (Triton imported only on use)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read(src_ptr, out_ptr, n, BLOCK: tl.constexpr, EVICT: tl.constexpr):
        # Program p reads every BLOCK-th block from p on, marked EVICT, and stores a sum (so
        # the loads are kept).
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            acc += tl.load(src_ptr + offsets, mask=offsets < n, other=0.0,
                           eviction_policy=EVICT).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    @triton.jit
    def prefetch(src_ptr, n, CHUNK: tl.constexpr, STEP: tl.constexpr, BULK: tl.constexpr,
                 LAST: tl.constexpr):
        # The programs ask the n elements into L2 in chunks of CHUNK elements, STEP chunks a
        # step, marked to be evicted last where LAST. BULK: one `cp.async.bulk.prefetch.L2`
        # of each chunk's bytes (sm_90's asynchronous copy unit; nothing past the end); else
        # one `prefetch.global.L2` of the line or sector at each chunk's start (a chunk being
        # that line or sector; past the end the last element's line again, a prefetch taking
        # no mask). Nothing is loaded into registers or waited for.
        pid, parts = tl.program_id(0), tl.num_programs(0)
        for start in range(pid * STEP * CHUNK, n, parts * STEP * CHUNK):
            at = start + tl.arange(0, STEP) * CHUNK  # [STEP]
            if BULK:
                size = tl.minimum(tl.maximum(n - at, 0), CHUNK) * 2 // 16 * 16  # bf16 bytes
                if LAST:
                    tl.inline_asm_elementwise(
                        "{ .reg .pred ask; .reg .b64 policy; setp.ne.u32 ask, $2, 0; "
                        "createpolicy.fractional.L2::evict_last.b64 policy, 1.0; "
                        "@ask cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, "
                        "policy; mov.u32 $0, 0; }", "=r,l,r",
                        [src_ptr + at, size.to(tl.int32)], dtype=tl.int32, is_pure=False,
                        pack=1)
                else:
                    tl.inline_asm_elementwise(
                        "{ .reg .pred ask; setp.ne.u32 ask, $2, 0; "
                        "@ask cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                        "=r,l,r", [src_ptr + at, size.to(tl.int32)], dtype=tl.int32,
                        is_pure=False, pack=1)
            elif LAST:
                tl.inline_asm_elementwise(
                    "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                    [src_ptr + tl.minimum(at, n - 1)], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                    [src_ptr + tl.minimum(at, n - 1)], dtype=tl.int32, is_pure=False, pack=1)

    return read, prefetch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=6144, help="the weight's N")
    parser.add_argument("--cols", type=int, default=2048, help="the weight's K")
    parser.add_argument("--stream-mib", type=int, default=100)
    parser.add_argument("--flush-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=20)
    add_persisting_argument(parser)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    check_persisting_argument(parser, args)
    for flag in ("rows", "cols", "stream_mib", "flush_mib", "repeat"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got "
                         f"{getattr(args, flag)}")
    if not torch.cuda.is_available():
        print("bench/l2_keep.py: needs CUDA (it times the device's L2 cache)")
        return 0
    from strata.engine.model import products

    device = torch.device("cuda")
    failed = args.persisting_mib and set_persisting_l2(args.persisting_mib)
    if failed:
        print(f"bench/l2_keep.py: setting aside {args.persisting_mib} MiB of L2 failed: {failed}")
        return 1
    read, prefetch = _kernels()
    programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    sums = torch.empty(programs, dtype=torch.float32, device=device)
    weight = torch.randn(args.rows, args.cols, dtype=torch.bfloat16, device=device)
    x = torch.randn(1, args.cols, dtype=torch.bfloat16, device=device)
    stream = torch.ones((args.stream_mib << 20) // 2, dtype=torch.bfloat16, device=device)
    flush = torch.ones((args.flush_mib << 20) // 2, dtype=torch.bfloat16, device=device)

    def reads(tensor, evict=""):
        return lambda: read[(programs,)](tensor, sums, tensor.numel(), BLOCK=BLOCK,
                                         EVICT=evict)

    def prefetches(tensor, n_programs, method, last):
        return lambda: prefetch[(n_programs,)](
            tensor, tensor.numel(), CHUNK=CHUNK_BYTES[method] // 2, STEP=STEP,
            BULK=method == "bulk", LAST=last, num_warps=8)

    before = {
        "cold": [reads(flush)],
        "hot": [reads(flush), reads(weight)],
        "kept, stream evict_first": [reads(flush), reads(weight, "evict_last"),
                                     reads(stream, "evict_first")],
        "kept, stream plain": [reads(flush), reads(weight, "evict_last"), reads(stream)],
        "weight plain, stream evict_first": [reads(flush), reads(weight),
                                             reads(stream, "evict_first")],
    }
    methods = [(method, last, n) for method in CHUNK_BYTES for last in (True, False)
               for n in PREFETCH_PROGRAMS]

    def named(method, last, n):
        return f"{method}{' evict_last' if last else ''}, {n}"

    for method, last, n in methods:
        asks = prefetches(weight, n, method, last)
        before[f"prefetched ({named(method, last, n)}), stream evict_first"] = [
            reads(flush), asks, reads(stream, "evict_first")]
        before[f"prefetched ({named(method, last, n)}), at once"] = [reads(flush), asks]
    timed = {name: (steps, lambda: products.linear(x, weight, None))
             for name, steps in before.items()}
    for method, last, n in methods:
        timed[f"prefetch alone ({named(method, last, n)})"] = (
            [reads(flush)], prefetches(weight, n, method, last))
    timed["stream plain"] = ([reads(flush)], reads(stream))
    timed["stream evict_first"] = ([reads(flush)], reads(stream, "evict_first"))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    us = {name: [] for name in timed}
    for _ in range(args.repeat + 1):  # the first round warms up (compiles), untimed
        for name, (steps, fn) in timed.items():
            for step in steps:
                step()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            us[name].append(1000 * start.elapsed_time(end))
    median = {name: statistics.median(times[1:]) for name, times in us.items()}
    weight_bytes = weight.numel() * 2
    rows = []
    for name, value in median.items():
        base = median["stream plain" if name.startswith("stream") else "cold"]
        if name.startswith("prefetch alone"):
            base = value  # its own time: how long the programs take to ask
        moved = stream.numel() * 2 if name.startswith("stream") else weight_bytes
        rows.append({"case": name, "us": value, "x_base": base / value,
                     "gb_s": moved / value / 1e3})
        print(f"{name:<56} {value:8.2f} us  {base / value:5.2f}x  {moved / value / 1e3:7.0f} "
              f"GB/s")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "weight": [args.rows, args.cols],
            "stream_mib": args.stream_mib, "flush_mib": args.flush_mib,
            "persisting_mib": args.persisting_mib,
            "repeat": args.repeat}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
