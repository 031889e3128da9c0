"""The host's time to launch one CUDA graph: torch's `CUDAGraph.replay` against the driver's
`cuGraphLaunch` on the same graph.

Issue 17's offloaded decode round replays one graph a layer between the experts' host calls
(`strata.engine.runtime.piecewise`), and a layer call's clocked host steps counted 8.8-9.0 us
for that replay on an H100 machine (bench/results/host-steps-h100-2026-12-05.md). This times
the launch call alone, by the host's clock: a graph of `--kernels` small kernels captured once,
then `--launches` launches of it each way, in alternating blocks of 50 (the device drained
between blocks, so that no launch waits on a full queue), the median of each way's per-call
times, and their ratio. In the round the difference fell inside the CPU's spread, and the round
kept torch's replay (bench/results/staged-reads-driver-h100-2026-12-06.md).

    python bench/graph_launch.py            # the GPU machine
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

BLOCK = 50


def captured(n_kernels: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of n_kernels elementwise kernels over one row of `width`, captured."""
    x = torch.zeros((1, width), device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1.0)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n_kernels):
            x.add_(1.0)
    torch.cuda.synchronize()
    return graph, x


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=int, default=8, help="kernels in the graph")
    parser.add_argument("--launches", type=int, default=1000, help="launches each way")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    for name in ("kernels", "launches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} takes a count >= 1, got {getattr(args, name)}")
    if not torch.cuda.is_available():
        parser.error("graph_launch.py needs a CUDA device")
    from cuda.bindings import driver

    graph, x = captured(args.kernels, 2048)
    exec_handle = driver.CUgraphExec(graph.raw_cuda_graph_exec())
    stream = torch.cuda.current_stream()
    stream_handle = driver.CUstream(stream.cuda_stream)

    def driver_launch() -> None:
        (err,) = driver.cuGraphLaunch(exec_handle, stream_handle)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuGraphLaunch: {err}")

    ways = {"torch replay": graph.replay, "cuGraphLaunch": driver_launch}
    times: dict[str, list[float]] = {name: [] for name in ways}
    before = x.clone()
    for block in range(2 * -(-args.launches // BLOCK)):
        name = list(ways)[block % 2]
        launch = ways[name]
        torch.cuda.synchronize()
        for _ in range(BLOCK):
            start = time.perf_counter()
            launch()
            times[name].append(time.perf_counter() - start)
    torch.cuda.synchronize()
    launched = sum(len(t) for t in times.values())
    # Both ways ran the graph: each launch added 1 n_kernels times.
    ran = bool(torch.equal(x, before + launched * args.kernels))
    medians = {name: 1e6 * statistics.median(t) for name, t in times.items()}
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "kernels": args.kernels,
        "launches": args.launches, "us_median": medians,
        "us_p90": {name: 1e6 * statistics.quantiles(t, n=10)[-1] for name, t in times.items()},
        "driver_over_torch": medians["cuGraphLaunch"] / medians["torch replay"],
        "every_launch_ran": ran,
        "command": "python bench/graph_launch.py " + " ".join(sys.argv[1:] if argv is None
                                                            else argv),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for name, us in medians.items():
            print(f"{name:>14}: {us:6.2f} us a launch (median), p90 {result['us_p90'][name]:.2f}")
        print(f"cuGraphLaunch / replay: {result['driver_over_torch']:.3f}; every launch ran: "
              f"{ran}")
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
