"""Helpers the benchmarks share (each script puts bench/ on sys.path by being run from it)."""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from strata.engine.cache.arena import slot_bytes_for
from strata.engine.cache.budget import MIB
from strata.engine.model.config import ModelConfig
from strata.engine.model.init_model import write_checkpoint
from strata.engine.model.presets import BYTE_TOKENS, get_preset


def sync(device: torch.device) -> None:
    """Wait for the device, so that a host clock read after it covers the device's work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_read_bytes_per_s(mib: int, repeat: int = 5) -> float:
    """Bytes a second a torch float32 sum reads from a `mib` MiB buffer on torch's threads:
    the host's read bandwidth as the benchmarks compare the CPU's experts with it (the best of
    `repeat`, after an untimed one)."""
    buffer = torch.ones((mib << 20) // 4, dtype=torch.float32)
    buffer.sum()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / min(times)


# The H200's rates as issue 16 states its bound (2.37 GB a token at 4.3 TB/s), from earlier
# measurements: its device-to-device copy rate and its bf16 matrix rate.
H200_BANDWIDTH_GBS = 4300.0
H200_MATMUL_TFLOPS = 790.0


class DeviceRates(NamedTuple):
    """A device's rates for a decode bound and a MoE share, and the ones measured in the run."""
    bandwidth_gbs: float  # what the bound divides by
    matmul_tflops: float  # what the MoE share divides by
    source: str  # where those two come from
    measured_copy_gbs: float  # a device-to-device copy's bytes read and written a second
    measured_matmul_tflops: float  # a bf16 product's


def device_rates(device: torch.device, copy_mib: int = 1024,
                 matmul_n: int = 8192) -> DeviceRates:
    """`device`'s rates: on an H200 the constants above (issue 16's bound); on any other device
    the ones measured now, the best of 5 after a warm-up: a copy of `copy_mib` MiB from one
    buffer to another (its bytes read and written) and a [n, n] @ [n, n] bf16 product. Both
    are measured on an H200 too and returned beside its constants, to compare them."""
    copy_gbs, matmul_tflops = _copy_gbs(device, copy_mib), _matmul_tflops(device, matmul_n)
    free_memory(device)  # the buffers (2 GiB by default), before the engines load
    if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device):
        return DeviceRates(H200_BANDWIDTH_GBS, H200_MATMUL_TFLOPS,
                           "the H200's (issue 16's bound)", copy_gbs, matmul_tflops)
    return DeviceRates(copy_gbs, matmul_tflops, "measured in this run", copy_gbs, matmul_tflops)


def _copy_gbs(device: torch.device, mib: int) -> float:
    src = torch.ones((mib << 20) // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # a warm-up, untimed
    return 2 * src.numel() * 4 / min(wall_times_s(lambda: dst.copy_(src), device, 5)) / 1e9


def _matmul_tflops(device: torch.device, n: int) -> float:
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    a @ a  # a warm-up, untimed
    return 2 * n**3 / min(wall_times_s(lambda: a @ a, device, 5)) / 1e12


def wall_times_s(fn, device: torch.device, repeat: int) -> list[float]:
    """Wall seconds of each of `repeat` calls of fn(), the device synced around each."""
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def side_by_side(rounds: list, device: torch.device, sweeps: int) -> list[dict]:
    """Time rounds (each a function: one decode round, a graph's replay) against the first,
    the default: `sweeps` sweeps over all of them, each sweep in the other order than the one
    before, so that a drift of the machine during the run (seen: 5-10% between rows timed
    minutes apart) falls on every round alike. Each timed call follows an untimed call of the
    same round, so that it finds the device as a decode loop leaves it, after a round of its
    own, not as the round timed before left it (an eager round before the default's, in every
    other sweep, left it 2-4% slower than the same graph captured again:
    bench/results/profile-control-h100-2026-12-06.md). For each round: "ms", the median of its
    calls; "x_default", the median over the sweeps of the default's call over its own in the
    same sweep (above 1: faster than the default); "x_default_q", that ratio's first and third
    quartiles (quartiles that take in 1: not told apart from the default)."""
    times: list[list[float]] = [[] for _ in rounds]
    order = list(range(len(rounds)))
    for sweep in range(sweeps):
        for i in order if sweep % 2 == 0 else order[::-1]:
            rounds[i]()  # the round before it: untimed
            times[i].append(wall_times_s(rounds[i], device, 1)[0])
    figures = []
    for seconds in times:
        ratios = [base / own for base, own in zip(times[0], seconds, strict=True)]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        figures.append({"ms": 1e3 * statistics.median(seconds),
                        "x_default": statistics.median(ratios),
                        "x_default_q": [quartiles[0], quartiles[2]]})
    return figures


def set_persisting_l2(mib: int) -> str | None:
    """Set aside `mib` MiB of the current CUDA device's L2 cache for lines marked evict_last
    (the context's persisting L2 limit, 0 by default; the driver rounds it to what the device
    allows): None, or the driver's error as text."""
    from cuda.bindings import driver

    torch.cuda.init()  # the primary context the limit is set on
    (err,) = driver.cuCtxSetLimit(driver.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, mib << 20)
    return None if err == driver.CUresult.CUDA_SUCCESS else str(err)


def add_persisting_argument(parser: argparse.ArgumentParser) -> None:
    """`--persisting-mib`: `set_persisting_l2` before timing (0: leave the limit as it is)."""
    parser.add_argument("--persisting-mib", type=int, default=0,
                        help="set aside this much of L2 for lines marked evict_last (the "
                        "context's persisting L2 limit) before timing; 0 leaves it as is")


def check_persisting_argument(parser: argparse.ArgumentParser, args) -> None:
    """Refuse a negative `--persisting-mib` by name."""
    if args.persisting_mib < 0:
        parser.error(f"--persisting-mib must be at least 0, got {args.persisting_mib}")


def mem_available_bytes() -> int:
    """The host's MemAvailable (/proc/meminfo): what an allocation took is its drop across it
    (torch's pinned blocks are rounded up to powers of two; `host_blobs`' are not)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def rss_bytes() -> int:
    """This process's resident memory (VmRSS of /proc/self/status): exact for what it touched,
    where MemAvailable moves with the page cache too."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def median_ms(fn, repeat: int, cuda: bool = False) -> float:
    """Milliseconds `fn()` takes, the median of `repeat` after one warm-up: CUDA events around
    each call when `cuda` (the device's time of what it queues), else the host's clock."""
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


def free_memory(device: torch.device) -> None:
    """Let the engine just measured give its device memory back before the next one loads."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def engine_around(model, kv, max_context: int, kv_dtype: torch.dtype | None = None):
    """An `Engine` over `model`, whose experts the caller swapped for a fresh expert cache
    (`build_cached_experts` on the store every variant shares, not a checkpoint loaded again
    per variant), with `kv` the elastic K/V started beside it or None (then a fixed K/V whose
    cells are `kv_dtype`, None: the model's dtype). Closing it closes the K/V, the cache and
    the cache's backend, not the store, which stays page-locked for the next variant's cache
    (the caller closes it after the last); the caller then sets `model.experts` to None."""
    from strata.engine.runtime.engine import Engine
    from strata.engine.runtime.load import Loaded

    return Engine(Loaded(model, model.experts, kv, owns_store=False), None,
                  max_context=max_context, kv_dtype=kv_dtype)


def fresh_request(engine, prompt: list[int], options):
    """`engine.generate` of `prompt` read whole: the live conversation forgotten first, so that
    a repeated request measures its prefill, not the engine's reuse of the one before."""
    engine.reset()
    return engine.generate(prompt, options)


def cli_sampling() -> dict:
    """`strata generate`'s sampling options when none are given (temperature, top_p, top_k,
    seed), read from its parser so that the figure follows the CLI."""
    from strata.cli import generate as cli_generate

    subparsers = argparse.ArgumentParser().add_subparsers()
    cli_generate.register(subparsers)
    parser = subparsers.choices["generate"]
    return {name: parser.get_default(name) for name in ("temperature", "top_p", "top_k", "seed")}


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


def add_proportion_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint (`--model` or a written one) and the budget and window around it, by
    default in the reference engine's proportions (`proportions`)."""
    parser.add_argument("--model", help="a checkpoint directory to use instead of writing one")
    parser.add_argument("--budget-mib", type=float, help="--vram-budget-mib (default: the "
                        "experts' bytes / --expert-multiple)")
    parser.add_argument("--expert-multiple", type=float, default=3.0)
    parser.add_argument("--reserve-mib", type=float, help="--vram-reserve-mib")
    parser.add_argument("--max-context", type=int, help="default: the window whose K/V is "
                        "--kv-share of the budget")
    parser.add_argument("--kv-share", type=float, default=0.25)


def checkpoint_for(args, tmp: Path, dtype: torch.dtype, progress: bool = False) -> Path:
    """`--model`, or a random checkpoint of `--preset` written under `tmp`."""
    if args.model:
        return Path(args.model)
    preset = get_preset(args.preset)
    return write_checkpoint(tmp / "ckpt", args.family or preset.default_family, preset,
                            n_layers=args.layers, dtype=dtype, progress=progress,
                            router_skew=args.router_skew)


def proportions(cfg: ModelConfig, dtype: torch.dtype, args) -> tuple[float, int, dict]:
    """(budget MiB, max_context, figures): the reference engine's proportions by default."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    experts = cfg.n_layers * cfg.n_experts * slot_bytes_for(
        3 * cfg.expert_width * cfg.hidden_size * itemsize)
    budget_mib = args.budget_mib or experts / args.expert_multiple / MIB
    cell = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize  # every segment
    max_context = args.max_context or int(args.kv_share * budget_mib * MIB // cell) // 256 * 256
    figures = {"experts_mib": experts / MIB, "budget_mib": budget_mib,
               "experts_over_budget": experts / (budget_mib * MIB),
               "window_kv_mib": max_context * cell / MIB,
               "window_kv_share": max_context * cell / (budget_mib * MIB)}
    return budget_mib, max_context, figures


# The elastic K/V's and the memory's settings a benchmark takes as flags: (flag dest, variable).
KV_ENV_FLAGS = (("kv_init", "STRATA_KV_GROW_INIT"), ("kv_step", "STRATA_KV_GROW_STEP"),
                ("kv_floor", "STRATA_KV_GROW_FLOOR"), ("loan_keep_slots", "STRATA_LOAN_KEEP_SLOTS"),
                ("chunk_bytes", "STRATA_VMM_CHUNK_BYTES"))


def add_kv_env_arguments(parser: argparse.ArgumentParser) -> None:
    """`--kv-init`, `--kv-step`, `--kv-floor`, `--loan-keep-slots`, `--chunk-bytes`: each sets
    its STRATA_* variable for the run (`set_kv_env`)."""
    for dest, env in KV_ENV_FLAGS:
        parser.add_argument("--" + dest.replace("_", "-"), type=int, help=f"sets {env}")


def set_kv_env(args: argparse.Namespace) -> None:
    """Set the STRATA_* variable of each `add_kv_env_arguments` flag given."""
    for dest, env in KV_ENV_FLAGS:
        if getattr(args, dest) is not None:
            os.environ[env] = str(getattr(args, dest))


def rows_at_once(text: str) -> list[tuple[int, int]] | None:
    """Comma-separated GxD, each the CPU kernel's gate and up rows and down rows read at once
    (`CpuExperts.gate_up_rows`, `down_rows`: 1, 2 or 4 each), distinct, as (G, D) pairs; None
    for anything else (the caller's parser names the flag)."""
    pairs = []
    for spec in filter(None, text.split(",")):
        gate_up, _, down = spec.partition("x")
        if gate_up not in ("1", "2", "4") or down not in ("1", "2", "4"):
            return None
        pairs.append((int(gate_up), int(down)))
    return pairs if len(set(pairs)) == len(pairs) else None


def down_block_rows(text: str) -> list[int] | None:
    """Comma-separated rows of down a pass-2 task of the CPU kernel reads
    (`CpuExperts.down_block_rows`: multiples of 16 from 16 to 1024), distinct; None for
    anything else (the caller's parser names the flag)."""
    specs = [spec for spec in text.split(",") if spec]
    if not all(spec.isdigit() for spec in specs):
        return None
    counts = [int(spec) for spec in specs]
    valid = all(n % 16 == 0 and 16 <= n <= 1024 for n in counts)
    return counts if valid and len(set(counts)) == len(counts) else None
