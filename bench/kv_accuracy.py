"""Measure what int8 K/V cells cost in accuracy: next-token distributions against the model's.

Loads a checkpoint (`--model`, or one written from `--preset`) in `--dtype` once, reads one
prompt of `--positions` seeded byte tokens with the K/V's cells in the model's dtype and keeps
its next-token distributions, then reads it again with the cells in each dtype of
`--kv-dtypes` (`bf16`, `int8`: a float32 scale per cell and kv head) and compares, per
position, with `bench/quant_accuracy.py`'s helpers:

- top-1 agreement: the share of positions whose most likely next token is the reference's;
- KL(reference || K/V dtype) of the next-token distributions, mean and largest;
- greedy tokens: `--greedy-tokens` generated from the prompt's first 16 tokens by both (the
  prompt read at once, then one token a forward), and how many agree before the first
  difference.

The weights are the same on both sides, so only the K/V's cells differ. `--dtype bf16`
compares int8 with the bf16 cells the GPU runs; `--dtype fp32 --kv-dtypes bf16,int8` sets
int8's distance beside bf16's own from float32 cells. Random weights (every preset and the
tests' parity checkpoints) give flatter distributions than a trained model's.

    python bench/kv_accuracy.py --preset tiny                          # here, seconds
    python bench/kv_accuracy.py --preset olmoe-1b-7b --layers 2 --dtype fp32 --kv-dtypes bf16,int8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from _common import byte_tokens
from quant_accuracy import (
    GREEDY_PROMPT_TOKENS,
    _common_prefix,
    add_comparison_arguments,
    compare,
    compared,
    comparison_checkpoint,
    greedy,
    prompt_logits,
    report,
)
from strata.engine.model.kv_cells import cell_dtype_of, kv_dtype_name
from strata.engine.model.moe import load_model

KV_CHOICES = ("bf16", "int8")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def measure(path: Path, device: torch.device, dtype: torch.dtype, kv_dtypes: list[str],
            positions: int, greedy_tokens: int) -> dict:
    """The comparison of each of `kv_dtypes` with the model-dtype cells, on one loaded model."""
    prompt = byte_tokens(positions, seed=0)
    model = load_model(path, device=device, dtype=dtype)
    reference = prompt_logits(model, prompt)
    reference_greedy = greedy(model, prompt[:GREEDY_PROMPT_TOKENS], greedy_tokens)
    results = {}
    for name in kv_dtypes:
        cells = cell_dtype_of(name, dtype)
        tokens = greedy(model, prompt[:GREEDY_PROMPT_TOKENS], greedy_tokens, cells)
        results[name] = {**compare(reference, prompt_logits(model, prompt, cells)),
                         "greedy_equal_prefix": _common_prefix(reference_greedy, tokens)}
    config = model.config
    return {"family": config.family, "layers": config.n_layers, "kv_heads": config.n_kv_heads,
            "head_dim": config.head_dim, "reference_kv_dtype": kv_dtype_name(dtype),
            "kv_dtypes": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_comparison_arguments(parser, "kv-dtypes", "int8", KV_CHOICES)
    args = parser.parse_args(argv)
    kv_dtypes = compared(parser, args, "kv-dtypes", KV_CHOICES)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    with tempfile.TemporaryDirectory(prefix="strata-bench-kv-accuracy-") as tmp:
        path, source = comparison_checkpoint(args, Path(tmp))
        result = measure(path, device, dtype, kv_dtypes, args.positions, args.greedy_tokens)
    report({"dtype": args.dtype, **result}, args, source,
           f"K/V cells against {result['reference_kv_dtype']} cells: {source} "
           f"({result['family']}, {result['layers']} layers, {result['kv_heads']} kv heads of "
           f"{result['head_dim']}), {args.dtype} compute, {args.positions} positions, "
           f"{args.greedy_tokens} greedy tokens", "K/V", "kv_dtypes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
