"""bench/cpu_experts.py's table: each column's us an expert, its ratio to `bare`, its GB/s and
share of the host's read rate; then, for the calls started on the CPU's own thread (`start-*`),
where their time went: the runs' own rate and each pass's, the team's wake-up, the hand-over and
the notice, the figures a round's `cpu_parts` gives (bench/offload_report.py) to compare with.
"""

from __future__ import annotations

import statistics

from strata.engine.experts.cpu import CpuCallTimes


def call_parts(times: list[CpuCallTimes], n_bytes: int) -> dict:
    """The medians of started calls' parts (us) and their runs' rates (GB/s: the call's
    `n_bytes`, two thirds of them in pass 1, gate and up, and a third in pass 2, down), for
    comparing with a round's (bench/offload.py's `cpu_parts`)."""
    def median(values) -> float:
        return statistics.median(values)

    run, pass1 = median(t.run_s for t in times), median(t.pass1_s for t in times)
    pass2 = median(t.run_s - t.pass1_s for t in times)
    return {"hand_over_us": 1e6 * median(t.hand_over_s for t in times),
            "team_up_us": 1e6 * median(t.team_up_s for t in times), "run_us": 1e6 * run,
            "noticed_us": 1e6 * median(t.noticed_s for t in times),
            "run_gb_s": n_bytes / run / 1e9, "pass1_gb_s": 2 / 3 * n_bytes / pass1 / 1e9,
            "pass2_gb_s": n_bytes / 3 / pass2 / 1e9 if pass2 > 0 else None}


def print_report(result: dict, read_gbps: float, read_mib: int, prefetches: tuple,
                 quantized: tuple) -> None:
    """`result` (bench/cpu_experts.py's JSON) as its table and the started calls' lines; the
    host's read rate over `read_mib`, the columns of `prefetches` (bytes) and of `quantized`
    (the kernel's quantized columns, "kernel-int8" ...)."""
    runs = result["runs"]
    print(f"{result['command']}  ({result['machine']}, torch {result['torch']})")
    print(f"host read bandwidth: {read_gbps:.1f} GB/s (float32 sum over {read_mib} MiB)")
    columns = ("compute-torch", "compute-main", "compute-static", "compute-guided", "compute-steal",
               *(f"compute-pf{n}" for n in prefetches),
               *(name + suffix for name in quantized for suffix in ("", "-steal")),
               *(name.replace("kernel", "compute") for name in quantized),
               *(f"start-{schedule}{suffix}" for suffix in ("", "-int8", "-int4")
                 for schedule in ("dynamic", "steal", "steal-alone")), "compute-worker",
               "worker-main-busy")
    for run in {(r["memory"], r["dtype"]): r for r in runs}.values():
        print(f"store in {run['memory']} memory, {run['dtype']}: "
              f"{run['store_bytes'] / 2**30:.2f} GiB of blobs took "
              f"{run['host_taken_bytes'] / 2**30:.2f} GiB of the host's available memory, "
              f"{run['rss_grown_bytes'] / 2**30:.2f} GiB more resident")
    print("| memory | dtype | T | experts | gap us | wake us | threads main/worker | "
          "bare us (GB/s, share) | "
          + " | ".join(columns) + " |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(columns))
    for run in runs:
        us, ratio, gbps = run["us_per_expert"], run["ratio_to_bare"], run["gbps"]
        woke = "-" if run["wake_us"] is None else f"{run['wake_us']:.0f}"
        cells = [f"{us[c]:.0f} ({ratio[c]:.2f}x; {gbps[c]:.1f} GB/s, "
                 f"{gbps[c] / read_gbps:.0%})" if c in us else "-" for c in columns]
        print(f"| {run['memory']} | {run['dtype']} | {run['tokens']} | {run['experts']} | "
              f"{run['gap_us']:.0f} | {woke} | "
              f"{run['main_threads']}/{run['worker_threads']} | {us['bare']:.0f} "
              f"({gbps['bare']:.1f} GB/s, {gbps['bare'] / read_gbps:.0%}) | "
              + " | ".join(cells) + " |")
    for run in runs:
        for name, p in run["start_parts"].items():
            down = "-" if p["pass2_gb_s"] is None else f"{p['pass2_gb_s']:.1f}"
            print(f"{name} (T = {run['tokens']}, {run['experts']} experts, gap "
                  f"{run['gap_us']:.0f} us, {run['memory']}): run {p['run_us']:.0f} us at "
                  f"{p['run_gb_s']:.1f} GB/s (gate and up {p['pass1_gb_s']:.1f}, down {down}), "
                  f"team up {p['team_up_us']:.1f} us, hand-over {p['hand_over_us']:.1f}, "
                  f"noticed {p['noticed_us']:.1f}")
