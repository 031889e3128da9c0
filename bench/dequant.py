"""A batch of quantized experts dequantized: the Triton kernels against torch's arithmetic.

`strata.engine.experts.quant.dequantize_blobs` turns a batch of int8 or int4 blobs into the
weights they stand for in the compute dtype (`BlobStack.grouped_rows` and `each_weights` call it
once a batch of `dequant_batch` blobs). On CUDA it runs `dequantize_blobs_triton`, each weight
read once and written once; `dequantize_blobs_torch`, the path elsewhere, widens the integers to
a float32 copy, multiplies it into another, then casts: about five passes over memory. Both give
the same bytes (checked here on CUDA; `same bytes` is - where nothing was compared). Beside
them, a copy of the weights' bytes in the compute dtype (read and written once: more bytes than
the kernels move, so a kernel at the memory's rate takes less), and the kernels' rate over the
bytes they read and write. Timed on `--device` (CUDA events there, the host's clock on the CPU,
where only torch's path runs), median of `--repeat` after one warm-up.

    python bench/dequant.py --preset qwen3-30b-a3b --formats int8,int4-g32
    python bench/dequant.py --device cuda --json-out dequant.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

import torch

from _common import median_ms
from strata.engine.experts.blobs import dequant_batch
from strata.engine.experts.quant import (
    WEIGHT_FORMATS,
    blob_bytes,
    dequantize_blobs_torch,
    dequantize_blobs_triton,
    make_blob,
)
from strata.engine.model.presets import get_preset


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
    kernels = device.type == "cuda"  # the interpreter on the CPU would time Python
    # one batch, as the prompt path dequantizes it on CUDA (the kernels' batch: bf16 only);
    # torch's path, timed on the same blobs, would take a third of them at once
    n_blobs = dequant_batch(f, d, torch.bfloat16.itemsize + (0 if kernels else 4))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for fmt in formats:
        one = make_blob(fmt, torch.randn(f, d, generator=gen), torch.randn(f, d, generator=gen),
                        torch.randn(d, f, generator=gen))
        blobs = one.expand(n_blobs, -1).contiguous().to(device)  # [B, blob]
        want = dequantize_blobs_torch(blobs, fmt, f, d, torch.bfloat16)
        weights = torch.cat([w.reshape(-1) for w in want])  # the copy's source
        steps = {"torch": lambda fmt=fmt, blobs=blobs: dequantize_blobs_torch(
                     blobs, fmt, f, d, torch.bfloat16),
                 "copy": weights.clone}
        same = None  # nothing to compare where the kernels do not run
        if kernels:
            got = dequantize_blobs_triton(blobs, fmt, f, d, torch.bfloat16)
            same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            steps["kernels"] = lambda fmt=fmt, blobs=blobs: dequantize_blobs_triton(
                blobs, fmt, f, d, torch.bfloat16)
        ms = {name: median_ms(fn, args.repeat, kernels) for name, fn in steps.items()}
        moved = n_blobs * blob_bytes(fmt, f, d) + weights.numel() * weights.element_size()
        row = {"format": fmt, "blobs": n_blobs, "same_bytes": same, "ms": ms,
               "bytes_moved": moved}
        if kernels:
            row["kernels_vs_torch"] = ms["kernels"] / ms["torch"]
            row["kernels_vs_copy"] = ms["kernels"] / ms["copy"]
            row["kernels_gb_s"] = moved / ms["kernels"] / 1e6
        rows.append(row)
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
    print("| format | blobs | torch ms | copy of the weights ms | kernels ms | kernels / torch "
          "| kernels / copy | kernels GB/s | same bytes |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        ms = row["ms"]
        kernel_cells = (f"{ms['kernels']:.3f} | {row['kernels_vs_torch']:.2f}x | "
                        f"{row['kernels_vs_copy']:.2f}x | {row['kernels_gb_s']:,.0f}"
                        if "kernels" in ms else "- | - | - | -")
        print(f"| {row['format']} | {row['blobs']} | {ms['torch']:.3f} | {ms['copy']:.3f} | "
              f"{kernel_cells} | {'-' if row['same_bytes'] is None else row['same_bytes']} |")
    return 0 if all(row["same_bytes"] is not False for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
