"""Where the host's time goes when a decode call streams misses to the device.

On the H200 a 16-layer offloaded round spent 3.5-3.9 ms issuing the device's share of its
misses at `--stream-misses 4` against 0.5-0.7 ms at 0 (bench/results/
offload-split-h200-2026-12-02.md): about 47 us of host time for each streamed expert, far
more than queueing one copy and a share of a kernel should take. This measures, on the host's
clock, for k = 1..K streamed experts of the preset's shape (a synthetic pinned store, as
`strata.engine.cache.rates` builds one):

- `compute`: `StreamedMisses.compute` whole (the k uploads into the staging blobs, then the
  experts' kernels over them);
- `copies`: the k uploads alone, as `compute` queues them;
- `kernels`: the experts' kernels alone, over blobs already staged;
- `indices`: one small upload of a call's indices through `HostRows` (a pinned buffer);

each the median of `--repeat` calls, the device drained before each (so a call never waits
behind the previous one's copies). Two other ways to queue the same uploads, to choose from
(CUDA only; a way that fails reports its error instead of a time):

- `driver`: one `cuMemcpyHtoDAsync` an expert through cuda-python, torch's dispatch skipped;
- `batched`: all k in one `cuMemcpyBatchAsync` (CUDA 12.8+ drivers).
 With `--sync-check` one call of each part runs under torch's
sync debug mode, which raises where an op waits for the device: a wait hidden in the issue
path would show there.

    python bench/stream_issue.py --preset olmoe-1b-7b            # on the GPU machine
    python bench/stream_issue.py --preset tiny --device cpu       # the host twin, in seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from strata.engine.cache.host_rows import HostRows
from strata.engine.cache.rate_calls import synthetic_store
from strata.engine.experts.routed import Routed
from strata.engine.experts.streamed import StreamedMisses
from strata.engine.model.presets import PRESETS, get_preset


def _drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us(fn, device: torch.device, repeat: int) -> float:
    """The median host time of fn() in microseconds, the device drained before and after."""
    times = []
    for _ in range(repeat + 1):  # the first untimed
        _drain(device)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
        _drain(device)
    return statistics.median(times[1:])


def sync_check(fn, device: torch.device) -> str:
    """"ok", or the error torch's sync debug mode raised for a wait inside fn()."""
    if device.type != "cuda":
        return "n/a (no device)"
    _drain(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "ok"
    except RuntimeError as err:
        return str(err).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        _drain(device)


def driver_copies(dsts: list[int], srcs: list[int], n_bytes: int, batched: bool):
    """A function queueing the copies srcs[i] (pinned host) -> dsts[i] (device) of n_bytes each
    on torch's current stream through the driver: one call each, or one `cuMemcpyBatchAsync`.
    ImportError without cuda-python."""
    from cuda.bindings import driver

    def check(result, what):
        if int(result[0]) != 0:
            raise RuntimeError(f"{what}: {driver.cuGetErrorName(result[0])[1]}")

    def stream():
        return driver.CUstream(torch.cuda.current_stream().cuda_stream)

    if not batched:
        def one_by_one():
            handle = stream()
            for dst, src in zip(dsts, srcs, strict=True):
                check(driver.cuMemcpyHtoDAsync(dst, src, n_bytes, handle), "cuMemcpyHtoDAsync")
        return one_by_one
    attrs = driver.CUmemcpyAttributes()
    attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    count = len(dsts)

    def in_one_call():
        check(driver.cuMemcpyBatchAsync(
            [driver.CUdeviceptr(d) for d in dsts], [driver.CUdeviceptr(s) for s in srcs],
            [n_bytes] * count, count, [attrs], [0], 1, stream()), "cuMemcpyBatchAsync")
    return in_one_call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="olmoe-1b-7b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--sync-check", action="store_true")
    parser.add_argument("--store-mib", type=int, default=512,
                        help="the synthetic store's size, read round robin")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    config = get_preset(args.preset)  # the expert's shape: hidden_size, expert_width, top_k
    dtype = torch.bfloat16
    store = synthetic_store(config.hidden_size, config.expert_width, config.top_k, dtype,
                            device.type == "cuda", args.store_mib << 20)
    top_k = config.top_k
    streamer = StreamedMisses(store, device, top_k)
    host_rows = HostRows(device)
    x = torch.full((1, config.hidden_size), 0.01, dtype=dtype, device=device)  # [1, D]
    layers = iter(range(10**9))

    def layer() -> int:  # round robin: no call reads blobs a recent one read
        return next(layers) % store.n_layers

    side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    rows = {}
    for k in range(1, top_k + 1):
        routed = Routed.of(np.arange(k)[None, :])
        experts = routed.experts.tolist()

        def compute(routed=routed):
            streamer.compute(layer(), x, routed)

        def copies(experts=experts):
            blobs = store.layer_blobs(layer())
            for i, expert in enumerate(experts):
                streamer._staging[i].copy_(blobs[expert], non_blocking=True)

        def kernels(k=k):
            streamer._stack.expert_rows(streamer._index[:k], x.expand(k, -1))

        def indices(k=k):
            buffer, split = host_rows.index_buffer(5 * top_k + 1)
            split[:] = np.arange(split.size)
            host_rows.indices_to_device(buffer[:k + top_k])

        parts = {"compute": compute, "copies": copies, "kernels": kernels, "indices": indices}
        rows[k] = {name: host_us(fn, device, args.repeat) for name, fn in parts.items()}
        if device.type == "cuda":  # the same uploads queued through the driver
            blobs = store.layer_blobs(0)
            dsts = [streamer._staging[i].data_ptr() for i in range(k)]
            srcs = [blobs[expert].data_ptr() for expert in experts]
            expected = blobs[experts].to(device)
            for name, batched in (("driver", False), ("batched", True)):
                streamer._staging[:k].zero_()
                try:
                    # A side stream: the batched copy refuses the legacy default stream.
                    with torch.cuda.stream(side_stream):
                        way = driver_copies(dsts, srcs, store.blob_bytes, batched)
                        way()
                        torch.cuda.synchronize(device)
                        if not torch.equal(streamer._staging[:k], expected):
                            raise RuntimeError("the staging blobs differ from the store's")
                        rows[k][name] = host_us(way, device, args.repeat)
                except Exception as err:  # reported, not raised: a way to choose from
                    rows[k][name] = f"{type(err).__name__}: {err}"
        if args.sync_check:
            rows[k]["sync"] = {name: sync_check(fn, device) for name, fn in parts.items()}
        line = ", ".join(f"{name} {value:.1f}" if isinstance(value, float) else
                         f"{name} {value}" for name, value in rows[k].items()
                         if name != "sync")
        print(f"bench/stream_issue.py: k={k}: host us: {line}", flush=True)
    print(json.dumps({"preset": args.preset, "device": str(device),
                      "device_name": (torch.cuda.get_device_name(device)
                                      if device.type == "cuda" else "cpu"),
                      "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                      "blob_bytes": store.blob_bytes, "repeat": args.repeat,
                      "host_us": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
