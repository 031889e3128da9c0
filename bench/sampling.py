"""What a decode round's sampling costs on the device: the race's kernels against the sort
they replaced.

`strata generate`'s default sampling (temperature 0.8, top-p 0.95) cost 0.097 ms a round over
greedy on the H200's olmoe-1b-7b decode (bench/results/decode-fusions-h200-2026-12-02.md): the
gap between 46.5% of the bandwidth bound and greedy's 50.9%. Most of it was the sort of the
vocabulary (bench/results/sampling-h200-2026-12-03.txt). The sampler is now an exponential race
(`strata.engine.runtime.sampling`) whose CUDA pick is three Triton kernels and no sort. This
times, over one row of logits [V] (fp32, as the model returns them), for each setting:

- `pick <setting>`: `Sampler.pick`, eager, as the decode loop launches it (the kernels on
  CUDA with Triton);
- `pick <setting> graph`: `--picks` picks captured in one CUDA graph and replayed (CUDA only):
  the kernels' own time a pick, without the host's launches;
- `pick greedy kernel` (or `pick greedy torch`) and its graph: the greedy pick from the other
  side of `sampling.ARGMAX_KERNEL` (one Triton launch, or torch's argmax; off CUDA both are
  torch's);
- `sorted <setting>` and `sorted <setting> graph`: the sampler before it (`inverse_cdf_pick`):
  a sort of V, softmax, cumulative sums, top-p's mask and the search for the draw: the
  baseline, same run.

and `first winner outside <setting>`: the share of `--draws` seeded steps whose race winner
over all tokens is not a candidate, the steps that take the kernels' slow path (one more pass
over the row in one program for each winner rejected).

Each row cycles through `--picks` seeded draws, so the slow path runs as often as it falls. Each
time is the median over `--repeat` timed batches of `--calls` back-to-back calls, on CUDA
events (the host's clock off CUDA); the logits are N(0, `--logit-std`) with a seeded
generator. Absolute times only from the GPU machine.

    python bench/sampling.py --vocab 50304             # on the GPU machine
    python bench/sampling.py --device cpu --vocab 4096 --repeat 2 --calls 4   # the host twin
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from unittest.mock import patch

import torch

from strata.engine.runtime import sampling
from strata.engine.runtime.decode_steps import capture_graph
from strata.engine.runtime.sampling import Sampler, gumbel_noise, race_keys

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "cli-default": {"temperature": 0.8, "top_p": 0.95},
    "temperature": {"temperature": 0.8},
    "top-k-50": {"temperature": 0.8, "top_k": 50},
    "top-p-0.5": {"temperature": 0.8, "top_p": 0.5},
}


def time_ms(fn: Callable[[], object], device: torch.device, calls: int, repeat: int) -> float:
    """The median over `repeat` batches of one call's ms, a batch `calls` calls in a row."""
    fn()  # warm: kernels loaded, allocator primed
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        else:
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - begin) * 1e3 / calls)
    return statistics.median(samples)


def inverse_cdf_pick(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                     u: float) -> torch.Tensor:
    """The sampler before the race (to commit f3305b2): the candidate at draw u by inverse CDF
    over the logits sorted (descending), [1]."""
    scaled = logits.float() / temperature  # [V]
    if 0 < top_k < scaled.shape[0]:
        values, ids = torch.topk(scaled, top_k)  # [k], sorted, descending
    else:
        values, ids = torch.sort(scaled, descending=True, stable=True)  # [V]
    probs = torch.softmax(values, dim=0)  # [C]
    cumulative = torch.cumsum(probs, dim=0)  # [C]
    if top_p < 1.0:
        probs = probs * ((cumulative - probs) < top_p)  # the smallest prefix reaching top_p
        cumulative = torch.cumsum(probs, dim=0)
    index = torch.searchsorted(cumulative, cumulative[-1:] * u, right=True)  # [1]
    return ids[index.clamp(max=probs.shape[0] - 1)]  # [1]


def first_winner_outside(logits: torch.Tensor, sampler: Sampler, draws: int) -> float:
    """The share of `draws` steps (the sampler's seeded draws) whose race winner is not a
    candidate: more than top_k tokens, or top_p of the mass, before it. The winner is the
    kernels' first: over the tokens at or above the top_k-th largest logit (all without
    top_k)."""
    scaled = logits.float().cpu() / sampler.temperature  # [V]
    order = torch.sort(scaled, descending=True, stable=True).indices  # [V]
    position = torch.empty_like(order)
    position[order] = torch.arange(order.shape[0])  # [V]: each token's place in the order
    top_k = sampler.top_k if sampler.top_k < scaled.shape[0] else 0
    floor = torch.topk(scaled, top_k).values[-1] if top_k else -torch.inf
    in_play = scaled >= floor  # [V]
    values = scaled[order][: top_k or None]  # the first top_k's softmax, as the filters see it
    mass_before = torch.full_like(scaled, 2.0)  # past top_k: never below top_p
    mass_before[order[: values.shape[0]]] = (torch.cumsum(torch.softmax(values, dim=0), dim=0)
                                             - torch.softmax(values, dim=0))
    outside = 0
    for _ in range(draws):
        race = scaled + gumbel_noise(race_keys(sampler.draw()), scaled.shape[0], "cpu")
        winner = int(torch.argmax(torch.where(in_play, race, -torch.inf)))
        outside += bool((top_k and position[winner] >= top_k)
                        or (sampler.top_p < 1.0 and mass_before[winner] >= sampler.top_p))
    return outside / draws


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=50304, help="V (olmoe's: 50,304)")
    parser.add_argument("--logit-std", type=float, default=3.0)
    parser.add_argument("--calls", type=int, default=100, help="calls a timed batch")
    parser.add_argument("--repeat", type=int, default=7, help="timed batches (the median)")
    parser.add_argument("--picks", type=int, default=16,
                        help="seeded steps a timed row cycles through (and a graph holds)")
    parser.add_argument("--draws", type=int, default=200,
                        help="seeded steps for the first winner's share outside the candidates")
    args = parser.parse_args(argv)
    if args.vocab < 2 or min(args.calls, args.repeat, args.picks, args.draws) < 1:
        parser.error("--vocab must be >= 2, --calls, --repeat, --picks and --draws >= 1")
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.vocab, generator=gen) * args.logit_std).to(device)  # [V]
    rows: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], object], picks: int) -> None:
        """Rows `name` (eager: one pick a call) and `name graph` (CUDA: `picks` picks captured
        in one graph, the time a pick)."""
        step = itertools.count()
        rows[name] = time_ms(lambda: fn(next(step) % picks), device, args.calls, args.repeat)
        if device.type == "cuda":
            graph, _ = capture_graph(lambda: [fn(i) for i in range(picks)], device, None)
            rows[f"{name} graph"] = time_ms(graph.replay, device, args.calls,
                                            args.repeat) / picks

    outside: dict[str, float] = {}
    for name, options in SETTINGS.items():
        sampler = Sampler(**options)
        if sampler.greedy:
            timed(f"pick {name}", lambda i, s=sampler: s.pick(logits, None), 1)
            # The other side of `sampling.ARGMAX_KERNEL`: one Triton launch or torch's argmax.
            with patch.object(sampling, "ARGMAX_KERNEL", not sampling.ARGMAX_KERNEL):
                timed(f"pick {name} {'kernel' if sampling.ARGMAX_KERNEL else 'torch'}",
                      lambda i, s=sampler: s.pick(logits, None), 1)
            continue
        # The seeded draws of `--picks` steps, each step's winner inside or outside as it falls.
        draws = [sampler.draw() for _ in range(args.picks)]
        timed(f"pick {name}", lambda i, s=sampler, d=draws: s.pick(logits, d[i]), args.picks)

        def sorted_pick(i: int, s: Sampler = sampler, d: list = draws) -> torch.Tensor:
            return inverse_cdf_pick(logits, s.temperature, s.top_p, s.top_k, d[i])

        timed(f"sorted {name}", sorted_pick, args.picks)
        outside[name] = first_winner_outside(logits, Sampler(**options, seed=1), args.draws)
    greedy = rows["pick greedy"]
    report = {"bench": "bench/sampling.py", "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else None, "vocab": args.vocab, "calls": args.calls, "repeat": args.repeat,
              "ms": rows, "first_winner_outside": outside}
    print(json.dumps(report))
    width = max(map(len, rows))
    for name, ms in rows.items():
        print(f"{name:<{width}}  {ms * 1e3:9.1f} us  ({ms / greedy:5.1f}x greedy's pick)")
    for name, share in outside.items():
        print(f"first winner outside {name}: {share:.1%} of {args.draws} draws")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
