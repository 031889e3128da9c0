"""The prompt path's dequantization of a batch of quantized experts, against a one-pass candidate.

`strata.engine.experts.quant.dequantize_blobs` turns a batch of int8 or int4 blobs into the
weights they stand for in the compute dtype (`BlobStack.grouped_rows` and `each_weights` call it
once a batch of `dequant_batch` blobs): the integers widened to a float32 copy, multiplied into
another, then cast, about five passes over memory where one would do. On the H200 it is most of
an int8 prompt chunk's expert time (bench/results/offload-int8-h200-2026-12-04.md). The
candidate here (`one_pass`) multiplies the integers by their scales once, writing the compute
dtype; both give the same bytes (checked here too). Timed on `--device` (CUDA events there, the
host's clock on the CPU), median of `--repeat` after one warm-up.

    python bench/dequant.py --preset qwen3-30b-a3b --formats int8,int4-g32
    python bench/dequant.py --device cuda --json-out dequant.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time

import torch

from strata.engine.experts.blobs import dequant_batch
from strata.engine.experts.quant import (
    WEIGHT_FORMATS,
    _unpack_int4,
    blob_bytes,
    dequantize_blobs,
    format_group,
    make_blob,
)
from strata.engine.model.presets import get_preset


def one_pass(blobs, fmt, f, d, dtype):
    """The candidate: each matrix one multiplication of its int8 integers (int8 read in place
    from the blobs' bytes) by its float32 scales, writing `dtype`: torch computes the product in
    float32 and rounds it once as it writes, as the copy's cast does."""
    b, n = blobs.shape[0], 3 * f * d
    blobs = blobs[:, : blob_bytes(fmt, f, d)]
    group = format_group(fmt)
    if not group:
        q = blobs[:, :n].view(torch.int8)  # [B, 3FD]: views of the blobs' bytes
        scales = blobs[:, n:].contiguous().view(torch.float32)  # [B, 2F + D]
        return (_scaled(q[:, : 2 * f * d].unflatten(1, (2 * f, d)), scales[:, : 2 * f, None],
                        dtype),
                _scaled(q[:, 2 * f * d :].unflatten(1, (d, f)), scales[:, 2 * f :, None], dtype))
    packed = blobs[:, : n // 2].contiguous()
    scales = blobs[:, n // 2 :].contiguous().view(torch.float32)  # [B, 3FD / G]
    gate_up_q = _unpack_int4(packed[:, : f * d], 2 * f, d, group)  # [B, 2F, D] int8
    down_q = _unpack_int4(packed[:, f * d :], d, f, group)  # [B, D, F] int8
    gate_up_s = scales[:, : 2 * f * d // group].view(b, 2 * f, d // group)
    down_s = scales[:, 2 * f * d // group :].view(b, d, f // group)
    gate_up = _scaled(gate_up_q.view(b, 2 * f, d // group, group), gate_up_s[..., None], dtype)
    down = _scaled(down_q.view(b, d, f // group, group), down_s[..., None], dtype)
    return gate_up.view(b, 2 * f, d), down.view(b, d, f)


def _scaled(q, scales, dtype):
    """q (int8) times scales (float32, broadcast), computed in float32, written in `dtype`."""
    return torch.mul(q, scales, out=torch.empty(q.shape, dtype=dtype, device=q.device))


def median_ms(fn, repeat: int, cuda: bool) -> float:
    fn()
    times = []
    for _ in range(repeat):
        if cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--formats", default="int8,int4-g32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    if not set(formats) <= set(WEIGHT_FORMATS) or len(set(formats)) != len(formats):
        parser.error(f"--formats takes distinct comma-separated formats of "
                     f"{', '.join(WEIGHT_FORMATS)}, got {args.formats!r}")
    p = get_preset(args.preset)
    f, d, device = p.expert_width, p.hidden_size, torch.device(args.device)
    n_blobs = dequant_batch(f, d)  # one batch, as the prompt path dequantizes it
    gen = torch.Generator().manual_seed(0)
    rows = []
    for fmt in formats:
        one = make_blob(fmt, torch.randn(f, d, generator=gen), torch.randn(f, d, generator=gen),
                        torch.randn(d, f, generator=gen))
        blobs = one.expand(n_blobs, -1).contiguous().to(device)  # [B, blob]
        got, want = (fn(blobs, fmt, f, d, torch.bfloat16)
                     for fn in (one_pass, dequantize_blobs))
        same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        ms = {name: median_ms(lambda fn=fn, blobs=blobs, fmt=fmt: fn(blobs, fmt, f, d,
                                                                   torch.bfloat16),
                              args.repeat, device.type == "cuda")
              for name, fn in (("one_pass", one_pass), ("float32_copy", dequantize_blobs))}
        rows.append({"format": fmt, "blobs": n_blobs, "same_bytes": same, "ms": ms,
                     "ratio": ms["one_pass"] / ms["float32_copy"]})
    result = {"command": "python bench/dequant.py " + " ".join(argv or sys.argv[1:]),
              "preset": args.preset, "device": str(device),
              "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "date": datetime.date.today().isoformat(), "rows": rows}
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(result, out)
    print(f"{result['command']}  ({device}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__})")
    print("| format | blobs | one pass ms | float32 copy ms | one pass / copy | same bytes |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        print(f"| {row['format']} | {row['blobs']} | {row['ms']['one_pass']:.2f} | "
              f"{row['ms']['float32_copy']:.2f} | {row['ratio']:.2f}x | {row['same_bytes']} |")
    return 0 if all(row["same_bytes"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
