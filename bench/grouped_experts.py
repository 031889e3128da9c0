"""Time the decode experts of one layer call: the Triton kernels against the gathered path.

`strata.engine.experts.grouped.expert_rows` runs the K routed experts of one token from stacked
weights. Its gathered path copies the K experts' weights out (`index_select`) and runs two
batched matmuls; its Triton kernels read them in place. The floor is reading the K experts'
weights once (K * 3 * F * D * itemsize bytes) at the device's memory bandwidth.

For each shape (a preset's F, D, E, K), each variant runs over `--stacks` stacks of E experts
(rotated, so that the K experts of a call are not in the last-level cache from the call before)
with fresh random routing per stack; each call is captured in a CUDA graph and its replays timed
with CUDA events (median of `--repeat`), so launch gaps stay out of the numbers; `eager ms`
times the same calls launched one by one, launches included. Variants: the
gathered path, and the Triton kernels at several block sizes (the first is the default). A
check against the gathered path runs before timing. Then the same experts quantized
(`strata.engine.experts.quant`: int8, int4 in groups of 32) through their Triton kernels
(`strata.engine.experts.quantized`): GB/s of the bytes each format reads, time against the
bf16 gathered path, and the error against it (quantization included). With `--valid-rows
N,...`, the quantized kernels again over K + 1 rows of which only N name an expert (the others
-1: a split decode call's hits, `graph_call.resident_rows`, or its few staged misses), GB/s of
the N experts' bytes: the launch shape of the hits' and staged experts' calls in a round with
most experts in host RAM.

    python bench/grouped_experts.py                     # CUDA only
    python bench/grouped_experts.py --json
    python bench/grouped_experts.py --presets qwen3-30b-a3b --valid-rows 2,3
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

from strata.engine.experts.grouped import (
    DOWN_BLOCK_D,
    DOWN_BLOCK_F,
    GATE_UP_BLOCK_D,
    GATE_UP_BLOCK_F,
    NUM_WARPS,
    expert_rows_gathered,
    expert_rows_triton,
)
from strata.engine.experts.quant import make_blob
from strata.engine.experts.quantized import quantized_rows_triton
from strata.engine.model.presets import get_preset

QUANTIZED = ("int8", "int4-g32")
# The quantized kernels' (act, down) blocks tried: the default first; steps of at least 64 (an
# int4 group). The last three take a whole row of olmoe's and qwen3's experts in one step (D
# 2048, F up to 1024): a program's whole tile in flight at once, for a split call's few valid
# rows, whose few programs leave the memory idle at 512-byte steps (0.4 TB/s on the H200,
# note 2026-12-04e). Compiled for sm_90 none of them spills registers (96 a thread at most for
# int8 at 8 rows, 255 at 16).
QUANT_BLOCKS = [((8, 512), (8, 512)), ((16, 256), (16, 256)), ((32, 256), (32, 256)),
                ((16, 512), (16, 512)), ((4, 1024), (4, 1024)), ((32, 128), (32, 128)),
                ((4, 2048), (4, 1024)), ((8, 2048), (8, 1024)), ((16, 2048), (16, 1024))]

# The bf16 kernels' variants tried, the default first: (gate_up blocks, down blocks, warps of
# a gate_up and of a down program).
BLOCKS = [((GATE_UP_BLOCK_F, GATE_UP_BLOCK_D), (DOWN_BLOCK_D, DOWN_BLOCK_F), NUM_WARPS)]
BLOCKS += [(gate_up, down, warps)
           for warps in ((4, 4), (8, 8))
           for gate_up, down in (((16, 256), (16, 256)), ((8, 256), (8, 256)),
                                 ((32, 128), (32, 128)), ((8, 512), (8, 512)),
                                 ((32, 256), (32, 256)), ((16, 512), (32, 128)))
           if (gate_up, down, warps) != BLOCKS[0]]


def time_graph(call, repeat: int) -> float:
    """Median ms of one replay of `call` captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_eager(call, repeat: int) -> float:
    """Median ms of `call` launched eagerly, host clock from launch to the device done: what a
    round without graphs pays, launches included."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def partial_rows(index: torch.Tensor, x_rows: torch.Tensor, reference: torch.Tensor,
                 n_valid: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A call of K + 1 rows of which the last `n_valid` are index[:n_valid]'s experts and the
    others -1 (nothing read, zeros out): its index [K + 1], its x rows [K + 1, D] (one token)
    and its expected rows from the K rows' `reference` [K, D]."""
    k, d = x_rows.shape
    n_empty = k + 1 - n_valid
    return (torch.cat((index.new_full((n_empty,), -1), index[:n_valid])),
            x_rows[:1].expand(k + 1, d),
            torch.cat((reference.new_zeros((n_empty, d)), reference[:n_valid])))


def measure(preset_name: str, n_stacks: int, repeat: int, dtype: torch.dtype,
            valid_rows: tuple[int, ...] = (), device: torch.device | None = None) -> dict:
    """Every variant's row for the preset's shape, on `device` (None: CUDA; the tests run it
    on the CPU under Triton's interpreter, with the timers stubbed)."""
    preset = get_preset(preset_name)
    f, d, e, k = preset.expert_width, preset.hidden_size, preset.n_experts, preset.top_k
    cuda = torch.device("cuda") if device is None else device
    gen = torch.Generator(device=cuda).manual_seed(0)
    stacks = []
    for _ in range(n_stacks):
        blobs = torch.randn(e, 3 * f * d, device=cuda, generator=gen).div_(d**0.5).to(dtype)
        index = torch.randperm(e, device=cuda, generator=gen)[:k]
        x_rows = torch.randn(1, d, device=cuda, generator=gen).to(dtype).expand(k, d)
        stacks.append((blobs[:, : 2 * f * d].unflatten(1, (2 * f, d)),
                       blobs[:, 2 * f * d :].unflatten(1, (d, f)), index, x_rows))
    floor_bytes = k * 3 * f * d * dtype.itemsize

    def rotated(run, over=stacks):
        def call():
            for stack in over:
                run(*stack)
        return call

    variants = {"gathered": expert_rows_gathered}
    for gate_up_blocks, down_blocks, warps in BLOCKS:
        name = (f"triton {gate_up_blocks[0]}x{gate_up_blocks[1]} / {down_blocks[0]}x"
                f"{down_blocks[1]} w{warps[0]},{warps[1]}")
        variants[name] = (lambda g, dn, i, x, gb=gate_up_blocks, db=down_blocks, nw=warps:
                          expert_rows_triton(g, dn, i, x, gate_up_blocks=gb, down_blocks=db,
                                             num_warps=nw))
    reference = [expert_rows_gathered(*stack).float() for stack in stacks]
    rows = []
    for name, run in variants.items():
        error = max(((run(*stack).float() - ref).norm() / ref.norm()).item()
                    for stack, ref in zip(stacks, reference, strict=True))
        ms = time_graph(rotated(run), repeat) / n_stacks
        rows.append({"variant": name, "ms_per_call": ms, "relative_error": error,
                     "gb_per_s": floor_bytes / ms / 1e6,
                     "eager_ms_per_call": time_eager(rotated(run), repeat) / n_stacks})
    for fmt in QUANTIZED:
        quantized = []  # per stack (blobs uint8 [E, bytes], index, x_rows)
        for gate_up, down, index, x_rows in stacks:
            blobs = torch.stack([make_blob(fmt, g[:f], g[f:], dn)
                                 for g, dn in zip(gate_up, down, strict=True)])
            quantized.append((blobs, index, x_rows))

        calls = [("", k, quantized, reference)]  # (label, experts read, stacks, references)
        for n_valid in valid_rows:
            partial = [partial_rows(index, x_rows, ref, n_valid)
                       for (_, index, x_rows), ref in zip(quantized, reference, strict=True)]
            calls.append((f" {n_valid} of {k + 1} rows", n_valid,
                          [(blobs, index, x_rows) for (blobs, _, _), (index, x_rows, _)
                           in zip(quantized, partial, strict=True)],
                          [expected for _, _, expected in partial]))
        for label, n_read, stacks_of, references in calls:
            read = n_read * quantized[0][0].shape[1]
            for act_blocks, down_blocks in QUANT_BLOCKS:
                def run(blobs, index, x_rows, fmt=fmt, ab=act_blocks, db=down_blocks):
                    return quantized_rows_triton(blobs, fmt, index, x_rows, f, act_blocks=ab,
                                                 down_blocks=db)

                error = max(((run(*stack).float() - ref).norm() / ref.norm()).item()
                            for stack, ref in zip(stacks_of, references, strict=True))
                ms = time_graph(rotated(run, stacks_of), repeat) / n_stacks
                rows.append({"variant": f"{fmt} {act_blocks[0]}x{act_blocks[1]} / "
                                        f"{down_blocks[0]}x{down_blocks[1]}{label}",
                             "ms_per_call": ms, "relative_error": error,
                             "gb_per_s": read / ms / 1e6,
                             "eager_ms_per_call": time_eager(rotated(run, stacks_of), repeat)
                             / n_stacks})
    gathered = rows[0]["ms_per_call"]
    for row in rows:
        row["speedup_over_gathered"] = gathered / row["ms_per_call"]
    return {"preset": preset.name, "F": f, "D": d, "E": e, "K": k, "dtype": str(dtype),
            "floor_bytes": floor_bytes, "variants": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="olmoe-1b-7b,qwen3-30b-a3b")
    parser.add_argument("--stacks", type=int, default=8, help="stacks rotated between calls")
    parser.add_argument("--repeat", type=int, default=50, help="timed replays (median)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.add_argument("--valid-rows", default="",
                        help="comma-separated N: the quantized kernels also over K + 1 rows of "
                        "which N name an expert (a split decode call's hits or staged misses)")
    args = parser.parse_args(argv)
    presets = [get_preset(name) for name in args.presets.split(",")]
    try:
        valid_rows = tuple(int(n) for n in args.valid_rows.split(",") if n.strip())
    except ValueError:
        parser.error(f"--valid-rows takes comma-separated ints, got {args.valid_rows!r}")
    top_k = min(preset.top_k for preset in presets)
    bad = [n for n in valid_rows if not 1 <= n <= top_k]
    if bad:
        parser.error(f"--valid-rows: each N must be within [1, K] (K = {top_k}), got {bad[0]}")
    if not torch.cuda.is_available():
        print("bench/grouped_experts.py: needs CUDA (the kernels are Triton's)", file=sys.stderr)
        return 2
    results = [measure(preset.name, args.stacks, args.repeat, torch.bfloat16, valid_rows)
               for preset in presets]
    document = {"device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
                "date": datetime.date.today().isoformat(), "results": results}
    if args.json:
        print(json.dumps(document))
        return 0
    print(f"decode experts of one layer call, {document['device_name']}, bf16, CUDA-graph "
          f"replays, medians of {args.repeat}")
    for result in results:
        print(f"{result['preset']}: K={result['K']} of E={result['E']}, F={result['F']}, "
              f"D={result['D']}: floor {result['floor_bytes'] / 2**20:.0f} MiB read")
        print(f"  {'variant':<52}{'ms/call':>9}{'GB/s':>8}{'x gathered':>12}{'rel err':>10}"
              f"{'eager ms':>10}")
        for row in result["variants"]:
            print(f"  {row['variant']:<52}{row['ms_per_call']:>9.4f}{row['gb_per_s']:>8.0f}"
                  f"{row['speedup_over_gathered']:>12.2f}{row['relative_error']:>10.1e}"
                  f"{row['eager_ms_per_call']:>10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
