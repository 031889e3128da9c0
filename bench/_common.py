"""Helpers the benchmarks share (each script puts bench/ on sys.path by being run from it)."""

from __future__ import annotations

import argparse
import gc

import torch

from strata.engine.presets import BYTE_TOKENS


def sync(device: torch.device) -> None:
    """Wait for the device, so that a host clock read after it covers the device's work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Let the engine just measured give its device memory back before the next one loads."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def byte_tokens(n: int, seed: int) -> list[int]:
    """`n` byte ids every checkpoint's tokenizer knows, fixed by `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, BYTE_TOKENS, (n,), generator=generator).tolist()


def add_model_arguments(parser: argparse.ArgumentParser, preset: str) -> None:
    """Which checkpoint a benchmark writes, and where it runs: preset, family, layers, router
    skew, device, dtype."""
    parser.add_argument("--preset", default=preset)
    parser.add_argument("--family", help="default: the preset's own")
    parser.add_argument("--layers", type=int, help="shorten the preset to N layers")
    parser.add_argument("--router-skew", type=float, default=0.0, metavar="A",
                        help="strata init-model's --router-skew: routing that favours some "
                        "experts in each layer (default 0: about uniform)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
