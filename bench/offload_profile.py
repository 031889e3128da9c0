"""The requests bench/offload.py runs after a run's timed ones, to see where its time went:
torch's profiler over the device (`--profile`: `round_profile`), cProfile over the host, a
trace with each layer call's host steps marked (`--trace`: `round_trace`), and the same steps
timed by the host's clock alone (`--host-steps`: `round_trace.clocked`). Each runs in the run's
own engine, after its figures were taken, so it changes none of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _common import fresh_request
from round_profile import device_busy, host_functions, per_round
from round_trace import Clock, clocked, trace
from strata.engine.runtime.generate import GenerateOptions


def look_closer(engine: Any, run: dict, name: str, prompt: list[int], args: Any,
                max_context: int) -> None:
    """After a decode run's timed requests, in its engine: `--profile`'s and `--trace`'s
    requests, and the prefetcher's counts where it prefetched, into `run`."""
    if args.profile:
        run["profile"] = profile_decode(engine, prompt, args, max_context,
                                        Path(args.profile) / f"{name}.host.txt")
    if args.trace:
        run["trace"] = trace_decode(engine, prompt, args, max_context,
                                    Path(args.trace) / f"{name}.trace.json.gz")
    if args.host_steps:
        run["host_steps"] = clock_decode(engine, prompt, args, max_context)
    streamer = engine.cache.streamer
    if streamer is not None and streamer.prefetching:
        run["prefetch"] = {"prefetched_experts": streamer.prefetched_experts,
                           "used": streamer.prefetch_used}


def profile_decode(engine, prompt, args, max_context: int, host_path: Path) -> dict:
    """The device's busy time a decode round (two requests, `args.new_tokens` and a quarter
    of it, profiled alike: `round_profile.per_round`) and the host's top functions over a
    request of `args.new_tokens`, written to `host_path`."""
    def request(n_new: int):
        options = _options(args, max_context, n_new)
        return lambda: fresh_request(engine, prompt, options)

    short = max(args.new_tokens // 4, 1)
    busy = per_round(device_busy(request(short)), device_busy(request(args.new_tokens)),
                     args.new_tokens - short)
    host_path.parent.mkdir(parents=True, exist_ok=True)
    host_path.write_text(host_functions(request(args.new_tokens)))
    return busy


def _options(args, max_context: int, n_new: int) -> GenerateOptions:
    """A greedy request of n_new tokens through the run's decode path."""
    return GenerateOptions(max_new=n_new, max_context=max_context, temperature=0.0,
                           ignore_stop=True, cuda_graphs=not args.eager,
                           piecewise_graphs=not args.eager)


def trace_decode(engine, prompt, args, max_context: int, path: Path) -> dict:
    """A request of `args.new_tokens` / 4 tokens traced (`round_trace.trace`) to `path`: the
    layer's figures."""
    options = _options(args, max_context, max(args.new_tokens // 4, 1))
    return trace(lambda: fresh_request(engine, prompt, options), path)


def clock_decode(engine, prompt, args, max_context: int) -> dict:
    """A request of `args.new_tokens` tokens with the layer calls' host steps clocked
    (`round_trace.clocked`): `Clock.summary`'s figures, µs a layer call."""
    clock = Clock()
    options = _options(args, max_context, args.new_tokens)
    with clocked(clock):
        fresh_request(engine, prompt, options)
    return clock.summary()


def profile_prefill(engine, prompt, max_context: int, prefill_chunk: int | None,
                    host_path: Path) -> dict:
    """The device's busy time over one more prefill of `prompt` (`round_profile.device_busy`)
    and the host's top functions over another, written to `host_path`."""
    options = GenerateOptions(max_new=1, max_context=max_context, temperature=0.0,
                              ignore_stop=True, prefill_chunk=prefill_chunk)
    busy = device_busy(lambda: fresh_request(engine, prompt, options))
    host_path.parent.mkdir(parents=True, exist_ok=True)
    host_path.write_text(host_functions(lambda: fresh_request(engine, prompt, options)))
    return busy
