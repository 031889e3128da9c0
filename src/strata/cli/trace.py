"""`strata trace synth OUT ...` and `strata trace info TRACE`: make and inspect routing traces."""

from __future__ import annotations

import argparse
import json

from strata.cli.errors import UsageError
from strata.formats.trace import TraceError, load_trace, save_trace
from strata.machine import bytes_text, host_limit
from strata.sim.synth import KINDS, SynthSpec, synth_trace


def _tokens(text: str) -> tuple[int, int]:
    """'N' or 'LO:HI' (inclusive) tokens per request."""
    lo, sep, hi = text.partition(":")
    try:
        span = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token count: want N or LO:HI, e.g. 256 or 64:1024") from None
    if not 0 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: want 0 <= LO <= HI")
    return span


def read_trace(path: str):
    """The trace at `path`, or UsageError saying why not."""
    try:
        return load_trace(path)
    except (FileNotFoundError, TraceError) as exc:
        raise UsageError(str(exc)) from None


def run_synth(args: argparse.Namespace) -> int:
    """`strata trace synth`: write a seeded synthetic trace."""
    try:
        spec = SynthSpec(
            kind=args.kind, n_layers=args.layers, n_experts=args.experts, top_k=args.top_k,
            n_requests=args.requests, prompt_tokens=args.prompt_tokens,
            decode_tokens=args.decode_tokens, prompt_chunk=args.prompt_chunk,
            zipf_s=args.zipf_s, markov_p=args.markov_p, seed=args.seed,
            popularity_seed=args.popularity_seed,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _check_synth_size(spec)
    trace = synth_trace(spec)
    try:
        save_trace(trace, args.out)
    except OSError as exc:
        raise UsageError(f"cannot write {args.out}: {exc}") from None
    print(f"wrote {args.out}: {trace.n_requests} requests, {trace.n_steps} steps, "
          f"{trace.n_tokens} tokens, {trace.n_accesses} accesses "
          f"({trace.n_layers} layers x top-{trace.top_k} of {trace.n_experts})")
    return 0


def _check_synth_size(spec: SynthSpec) -> None:
    """UsageError, with the figure and the host's limit, for a trace too large to make: its
    routing ids (int32 [N, L, K], then int16 to write), two Python list entries a step, and
    the experts' popularity draws (float64 and int64 [L, E]), at the most tokens it may hold."""
    tokens = spec.n_requests * (spec.prompt_tokens[1] + spec.decode_tokens[1])
    need = tokens * (spec.n_layers * spec.top_k * 6 + 16) + spec.n_layers * spec.n_experts * 24
    limit = host_limit()
    if need > limit.nbytes:
        raise UsageError(
            f"a trace of up to {tokens:,} tokens x {spec.n_layers} layers x top-{spec.top_k} of "
            f"{spec.n_experts} experts needs about {bytes_text(need)}, more than {limit}; "
            "lower --requests, --prompt-tokens, --decode-tokens, --layers or --experts"
        )


def run_info(args: argparse.Namespace) -> int:
    """`strata trace info`: check a trace and print its figures."""
    summary = read_trace(args.trace).summary()
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    meta = summary.pop("meta")
    width = max(len(key) for key in summary)
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    if meta:
        print(f"{'meta':<{width}}  {json.dumps(meta, sort_keys=True)}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `strata trace synth` and `strata trace info` to `subparsers`."""
    parser = subparsers.add_parser(
        "trace",
        help="make synthetic routing traces, and inspect traces",
        description="Routing traces for `strata simulate`; their format is in "
                    "docs/sim/reference.md, \"The trace format\".",
    )
    commands = parser.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    synth = commands.add_parser(
        "synth",
        help="write a synthetic trace",
        description=(
            "Write a seeded synthetic trace: uniform routing, Zipf popularity per layer "
            "(exponent --zipf-s), or Zipf with Markov correlation between consecutive tokens "
            "(--markov-p). The same arguments always write the same bytes."
        ),
    )
    synth.add_argument("out", metavar="OUT", help="the .npz to write")
    synth.add_argument("--kind", choices=KINDS, default="zipf")
    synth.add_argument("--layers", type=int, default=48, help="MoE layers (48)")
    synth.add_argument("--experts", type=int, default=128, help="routed experts per layer (128)")
    synth.add_argument("--top-k", type=int, default=8, help="experts per token (8)")
    synth.add_argument("--requests", type=int, default=4, help="requests (4)")
    synth.add_argument("--prompt-tokens", type=_tokens, default=(256, 256), metavar="N|LO:HI",
                       help="prompt tokens per request, or a range drawn per request (256)")
    synth.add_argument("--decode-tokens", type=_tokens, default=(256, 256), metavar="N|LO:HI",
                       help="decoded tokens per request, one step each (256)")
    synth.add_argument("--prompt-chunk", type=int, default=512,
                       help="prompt tokens per prompt step (512)")
    synth.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent (1.0)")
    synth.add_argument("--markov-p", type=float, default=0.5,
                       help="markov: chance an expert repeats the previous token's (0.5)")
    synth.add_argument("--seed", type=int, default=0, help="seeds the routing draws (0)")
    synth.add_argument("--popularity-seed", type=int, default=0,
                       help="seeds which expert is how popular; keep it to make a "
                            "calibration trace of the same workload (0)")
    synth.set_defaults(run=run_synth)
    info = commands.add_parser("info", help="print a trace's figures",
                               description="Check a trace and print its figures.")
    info.add_argument("trace", metavar="TRACE")
    info.add_argument("--json", action="store_true", help="print JSON, for scripts")
    info.set_defaults(run=run_info)
