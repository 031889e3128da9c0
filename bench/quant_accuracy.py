"""Measure what quantized experts cost in accuracy: next-token distributions against the original.

Loads a checkpoint (`--model`, or one written from `--preset`) in float32, reads one prompt of
`--positions` seeded byte tokens and keeps its next-token distributions, then for each format
of `--formats` (`strata.engine.experts.quant.WEIGHT_FORMATS`: int8 per output channel, int4 per
group of 32 or 64 along the input) loads it again, puts each routed expert's weights back as the
format stores them (`fake_quantize`: the values a kernel reading that format computes with) and
compares, per position:

- top-1 agreement: the share of positions whose most likely next token is the original's;
- KL(original || quantized) of the next-token distributions, mean and largest;
- greedy tokens: `--greedy-tokens` generated from the prompt's first 16 tokens by both, and how
  many agree before the first difference.

Float32 compute on both sides, so only the weights differ. Random weights (every preset and the
tests' parity checkpoints) give flatter distributions than a trained model's; the figures say
how far a format moves this model, not a trained one's perplexity.

    python bench/quant_accuracy.py --preset tiny                      # here, seconds
    python bench/quant_accuracy.py --preset olmoe-1b-7b --layers 2 --json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

from _common import add_model_arguments, byte_tokens
from strata.engine.experts import ResidentExperts
from strata.engine.experts.quant import WEIGHT_FORMATS, fake_quantize
from strata.engine.kv.kv_cache import new_kv
from strata.engine.model.init_model import write_checkpoint
from strata.engine.model.moe import MoEModel, load_model
from strata.engine.model.presets import get_preset

GREEDY_PROMPT_TOKENS = 16


def quantize_experts(model: MoEModel, fmt: str) -> None:
    """Each routed expert's gate, up and down put back in place as `fmt` stores them."""
    experts = model.experts
    if not isinstance(experts, ResidentExperts):
        raise TypeError(f"the model's experts must be resident, got {type(experts).__name__}")
    for layer in range(experts.n_layers):
        for weights in (experts.gate_up(layer), experts.down(layer)):  # [E, 2F, D], [E, D, F]
            for matrix in weights:  # per expert: rows are output channels
                matrix.copy_(fake_quantize(matrix, fmt))


def prompt_logits(model: MoEModel, prompt: list[int],
                  cell_dtype: torch.dtype | None = None) -> torch.Tensor:
    """float32 [T, V]: the next-token logits after each prompt position (the K/V's cells in
    `cell_dtype`, None: the model's dtype)."""
    ids = torch.tensor(prompt, device=model.device)
    with new_kv(model, len(prompt), cell_dtype) as kv:
        return model.forward(ids, 0, kv).float().cpu()


def greedy(model: MoEModel, prompt: list[int], n_new: int,
           cell_dtype: torch.dtype | None = None) -> list[int]:
    tokens = list(prompt)
    with new_kv(model, len(prompt) + n_new, cell_dtype) as kv:
        logits = model.forward(torch.tensor(tokens, device=model.device), 0, kv, last_only=True)
        for _ in range(n_new):
            tokens.append(int(logits[-1].argmax()))
            ids = torch.tensor(tokens[-1:], device=model.device)
            logits = model.forward(ids, len(tokens) - 1, kv)
    return tokens[len(prompt):]


def compare(reference: torch.Tensor, quantized: torch.Tensor) -> dict:
    """Top-1 agreement and KL(reference || quantized) over the positions of two [T, V]."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(quantized.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)  # [T]
    agree = (reference.argmax(dim=-1) == quantized.argmax(dim=-1)).double()
    return {"top1_agreement": float(agree.mean()), "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max())}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def measure(path: Path, device: torch.device, formats: list[str], positions: int,
            greedy_tokens: int) -> dict:
    prompt = byte_tokens(positions, seed=0)
    model = load_model(path, device=device, dtype=torch.float32)
    reference = prompt_logits(model, prompt)
    reference_greedy = greedy(model, prompt[:GREEDY_PROMPT_TOKENS], greedy_tokens)
    config = model.config
    del model
    results = {}
    for fmt in formats:
        model = load_model(path, device=device, dtype=torch.float32)
        quantize_experts(model, fmt)
        tokens = greedy(model, prompt[:GREEDY_PROMPT_TOKENS], greedy_tokens)
        results[fmt] = {**compare(reference, prompt_logits(model, prompt)),
                        "greedy_equal_prefix": _common_prefix(reference_greedy, tokens)}
        del model
    return {"family": config.family, "layers": config.n_layers, "experts": config.n_experts,
            "top_k": config.top_k, "formats": results}


def add_comparison_arguments(parser: argparse.ArgumentParser, what: str, default: str,
                             choices: tuple[str, ...]) -> None:
    """The flags every accuracy comparison takes: the model, `--<what>` (comma-separated of
    `choices`), the positions, the greedy tokens, `--json`."""
    add_model_arguments(parser, preset="tiny")
    parser.add_argument("--model", help="a checkpoint directory instead of a written preset")
    parser.add_argument(f"--{what}", default=default,
                        help=f"comma-separated, of {', '.join(choices)} ({default})")
    parser.add_argument("--positions", type=int, default=256,
                        help="prompt tokens, each a next-token distribution compared (256)")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")


def compared(parser: argparse.ArgumentParser, args: argparse.Namespace, what: str,
             choices: tuple[str, ...]) -> list[str]:
    """`--<what>`'s values, every other flag checked (the parser's error otherwise)."""
    given = getattr(args, what.replace("-", "_"))
    values = [v for v in given.split(",") if v]
    if not values or set(values) - set(choices):
        parser.error(f"--{what} takes {', '.join(choices)}; got {given!r}")
    if args.positions < GREEDY_PROMPT_TOKENS or args.greedy_tokens < 1:
        parser.error(f"--positions must be >= {GREEDY_PROMPT_TOKENS} and --greedy-tokens >= 1")
    return values


def comparison_checkpoint(args: argparse.Namespace, tmp: Path) -> tuple[Path, str]:
    """(the checkpoint, how the report names it): `--model`, or the preset written in `tmp`."""
    if args.model:
        return Path(args.model), args.model
    preset = get_preset(args.preset)
    path = write_checkpoint(tmp / "ckpt", args.family or preset.default_family, preset,
                            n_layers=args.layers, router_skew=args.router_skew)
    return path, f"preset {args.preset}" + (f", {args.layers} layers" if args.layers else "")


def report(result: dict, args: argparse.Namespace, source: str, title: str, column: str,
           key: str) -> dict:
    """`result` with the run's context; printed as one JSON line or as a table titled `title`
    (rows `result[key]`, named in a column `column`)."""
    result = {"model": source, "device": args.device, "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(),
              "date": datetime.date.today().isoformat(), "positions": args.positions,
              "greedy_tokens": args.greedy_tokens, **result}
    if args.json:
        print(json.dumps(result))
        return result
    print(title)
    print(f"{column:<10}{'top-1 agree':>12}{'KL mean':>12}{'KL max':>12}{'greedy equal':>14}")
    for name, r in result[key].items():
        print(f"{name:<10}{r['top1_agreement']:>12.4f}{r['kl_mean']:>12.2e}{r['kl_max']:>12.2e}"
              f"{r['greedy_equal_prefix']:>9} / {args.greedy_tokens}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_comparison_arguments(parser, "formats", ",".join(WEIGHT_FORMATS), WEIGHT_FORMATS)
    args = parser.parse_args(argv)
    formats = compared(parser, args, "formats", WEIGHT_FORMATS)
    with tempfile.TemporaryDirectory(prefix="strata-bench-quant-") as tmp:
        path, source = comparison_checkpoint(args, Path(tmp))
        result = measure(path, torch.device(args.device), formats, args.positions,
                         args.greedy_tokens)
    report(result, args, source,
           f"quantized experts against the original: {source} ({result['family']}, "
           f"{result['layers']} layers, {result['experts']} experts, top-{result['top_k']}), "
           f"float32, {args.positions} positions, {args.greedy_tokens} greedy tokens",
           "format", "formats")
    return 0


if __name__ == "__main__":
    sys.exit(main())
