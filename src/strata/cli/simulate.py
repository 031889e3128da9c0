"""`strata simulate TRACE --policy P [--policy-opt K=V] ... --slots N[,N...]`: replay a trace
through policies at several cache sizes, beside Belady's bound and the oracle static set."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from strata.cli.errors import UsageError
from strata.cli.policies import policy_from_args
from strata.cli.trace import read_trace
from strata.formats.npz import open_npz
from strata.formats.trace import FORMAT, Trace, TraceError, load_trace
from strata.policies import PolicyError
from strata.policies.kv_params import DEFAULT_FLOOR_SLOTS
from strata.policies.registry import DEFAULT_POLICY, PolicyRegistry, load_registry
from strata.sim.cost import Bandwidths, CostModel
from strata.sim.kv_sim import DEFAULT_CHUNK_BYTES, KvConfig
from strata.sim.replay import PATH_CHOICES, policy_label
from strata.sim.result import ReplayResult
from strata.sim.sweep import BOUNDS, DEFAULT_BOUNDS, sweep, sweep_steps

OUTPUT_FORMAT = "strata-simulate"
OUTPUT_VERSION = 1
MiB = 1 << 20


class _PolicyAction(argparse.Action):
    """--policy NAME: one more policy to replay; later --policy-opt options are its own."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.policies = [*namespace.policies, (value, [])]


class _PolicyOptAction(argparse.Action):
    """--policy-opt KEY=VALUE: an option of the policy named last (or of the default one)."""

    def __call__(self, parser, namespace, value, option_string=None):
        if namespace.policies:
            name, options = namespace.policies[-1]
            namespace.policies = [*namespace.policies[:-1], (name, [*options, value])]
        else:
            namespace.leading_opts = [*namespace.leading_opts, value]


def _slot_list(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of slot counts: want N or N,N,... e.g. 256,512,1024"
        ) from None
    if any(n < 0 for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: slot counts are >= 0")
    return sizes


def _bound_list(text: str) -> list[str]:
    names = [] if text == "none" else [part.strip() for part in text.split(",")]
    unknown = [name for name in names if name not in BOUNDS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown bound {unknown[0]!r}; want a comma list of {', '.join(BOUNDS)}, or none")
    return names


def _policies(args: argparse.Namespace, registry: PolicyRegistry) -> list[tuple[str, list[str]]]:
    """The (name, options) to replay, each checked by building it once."""
    specs = args.policies or [(DEFAULT_POLICY, [])]
    if args.leading_opts and args.policies:
        raise UsageError(
            f"--policy-opt {args.leading_opts[0]} comes before any --policy: put each "
            "--policy-opt after the --policy it sets"
        )
    if args.leading_opts:
        specs = [(DEFAULT_POLICY, list(args.leading_opts))]
    labels = []
    for name, options in specs:
        policy = policy_from_args(argparse.Namespace(policy=name, policy_opts=options), registry)
        labels.append(policy_label(policy)[0])
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise UsageError(f"policy {twice[0]} is given twice with the same options")
    return specs


def _model_figure(args: argparse.Namespace, trace: Trace, name: str, flag: str) -> int | None:
    """A geometry figure: the flag's value, else the trace's meta['model'][name]."""
    value = getattr(args, name)
    if value is None:
        value = (trace.meta.get("model") or {}).get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UsageError(f"{flag} must be an integer >= 1, got {value!r}")
    return value


def _need_figure(value: int | None, flag: str, why: str) -> int:
    if value is None:
        raise UsageError(f"{why} needs {flag}: the trace's meta does not record it")
    return value


def _kv_config(args: argparse.Namespace, trace: Trace) -> KvConfig | None:
    if not args.kv_grow:
        for flag in ("max_context", "budget_mib"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} applies only with --kv-grow")
        return None
    why = "--kv-grow"
    need = int(trace.request_tokens.max())
    max_context = need if args.max_context is None else args.max_context
    if max_context < need:
        raise UsageError(f"--max-context {max_context} is below the trace's longest request "
                         f"({need} cells)")
    try:
        return KvConfig(
            max_context=max_context,
            slot_bytes=_need_figure(_model_figure(args, trace, "slot_bytes", "--slot-bytes"),
                                    "--slot-bytes", why),
            kv_segment_cell_bytes=_need_figure(
                _model_figure(args, trace, "kv_segment_cell_bytes", "--kv-segment-cell-bytes"),
                "--kv-segment-cell-bytes", why),
            kv_segments=_need_figure(_model_figure(args, trace, "kv_segments", "--kv-segments"),
                                     "--kv-segments", why),
            chunk_bytes=args.chunk_bytes,
            budget_bytes=None if args.budget_mib is None else int(args.budget_mib * MiB),
            floor_slots=args.floor_slots,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _cost_model(args: argparse.Namespace, trace: Trace) -> CostModel | None:
    flags = {key: getattr(args, key) for key in ("device_gbps", "host_gbps", "pcie_gbps")}
    given = [key for key, value in flags.items() if value is not None]
    if not given and args.bandwidths is None:
        return None
    try:
        if args.bandwidths is not None:
            measured = Bandwidths.from_json(args.bandwidths)
            bandwidths = Bandwidths(**{k: flags[k] or getattr(measured, k) for k in flags})
        elif len(given) < len(flags):
            missing = [f"--{k.replace('_', '-')}" for k in flags if flags[k] is None]
            raise UsageError(f"the cost model needs {', '.join(missing)} too (or --bandwidths)")
        else:
            bandwidths = Bandwidths(**flags)
        slot_bytes = _need_figure(_model_figure(args, trace, "slot_bytes", "--slot-bytes"),
                                  "--slot-bytes", "the cost model")
        return CostModel(bandwidths, expert_bytes=slot_bytes,
                         dense_bytes=int(args.dense_mib * MiB))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _profile(args: argparse.Namespace, trace: Trace) -> tuple[np.ndarray | None, str]:
    """(counts [L, E] or None, a description)."""
    if args.profile == "self":
        return trace.routing_counts(), "self (the trace's own counts: static = oracle static)"
    if args.profile == "none":
        return None, "none (the cache starts empty)"
    want = (trace.n_layers, trace.n_experts)
    try:
        is_trace, counts = _profile_counts(args.profile, want)
    except FileNotFoundError:
        raise UsageError(f"--profile: no file at {args.profile}") from None
    if is_trace:
        try:
            counts = load_trace(args.profile).routing_counts()
        except TraceError as exc:
            raise UsageError(f"--profile: {exc}") from None
    elif counts is None:
        raise UsageError(f"--profile {args.profile} is neither a trace nor an .npz with "
                         "'counts' [L, E]")
    if counts.shape != want or counts.dtype.kind not in "iuf" or not np.isfinite(counts).all() \
            or (counts < 0).any():
        raise UsageError(f"--profile {args.profile}: counts must be finite, >= 0 and of shape "
                         f"{want} (the trace's layers and experts), got {counts.dtype} "
                         f"{counts.shape}")
    return counts, args.profile


def _profile_counts(path: str, want: tuple[int, int]) -> tuple[bool, np.ndarray | None]:
    """(whether `path` is a routing trace, its 'counts' array or None), through the one .npz
    reader: counts of another shape than `want` are refused before they are read."""
    with open_npz(path, short="profile", error=UsageError) as npz:
        header = npz.members.get("format")
        if header is not None and header.shape == () and header.dtype.kind == "U" \
                and str(npz.read("format")) == FORMAT:
            return True, None
        counts = npz.members.get("counts")
        if counts is None:
            return False, None
        if counts.shape != want:
            raise UsageError(f"--profile {path}: counts must be finite, >= 0 and of shape "
                             f"{want} (the trace's layers and experts), got {counts.dtype} "
                             f"{counts.shape}")
        return False, npz.read("counts")


def _progress(args: argparse.Namespace, total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="step", disable=True if args.quiet else None,
                file=sys.stderr, leave=False, desc="replaying")


def simulate(args: argparse.Namespace, trace: Trace) -> tuple[list[ReplayResult], dict]:
    """The options' sweep (`strata.sim.sweep`) and the settings it ran with, for the output;
    UsageError for a bad option, naming the flag."""
    registry = load_registry()
    specs = _policies(args, registry)
    kv = _kv_config(args, trace)
    profile, profile_text = _profile(args, trace)
    if args.loan_slots < 0:
        raise UsageError(f"--loan-slots must be >= 0, got {args.loan_slots}")
    for slots in args.slots:
        if args.loan_slots > slots:
            raise UsageError(f"--loan-slots {args.loan_slots} exceeds --slots {slots}")
    with _progress(args, sweep_steps(trace, len(specs), len(args.slots))) as bar:
        try:
            results = sweep(
                trace, specs, args.slots, registry=registry, loan_slots=args.loan_slots, kv=kv,
                profile=profile, path=args.path, bounds=args.bounds, on_step=bar.update,
                on_replay=lambda label, slots: bar.set_postfix_str(f"{label} @ {slots}"),
            )
        except PolicyError as exc:
            raise UsageError(f"{exc} (STRATA_TRACE_PLUGINS=1 prints every decision)") from None
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    settings = {
        "profile": profile_text,
        "loan_slots": args.loan_slots,
        "kv": None if kv is None else {
            "max_context": kv.max_context, "slot_bytes": kv.slot_bytes,
            "kv_segment_cell_bytes": kv.kv_segment_cell_bytes, "kv_segments": kv.kv_segments,
            "chunk_bytes": kv.chunk_bytes, "budget_bytes": kv.budget_bytes,
            "floor_slots": kv.floor_slots,
        },
    }
    return results, settings


def _table(rows: Sequence[dict[str, Any]], with_cost: bool) -> str:
    head = ["policy", "path", "slots", "hit rate", "decode", "hits", "misses", "admitted",
            "evicted", "moved", "refilled"]
    if with_cost:
        head += ["ms/round", "decode tok/s"]
    body = []
    for row in rows:
        line = [row["policy"], row["path"], str(row["slots"]), f"{row['hit_rate']:.4f}",
                f"{row['decode']['hit_rate']:.4f}", str(row["hits"]), str(row["misses"]),
                str(row["admissions"]), str(row["evictions"]), str(row["relocations"]),
                str(row["refills"])]
        if with_cost:
            cost = row["cost"]
            line += ["-" if cost["decode_round_ms"] is None else f"{cost['decode_round_ms']:.2f}",
                     "-" if cost["decode_tok_s"] is None else f"{cost['decode_tok_s']:.1f}"]
        body.append(line)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths, strict=True)))
    return "\n".join([fmt(head), *map(fmt, body)])


def _check_plot(args: argparse.Namespace) -> None:
    """--plot's format (its suffix) and matplotlib, checked before the replays, not after."""
    from strata.sim.plot import check_plot_target

    try:
        check_plot_target(args.plot)
    except ValueError as exc:
        raise UsageError(f"--plot {exc}") from None
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'strata[plot]'") from None
    if 0 in args.slots:
        raise UsageError("--plot draws cache sizes on a log2 axis, where --slots 0 has no "
                         "place: leave it out, or drop --plot")


def _headings(args: argparse.Namespace, trace: Trace, settings: dict) -> tuple[str, str]:
    """The trace's shape and the settings: the table's first lines, the plot's title."""
    s = trace.summary()
    return (f"{args.trace}: {s['requests']} requests, {s['steps']} steps, {s['accesses']} "
            f"accesses ({s['n_layers']} layers x top-{s['top_k']} of {s['n_experts']})",
            f"profile: {settings['profile']}; loan slots: {args.loan_slots}; "
            f"K/V: {'grows' if settings['kv'] else 'fixed'}")


def run(args: argparse.Namespace) -> int:
    """`strata simulate`: the sweep the options ask for, as a table or one JSON object."""
    if args.plot:
        _check_plot(args)
    trace = read_trace(args.trace)
    cost = _cost_model(args, trace)
    results, settings = simulate(args, trace)
    rows = []
    for result in results:
        row = result.to_dict(per_layer=args.json)
        if cost is not None:
            row["cost"] = cost.estimate(result, trace.step_tokens)
        rows.append(row)
    if args.plot:
        from strata.sim.plot import plot_hit_rates

        try:
            plot_hit_rates(results, args.plot, *_headings(args, trace, settings))
        except OSError as exc:
            raise UsageError(f"cannot write the plot to {args.plot}: {exc.strerror}") from None
    if args.json:
        settings["cost"] = None if cost is None else cost.describe()
        summary = trace.summary()
        print(json.dumps({
            "format": OUTPUT_FORMAT,
            "version": OUTPUT_VERSION,
            "trace": {"path": args.trace, **summary},
            "settings": settings,
            "results": rows,
        }, indent=2, sort_keys=True))
        return 0
    shape, settings_line = _headings(args, trace, settings)
    print(f"trace {shape}\n{settings_line}")
    print(_table(rows, cost is not None))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `strata simulate` to `subparsers`."""
    parser = subparsers.add_parser(
        "simulate",
        help="replay a routing trace through cache policies, beside Belady's bound",
        description=(
            "Replay a routing trace through one or more policies at one or more cache sizes, "
            "against the books alone (no model, no GPU), with the same policy code and checks "
            "as the engine. Prints hits, misses and what each policy did; Belady's MIN with "
            "bypass and the oracle static set are shown beside as upper bounds."
        ),
    )
    parser.set_defaults(run=run, policies=[], leading_opts=[])
    parser.add_argument("trace", metavar="TRACE", help="a routing trace (.npz)")
    group = parser.add_argument_group("policies and cache")
    group.add_argument("--policy", action=_PolicyAction, metavar="NAME",
                       help=f"a policy to replay; repeat for more (default {DEFAULT_POLICY}; "
                            "`strata policies` lists them)")
    group.add_argument("--policy-opt", action=_PolicyOptAction, metavar="KEY=VALUE",
                       help="an option of the --policy before it; repeat for more")
    group.add_argument("--slots", type=_slot_list, required=True, metavar="N[,N...]",
                       help="cache sizes in slots")
    group.add_argument("--loan-slots", type=int, default=0, metavar="N",
                       help="the top N slots are the loan region (0)")
    group.add_argument("--profile", default="self", metavar="self|none|PATH",
                       help="fills the cache at start, hottest first: 'self' (the trace's own "
                            "counts, the default), 'none' (empty), a calibration trace, or an "
                            ".npz with 'counts' [L, E]")
    group.add_argument("--bounds", type=_bound_list, default=list(DEFAULT_BOUNDS),
                       metavar="LIST", help=f"bounds shown beside: a comma list of "
                                            f"{', '.join(BOUNDS)}, or none "
                                            f"({','.join(DEFAULT_BOUNDS)})")
    group.add_argument("--path", choices=PATH_CHOICES, default="auto",
                       help="auto: the fastest exact path per policy; generic: step every "
                            "policy through the engine's sequence")
    kv = parser.add_argument_group("elastic K/V")
    kv.add_argument("--kv-grow", action="store_true",
                    help="simulate the K/V growing and trimming at request boundaries")
    kv.add_argument("--max-context", type=int, metavar="CELLS",
                    help="the K/V window (default: the longest request)")
    kv.add_argument("--budget-mib", type=float, metavar="MiB",
                    help="device memory for the arena and the K/V (default: what the start "
                         "takes, so every growth takes slots)")
    kv.add_argument("--floor-slots", type=int, default=DEFAULT_FLOOR_SLOTS, metavar="N",
                    help=f"the fewest slots the cache keeps ({DEFAULT_FLOOR_SLOTS})")
    kv.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, metavar="BYTES",
                    help=f"the device's chunk ({DEFAULT_CHUNK_BYTES})")
    model = parser.add_argument_group("model geometry (default: the trace's meta)")
    model.add_argument("--slot-bytes", type=int, metavar="BYTES", help="bytes of one expert")
    model.add_argument("--kv-segment-cell-bytes", type=int, metavar="BYTES",
                       help="bytes of one cell of one layer's K (or V)")
    model.add_argument("--kv-segments", type=int, metavar="N",
                       help="K/V segments (2 a layer, and int8 cells' scale segments)")
    cost = parser.add_argument_group("cost model (estimated tok/s)")
    cost.add_argument("--bandwidths", metavar="JSON",
                      help="device_gbps, host_gbps, pcie_gbps from a file (flags override)")
    cost.add_argument("--device-gbps", type=float, metavar="GB/s", help="device memory")
    cost.add_argument("--host-gbps", type=float, metavar="GB/s", help="host memory, CPU reads")
    cost.add_argument("--pcie-gbps", type=float, metavar="GB/s", help="host to device")
    cost.add_argument("--dense-mib", type=float, default=0.0, metavar="MiB",
                      help="dense weights read every round (0)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--plot", metavar="FILE",
                     help="draw hit rate and decode hit rate against cache size, the bounds "
                          "beside; the format from the suffix: .png, .pdf or .svg")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
