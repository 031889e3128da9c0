"""bench/decode.py's table: each engine's prefill and decode, and the shares of the bounds."""

from __future__ import annotations


def si(n_bytes: float) -> str:
    """Bytes in GB, MB or kB, three significant digits."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.3g} {unit}"
    return f"{n_bytes:.0f} B"


def print_report(result: dict, args) -> None:
    """bench/decode.py's `result` (its JSON) as lines of text."""
    strata, peer = result["strata"], result["transformers"]
    compiled, loop = result["strata_compiled"], result["strata_loop_prefill"]
    sampled, plain = result["strata_cli_sampling"], result["strata_plain_loop"]
    in_graph, argmax = result["strata_pick_in_graph"], result["strata_argmax"]
    prefills, quantized = result["prefill_lengths"], result["quantized"]
    matmul_tflops, token_bytes = result["matmul_tflops"], result["bytes_per_token"]
    bandwidth_gbs, bound_tok_s = result["bandwidth_gbs"], result["bound_tok_s"]
    print(
        f"decode at batch 1: {result['family']} {result['preset']} ({result['layers']} "
        f"layers), {args.dtype}, "
        f"{result['device_name']} ({result['device']}); {args.prompt_tokens}-token prompt, "
        f"{args.new_tokens} new tokens, greedy; medians of {args.repeat}"
    )
    print(f"{'engine':<14}{'prefill tok/s':>15}{'decode tok/s':>14}{'ms/round':>10}")
    for name, figures in (("strata", strata), ("strata+compile", compiled),
                          ("strata-loop", loop), ("strata-cli", sampled),
                          ("strata-plain", plain), ("strata-pick", in_graph),
                          ("strata-argmax", argmax),
                          ("transformers", peer)):
        if figures:
            print(
                f"{name:<14}{figures['prefill_tok_s']:>15.1f}{figures['decode_tok_s']:>14.1f}"
                f"{figures['decode_ms_per_round']:>10.2f}"
            )
    print(f"strata decode path: {strata['decode_path']}; repeat runs identical: "
          f"{strata['deterministic']}")
    if plain:
        print(f"strata-plain: each round's token read before the next round is launched; "
              f"the round ahead is {result['ahead_speedup']:.3f}x; the same tokens: "
              f"{plain['tokens'] == strata['tokens']}")
    if in_graph:
        where = "inside" if result["pick_in_graph"] else "outside"
        print(f"strata-pick: each greedy pick {where} the round's CUDA graph; "
              f"{result['pick_in_graph_speedup']:.3f}x the default's decode tok/s; the same "
              f"tokens: {in_graph['same_tokens']}")
    if argmax:
        how = "one kernel" if result["argmax_kernel"] else "torch's argmax"
        print(f"strata-argmax: each greedy pick by {how}; {result['argmax_speedup']:.3f}x the "
              f"default's decode tok/s; the same tokens: {argmax['same_tokens']}")
    if sampled:
        print(f"strata-cli: `strata generate`'s default sampling {result['cli_sampling']}; "
              f"repeat runs identical: {sampled['deterministic']}")
    if peer:
        print(f"ratio strata / transformers (decode tok/s): {result['ratio']:.2f}x")
        if compiled:
            print(f"ratio strata+compile / transformers: {result['ratio_compiled']:.2f}x; "
                  f"repeat runs identical: {compiled['deterministic']}")
        print(
            f"greedy tokens equal to transformers' up to token "
            f"{result['tokens_equal_prefix']} of {args.new_tokens}"
        )
    if result["moe_share"] is not None:
        print(f"MoE of a {min(args.prompt_tokens, strata['prefill_chunk'])}-token chunk, every "
              f"layer: {1000 * strata['moe_s']:.2f} ms, {strata['moe_tflops']:.1f} TFLOP/s, "
              f"{100 * result['moe_share']:.1f}% of {matmul_tflops:.0f}")
    if peer:
        print(f"prefill strata / transformers: {result['prefill_ratio']:.2f}x")
    for row in prefills:
        versus = "" if row["transformers_tok_s"] is None else (
            f", transformers {row['transformers_tok_s']:,.0f} tok/s: {row['ratio']:.2f}x")
        moe = "" if row["moe_share"] is None else (
            f"; MoE of its {row['moe_tokens']}-token chunk {row['moe_tflops']:.1f} TFLOP/s, "
            f"{100 * row['moe_share']:.1f}% of {matmul_tflops:.0f}")
        print(f"prefill of {row['prompt_tokens']:,} tokens (chunks of {row['prefill_chunk']}): "
              f"strata {row['strata_tok_s']:,.0f} tok/s{versus}{moe}")
    for fmt, figures in quantized.items():
        share = "" if figures["bound_share"] is None else (
            f"; bound {figures['bound_tok_s']:.0f} tok/s at {si(figures['bytes_per_token'])} a "
            f"token: {100 * figures['bound_share']:.1f}%")
        print(f"experts {fmt}: prefill {figures['prefill_tok_s']:.1f} tok/s, decode "
              f"{figures['decode_tok_s']:.1f} tok/s ({figures['speedup']:.2f}x {args.dtype}'s, "
              f"{figures['decode_path']}, repeat runs identical: {figures['deterministic']})"
              f"{share}; greedy tokens equal to {args.dtype}'s up to token "
              f"{figures['tokens_equal_prefix']}")
    line = f"bytes read per token: {si(token_bytes)}"
    if bound_tok_s:
        line += (
            f"; bound at {bandwidth_gbs:.0f} GB/s ({result['bandwidth_from']}): "
            f"{bound_tok_s:.0f} tok/s; strata reaches "
            f"{100 * result['bound_share']:.1f}%"
        )
        if sampled:
            line += f" (strata-cli {100 * result['bound_share_cli_sampling']:.1f}%)"
    print(line)
