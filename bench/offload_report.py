"""bench/offload.py's figures of a run against the bounds the machine sets, and its report.

A decode run's round (`round_figures`): its time, its misses split between the CPU and the copy
engine, the bound (the largest of the CPU's miss bytes over the host's read rate, the streamed bytes
over the copy rate and all of them over what the host's memory gave both readers at once, plus the
device's own round: a lower bound, summed over the round; beside it the same misses' bound at the
split that would finish both sides together at those rates, whatever the split taken), the CPU
experts' rate and share of the host's read rate (where the CPU's own thread ran them, a decode
call's on CUDA, also the rate of its runs alone and of each of their passes, beside their
hand-over, team wake-up and notice: `CpuExperts.last_call`), and the host-side time (the round
less the CPU experts' time, the cache's waits for the device and the decode loop's for the
token). A prefill run's (`prefill_figures`): the upload bound, the bytes uploaded over the copy
rate.
"""

from __future__ import annotations

from offload_rates import GB
from thread_sched import describe


def round_figures(run: dict, blob_bytes: int, machine: dict, device_round_ms: float | None,
                  n_layers: int, full_layers: int) -> dict:
    """The decode round's figures from `run_decode`'s result (see the module)."""
    d = run["cache"]["decode"]
    rounds = max(d["passes"], 1)
    round_ms = run["decode_ms_per_round"]
    cpu_ms, wait_ms = 1000 * d["cpu_s"] / rounds, 1000 * d["wait_s"] / rounds
    # The decode loop's wait for each round's token: the device's tail of the round (the last
    # layer's graph, the logits, the pick), not the host's work. Runs before it was measured
    # have none, and their host-side figure counts it.
    token_wait_ms = run.get("decode_token_wait_ms_per_round", 0.0)
    cpu_experts, streamed = d["cpu_experts"] / rounds, d["streamed_experts"] / rounds
    misses = cpu_experts + streamed
    cpu_bytes, copy_bytes = cpu_experts * blob_bytes, streamed * blob_bytes
    cpu_bound = 1000 * cpu_bytes / machine["host_read_bytes_per_s"]
    copy_rate = machine["copy_bytes_per_s"]
    copy_bound = 1000 * copy_bytes / copy_rate if copy_rate else 0.0
    # Both sides read the host's memory: all the misses' bytes at what it gave both together
    # bound a round too, however they are split.
    joint = machine.get("joint_bytes_per_s")
    shared_bound = 1000 * (cpu_bytes + copy_bytes) / joint["total"] if joint else 0.0
    bound = max(cpu_bound, copy_bound, shared_bound) + (device_round_ms or 0.0)
    # The same misses at the split that finishes both sides together at these rates, whatever
    # the split taken: `bound` rises with a split that streams more than the copy engine's
    # share (the copies' time is its largest term), this one does not. No bus, no other split.
    miss_bytes, host_read = cpu_bytes + copy_bytes, machine["host_read_bytes_per_s"]
    best_bound = max(1000 * miss_bytes / (host_read + copy_rate), shared_bound) \
        + (device_round_ms or 0.0) if copy_rate else bound
    cpu_rate = cpu_bytes / (d["cpu_s"] / rounds) if d["cpu_s"] else None
    # Where the CPU's own thread ran them (a decode call's on CUDA): the runs on its team alone,
    # without the hand-over and the engine's steps around them.
    run_rate = cpu_bytes / (d["cpu_run_s"] / rounds) if d["cpu_run_s"] else None
    return {
        "round_ms": round_ms, "tok_s": run["decode_tok_s"], "decode_path": run["decode_path"],
        "hit_rate": d["hit_rate"], "deterministic": run["deterministic"],
        "misses_per_round": misses, "cpu_experts_per_round": cpu_experts,
        "streamed_experts_per_round": streamed,
        "cpu_share": cpu_experts / misses if misses else None,
        "copy_share": streamed / misses if misses else None,
        "cpu_bound_ms": cpu_bound, "copy_bound_ms": copy_bound,
        "shared_bound_ms": shared_bound,
        "device_round_ms": device_round_ms, "bound_ms": bound,
        "over_bound": round_ms / bound if bound else None,
        "best_split_bound_ms": best_bound,
        "over_best_split_bound": round_ms / best_bound if best_bound else None,
        "cpu_ms": cpu_ms, "wait_ms": wait_ms, "device_issue_ms": 1000 * d["device_s"] / rounds,
        "in_cache_ms": 1000 * d["forward_s"] / rounds,
        "token_wait_ms": token_wait_ms,
        "host_ms": round_ms - cpu_ms - wait_ms - token_wait_ms,
        "host_share": (round_ms - cpu_ms - wait_ms - token_wait_ms) / round_ms,
        "host_ms_with_token_wait": round_ms - cpu_ms - wait_ms,
        "cpu_gb_s": cpu_rate / GB if cpu_rate else None,
        "cpu_share_of_host_read": cpu_rate / machine["host_read_bytes_per_s"]
        if cpu_rate else None,
        "cpu_waiter_task_share": d["cpu_waiter_tasks"] / d["cpu_tasks"]
        if d["cpu_tasks"] else None,
        **{f"cpu_{part}_ms": 1000 * d[f"cpu_{part}_s"] / rounds
           for part in ("hand_over", "team_up", "pass1", "run", "noticed")},
        "cpu_run_gb_s": run_rate / GB if run_rate else None,
        # The passes' own rates: gate and up (two thirds of an expert's bytes, from the run's
        # start: the team's wake-up in it), then down (the third, the rest of the run).
        "cpu_pass1_gb_s": 2 / 3 * cpu_bytes / (d["cpu_pass1_s"] / rounds) / GB
        if d["cpu_pass1_s"] else None,
        "cpu_pass2_gb_s": cpu_bytes / 3 / ((d["cpu_run_s"] - d["cpu_pass1_s"]) / rounds) / GB
        if d["cpu_run_s"] > d["cpu_pass1_s"] else None,
        "ms_per_layer": round_ms / n_layers,
        "scaled_tok_s": 1000 / (round_ms / n_layers * full_layers),
    }


def prefill_figures(run: dict, machine: dict, n_layers: int, full_layers: int) -> None:
    """A prefill run's upload bound (s), its time over it and its tok/s scaled to
    `full_layers`, added to `run` (`run_prefill`'s result)."""
    uploaded = run["cache"]["prompt"]["uploaded_bytes"]
    copy_rate = machine["copy_bytes_per_s"]
    run["upload_bound_s"] = uploaded / copy_rate if copy_rate else None
    run["over_bound"] = run["prefill_s"] / run["upload_bound_s"] \
        if run["upload_bound_s"] else None
    run["scaled_tok_s"] = run["prefill_tok_s"] * n_layers / full_layers


def decode_lines(name: str, run: dict) -> list[str]:
    """What bench/offload.py says of a decode run as it ends: its round against the bound,
    what the scheduler did to the threads, and where traced or clocked, a layer call's host
    steps."""
    r = run["round"]
    ahead = run.get("prefetch")
    cpu_rate = f" ({r['cpu_gb_s']:.1f} GB/s{cpu_parts(r)})" if r["cpu_gb_s"] else ""
    lines = [f"{name}: {r['round_ms']:.2f} ms a round (bound {r['bound_ms']:.2f}), "
             f"{r['ms_per_layer']:.3f} ms a layer, host-side {r['host_ms']:.2f} ms, CPU experts "
             f"{r['cpu_ms']:.2f}{cpu_rate}, wait {r['wait_ms']:.2f}, token wait "
             f"{r['token_wait_ms']:.2f}" + (
                 f", prefetched {ahead['prefetched_experts']} experts, used {ahead['used']}"
                 if ahead else ""),
             f"{name}, {describe(run['threads_per_round'])}"]
    for key, what in (("trace", "traced"), ("host_steps", "clocked")):
        if run.get(key):
            lines.append(f"{name}, {what} a layer call: " + ", ".join(
                f"{step.removesuffix('_us')} {value:.1f}" for step, value in run[key].items()
                if step.endswith("_us")) + " µs")
    return lines


def cpu_parts(r: dict) -> str:
    """Where a round's CPU experts' time went on the CPU's own thread, as "; run 3.90 ms at
    75.0 GB/s (gate and up 70.0, down 85.0), team up 0.30, hand-over 0.02, noticed 0.01"
    ("" where nothing ran there)."""
    if not r["cpu_run_gb_s"]:
        return ""
    passes = "" if r["cpu_pass2_gb_s"] is None else \
        f" (gate and up {r['cpu_pass1_gb_s']:.1f}, down {r['cpu_pass2_gb_s']:.1f})"
    return (f"; run {r['cpu_run_ms']:.2f} ms at {r['cpu_run_gb_s']:.1f} GB/s{passes}, team up "
            f"{r['cpu_team_up_ms']:.2f}, hand-over {r['cpu_hand_over_ms']:.2f}, noticed "
            f"{r['cpu_noticed_ms']:.2f}")


def prefill_line(name: str, run: dict, full_layers: int) -> str:
    """What bench/offload.py says of a prefill run as it ends (after `prefill_figures`)."""
    uploaded = run["cache"]["prompt"]["uploaded_bytes"]
    bound = f" (upload bound {run['upload_bound_s']:.3f} s, {run['over_bound']:.2f}x)" \
        if run["upload_bound_s"] else ""
    busy = run.get("profile")
    return (f"{name}: {run['prefill_s']:.3f} s{bound}, {uploaded / GB:.3f} GB uploaded, "
            f"{run['prefill_tok_s']:,.0f} tok/s, {run['scaled_tok_s']:,.0f} scaled to "
            f"{full_layers} layers" + (
                f"; profiled: copies {busy['copies_us'] / 1e3:.1f} ms, compute "
                f"{busy['compute_us'] / 1e3:.1f}, both {busy['both_us'] / 1e3:.1f}, "
                f"span {busy['span_us'] / 1e3:.1f}" if busy else ""))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_report(result: dict, args) -> None:
    """The run's table: the machine, then each decode run's round and each prefill's."""
    machine = result["machine"]
    copy = machine["copy_bytes_per_s"]
    scaled = result["layers"] != result["full_layers"]
    rounds = ", ".join(f"{fmt} {_ms(ms)}" for fmt, ms in
                       result["device_round_ms_by_format"].items())
    print(f"{result['command']}")
    print(f"{result['model']} ({result['layers']} layers, {result['dtype']}, router skew "
          f"{result['router_skew']:g}) on {result['device_name']} ({result['device']}), "
          f"{result['date']}; host read {machine['host_read_bytes_per_s'] / GB:.1f} GB/s on "
          f"{machine['threads']} threads, pinned copies "
          f"{'-' if copy is None else f'{copy / GB:.1f}'} GB/s; device round (every expert "
          f"resident) {rounds} ms; medians of {args.repeat}")
    for name, run in result["runs"].items():
        if not name.startswith("decode"):
            continue
        r = run["round"]
        print(f"{name}: {run['startup']}")
        for note in run["notes"]:
            print(f"  {note}")
        print(f"  a round {r['round_ms']:.2f} ms ({r['tok_s']:.1f} tok/s, {r['decode_path']}, "
              f"hit rate {100 * r['hit_rate']:.1f}%, deterministic {r['deterministic']}); bound "
              f"{r['bound_ms']:.2f} ms = max(CPU {r['cpu_bound_ms']:.2f}, copies "
              f"{r['copy_bound_ms']:.2f}, both {r['shared_bound_ms']:.2f}) + device "
              f"{_ms(r['device_round_ms'])}: {_ms(r['over_bound'])}x the bound; at the split "
              f"that finishes both sides together, {_ms(r.get('best_split_bound_ms'))} ms: "
              f"{_ms(r.get('over_best_split_bound'))}x")
        busy = run.get("profile")
        if busy:
            print(f"  the device a round (profiled): copies {busy['copies_us'] / 1000:.2f} ms "
                  f"({busy['n_copies']:.1f} of them), compute {busy['compute_us'] / 1000:.2f} "
                  f"ms, both at once {busy['both_us'] / 1000:.2f} ms, neither "
                  f"{(busy['span_us'] - busy['either_us']) / 1000:.2f} ms")
        shares = "-" if r["cpu_share"] is None else \
            f"{100 * r['cpu_share']:.0f}% / {100 * r['copy_share']:.0f}%"
        cpu_rate = "-" if r["cpu_gb_s"] is None else \
            f"{r['cpu_gb_s']:.1f} GB/s, {100 * r['cpu_share_of_host_read']:.0f}% of host " \
            f"read{cpu_parts(r)}"
        print(f"  misses a round {r['misses_per_round']:.2f}: CPU {r['cpu_experts_per_round']:.2f}"
              f", copies {r['streamed_experts_per_round']:.2f} (CPU / copy {shares}); CPU "
              f"experts {r['cpu_ms']:.2f} ms ({cpu_rate}); waiting {r['wait_ms']:.2f} ms, "
              f"{r['token_wait_ms']:.2f} for the token; host-side {r['host_ms']:.2f} ms "
              f"({100 * r['host_share']:.0f}% of the round)"
              + ("" if not r["cpu_waiter_task_share"] else
                 f"; the engine's thread ran {100 * r['cpu_waiter_task_share']:.0f}% of the "
                 f"CPU's tasks"))
        if scaled:
            print(f"  {r['ms_per_layer']:.3f} ms a layer: {r['scaled_tok_s']:.1f} tok/s scaled to "
                  f"{result['full_layers']} layers")
    for name, prefill in result["runs"].items():
        if not name.startswith("prefill"):
            continue
        bound = prefill["upload_bound_s"]
        print(f"{name}, {args.prefill_tokens} tokens in chunks of "
              f"{prefill['prefill_chunk']}: {prefill['prefill_s']:.3f} s "
              f"({prefill['prefill_tok_s']:.0f} tok/s); uploaded "
              f"{prefill['cache']['prompt']['uploaded_bytes'] / GB:.3f} GB, upload bound "
              f"{'-' if bound is None else f'{bound:.3f} s'} "
              f"({_ms(prefill['over_bound'])}x)")
        prompt = prefill["cache"]["prompt"]
        upload_s = prompt["upload_s"]
        rate = f"{prompt['uploaded_bytes'] / upload_s / GB:.1f} GB/s" if upload_s else "-"
        print(f"  where it went: the cache's uploads {upload_s:.3f} s ({rate}), the rest of the "
              f"cache {prompt['forward_s'] - upload_s:.3f} s (of it waiting for the routing "
              f"{prompt['wait_s']:.3f} s), outside the cache "
              f"{prefill['prefill_s'] - prompt['forward_s']:.3f} s")
        if scaled:
            print(f"  {prefill['scaled_tok_s']:.0f} tok/s scaled to {result['full_layers']} "
                  "layers")

