"""The generation loop on real tiny checkpoints: parity, determinism, stops, limits."""

import dataclasses
import json
import math

import pytest
import torch

from strata.engine.kv.kv_cache import new_kv
from strata.engine.model.moe import load_model
from strata.engine.model.tokenizer import Tokenizer
from strata.engine.runtime.generate import GenerateOptions, check_prompt, generate
from support.bench_scripts import load_bench
from support.checkpoints import cached_checkpoint

GREEDY = GenerateOptions(max_new=24, temperature=0.0, ignore_stop=True)


def _load(family="qwen3_moe", dtype=torch.float32):
    ckpt = cached_checkpoint(family, "tiny", dtype=dtype)
    return load_model(ckpt), Tokenizer.from_dir(ckpt), ckpt


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_greedy_tokens_match_transformers_generate(family):
    transformers = pytest.importorskip("transformers")
    model, tok, ckpt = _load(family)
    prompt = tok.encode("The quick brown fox")
    # Chunks of 5 make the prefill cross chunk boundaries at unaligned positions.
    result = generate(model, tok, prompt, dataclasses.replace(GREEDY, prefill_chunk=5))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
        eos_token_id=None, pad_token_id=259,
    )
    assert result.tokens == out[0, len(prompt):].tolist()
    assert result.stop_reason == "max_new" and result.decode_rounds == 23


def test_same_seed_same_tokens_and_first_logits_bytes():
    runs = []
    for _ in range(2):
        model, tok, _ = _load("mixtral", dtype=torch.bfloat16)  # a fresh load each time
        options = GenerateOptions(max_new=16, temperature=1.0, top_p=0.9, seed=5, ignore_stop=True)
        runs.append(generate(model, tok, tok.encode("seeded"), options))
    a, b = runs
    assert a.tokens == b.tokens
    assert a.first_logits.numpy().tobytes() == b.first_logits.numpy().tobytes()
    other = generate(model, tok, tok.encode("seeded"), dataclasses.replace(options, seed=6))
    assert other.tokens != a.tokens
    assert torch.equal(other.first_logits, a.first_logits)  # the seed only moves the draws


def test_first_logits_are_the_last_prompt_position():
    model, tok, _ = _load()
    prompt = tok.encode("abcdef")
    result = generate(model, tok, prompt, dataclasses.replace(GREEDY, max_new=1))
    with new_kv(model, 16) as kv:
        expected = model.forward(torch.tensor(prompt), 0, kv)[-1]
    torch.testing.assert_close(result.first_logits, expected, rtol=1e-5, atol=1e-5)
    assert result.first_logits.dtype == torch.float32
    assert result.tokens == [int(expected.argmax())]
    assert result.decode_rounds == 0 and result.decode_tok_s == 0.0


def test_streamed_pieces_are_the_text():
    model, tok, _ = _load()
    pieces = []
    options = GenerateOptions(max_new=40, temperature=1.0, seed=1, ignore_stop=True)
    result = generate(model, tok, tok.encode("stream"), options, on_text=pieces.append)
    assert "".join(pieces) == result.text == tok.decode(result.tokens)
    assert all(pieces)


def test_a_stop_id_ends_generation_and_stays_out_of_the_text():
    model, tok, _ = _load()
    prompt = tok.encode("stop here")
    free = generate(model, tok, prompt, GREEDY).tokens
    stop = free[5]
    cut = free.index(stop)
    result = generate(model, tok, prompt, dataclasses.replace(GREEDY, ignore_stop=False,
                                                              stop_ids=(stop,)))
    assert result.tokens == free[: cut + 1]
    assert result.stop_reason == "eos"
    assert result.text == tok.decode(free[:cut])


def test_stats_are_consistent():
    model, tok, _ = _load()
    result = generate(model, tok, tok.encode("count"), dataclasses.replace(GREEDY, max_new=8))
    stats = result.stats()
    assert stats["prompt_tokens"] == 5 and stats["generated_tokens"] == 8
    assert stats["decode_rounds"] == 7 and stats["decode_path"] == "eager"
    assert stats["prefill_tok_s"] == pytest.approx(5 / stats["prefill_s"])
    assert stats["decode_ms_per_round"] == pytest.approx(1000 * stats["decode_s"] / 7)
    assert stats["decode_tok_s"] == pytest.approx(7 / stats["decode_s"])


@pytest.mark.parametrize(
    ("prompt", "options", "message"),
    [
        ([], GREEDY, "the prompt is empty"),
        ([1] * 10, GenerateOptions(max_new=7, max_context=16), r"10 tokens \+ --max-new 7 = 17 "
                                                               "exceed --max-context 16"),
        ([1, 260, 2], GREEDY, r"id 260 is outside the model's vocabulary \[0, 260\)"),
    ],
)
def test_bad_prompts_are_refused_before_any_work(prompt, options, message):
    with pytest.raises(ValueError, match=message):
        check_prompt(prompt, options, vocab_size=260)
    model, tok, _ = _load()
    with pytest.raises(ValueError, match=message):
        generate(model, tok, prompt, options)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_new": 0}, "max_new must be a positive int"),
        ({"max_context": -1}, "max_context must be a positive int"),
        ({"prefill_chunk": 0}, "prefill_chunk must be a positive int"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
    ],
)
def test_bad_options_are_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(GREEDY, **change)


def test_a_vocabulary_beyond_the_tokenizer_streams_replacement_chars(tmp_path):
    # Like the big presets: config and embeddings of 4096 ids, a tokenizer of 260.
    from strata.engine.model.init_model import write_checkpoint
    from strata.engine.model.presets import PRESETS

    shape = dataclasses.replace(PRESETS["tiny"], vocab_size=4096)
    ckpt = write_checkpoint(tmp_path / "wide", "mixtral", shape)
    model, tok = load_model(ckpt), Tokenizer.from_dir(ckpt)
    pieces = []
    options = GenerateOptions(max_new=12, temperature=1.0, seed=2, ignore_stop=True)
    result = generate(model, tok, tok.encode("wide"), options, on_text=pieces.append)
    unknown = [t for t in result.tokens if t >= tok.vocab_size]
    assert unknown  # 94% of the ids are beyond the tokenizer
    assert result.text.count("\ufffd") >= len(unknown)
    assert "".join(pieces) == result.text


def test_the_decode_bench_runs_and_reports(capsys):
    pytest.importorskip("transformers")
    bench = load_bench("decode.py")
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "12", "--repeat", "1",
            "--prefill-lengths", "20", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["prefill_lengths"]
    assert row["prompt_tokens"] == 20 and row["strata_tok_s"] > 0 and row["deterministic"]
    assert row["ratio"] == row["strata_tok_s"] / row["transformers_tok_s"]
    assert row["moe_share"] is None  # no matrix rate given on the CPU
    # transformers' decode is the difference of two timed runs: on a busy machine a run this
    # short can leave none, which the bench reports as nan rather than a made-up rate.
    peer = report["transformers"]["decode_tok_s"]
    assert report["strata"]["decode_tok_s"] > 0 and (peer > 0 or math.isnan(peer))
    assert report["ratio"] > 0 or math.isnan(peer)
    assert report["tokens_equal_prefix"] >= 1  # the first token agrees
    assert report["bound_share"] is None  # no bandwidth given on the CPU
    assert report["bytes_per_token"] > 0
    assert report["moe_share"] is None


def test_the_decode_bench_times_the_moe_of_a_chunk(capsys):
    bench = load_bench("decode.py")
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "4", "--repeat", "1",
            "--prompt-tokens", "40", "--prefill-chunk", "16", "--matmul-tflops", "1",
            "--no-transformers"]
    assert bench.main([*argv, "--prefill-lengths", "24,40"]) == 0
    printed = capsys.readouterr().out
    assert "MoE of a 16-token chunk, every layer:" in printed
    assert "prefill of 40 tokens (chunks of 16): strata" in printed
    assert bench.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prefill_chunk"] == 16
    assert 0 < report["moe_share"] == report["strata"]["moe_tflops"] / 1.0
    assert report["prefill_lengths"] == []


def test_the_decode_bench_runs_the_clis_default_sampling_and_the_plain_loop_too(capsys):
    from strata.engine.runtime import decode_loop, decode_steps, sampling

    bench = load_bench("decode.py")
    defaults = bench.cli_sampling()
    assert defaults["temperature"] > 0 and 0 < defaults["top_p"] <= 1  # not greedy
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "6", "--repeat", "2",
            "--no-transformers", "--cli-sampling", "--plain-loop", "--pick-in-graph",
            "--argmax-kernel", "--bandwidth-gbs", "10"]
    switches = (decode_loop.AHEAD_PATHS, decode_steps.GREEDY_PICK_IN_GRAPH,
                sampling.ARGMAX_KERNEL)
    assert bench.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    sampled = report["strata_cli_sampling"]
    assert report["cli_sampling"] == defaults
    assert sampled["decode_tok_s"] > 0 and sampled["deterministic"]  # the same seed, the same
    assert report["bound_share_cli_sampling"] == sampled["decode_tok_s"] / report["bound_tok_s"]
    assert report["bandwidth_gbs"] == 10 and report["bandwidth_from"] == "given"
    assert report["measured_copy_gbs"] is None  # measured on CUDA only
    plain = report["strata_plain_loop"]  # the round ahead's A/B: the same tokens
    assert plain["tokens"] == report["strata"]["tokens"] and report["ahead_speedup"] > 0
    in_graph = report["strata_pick_in_graph"]  # eager rounds on the CPU: the same path
    assert in_graph["same_tokens"] and report["pick_in_graph_speedup"] > 0
    assert report["pick_in_graph"] is (not decode_steps.GREEDY_PICK_IN_GRAPH)
    argmax = report["strata_argmax"]
    assert argmax["same_tokens"] and report["argmax_speedup"] > 0
    assert report["argmax_kernel"] is (not sampling.ARGMAX_KERNEL)
    assert switches == (decode_loop.AHEAD_PATHS, decode_steps.GREEDY_PICK_IN_GRAPH,
                        sampling.ARGMAX_KERNEL)  # put back
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "strata-cli: `strata generate`'s default sampling" in printed
    assert "strata-plain: each round's token read before the next round" in printed
    where = "outside" if decode_steps.GREEDY_PICK_IN_GRAPH else "inside"
    assert f"strata-pick: each greedy pick {where} the round's CUDA graph" in printed
    how = "torch's argmax" if sampling.ARGMAX_KERNEL else "one kernel"
    assert f"strata-argmax: each greedy pick by {how}" in printed
    assert "bound at 10 GB/s (given)" in printed


def test_the_benches_rates_are_the_h200s_there_and_measured_on_another_device(monkeypatch):
    """An H200's rates are issue 16's constants (its measured ones recorded beside them);
    another device's are measured in the run (a copy's bytes read and written, a bf16
    product's FLOPs), so that a share is of the device's own rate."""
    common = load_bench("_common.py")
    cpu = common.device_rates(torch.device("cpu"), copy_mib=16, matmul_n=256)
    assert 0.1 < cpu.bandwidth_gbs < 10_000 and 0 < cpu.matmul_tflops < 1000
    assert cpu.source == "measured in this run"
    assert (cpu.measured_copy_gbs, cpu.measured_matmul_tflops) == \
        (cpu.bandwidth_gbs, cpu.matmul_tflops)
    # An H200 (named so; its measurements stood in by the CPU's): the constants, and the
    # measured rates beside them.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(common, "_copy_gbs", lambda device, mib: 123.0)
    monkeypatch.setattr(common, "_matmul_tflops", lambda device, n: 4.5)
    monkeypatch.setattr(common, "free_memory", lambda device: None)
    assert common.device_rates(torch.device("cuda")) == (
        common.H200_BANDWIDTH_GBS, common.H200_MATMUL_TFLOPS, "the H200's (issue 16's bound)",
        123.0, 4.5)


def test_the_decode_bench_refuses_bad_prefill_lengths(capsys):
    bench = load_bench("decode.py")
    for bad in ("0", "12,x", "-5"):
        with pytest.raises(SystemExit):
            bench.main(["--preset", "tiny", "--device", "cpu", "--prefill-lengths", bad])
        assert "--prefill-lengths takes comma-separated token counts >= 1" in \
            capsys.readouterr().err


def test_the_decode_profile_times_chunks_and_rounds(tmp_path, capsys):
    bench = load_bench("decode_profile.py")
    out = tmp_path / "profile.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--prompt-tokens", "8,24", "--repeat", "2",
            "--no-compile", "--host-profile", "--json", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "host time of prompt chunk of 24" in printed and "decode, eager:" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [row["label"] for row in rows] == ["prompt chunk of 8", "prompt chunk of 24",
                                              "decode, eager"]
    assert all(row["ms"] > 0 and row["n_kernels"] == 0 for row in rows)  # no CUDA kernels


def test_rounds_side_by_side_are_timed_by_sweep_each_after_a_round_of_its_own(monkeypatch):
    """`_common.side_by_side`: every timed round follows an untimed round of the same function
    (never the one timed before it), sweeps alternate their order, and each round's ratio is
    taken against the default's round of the same sweep, so that a sweep's drift cancels."""
    common = load_bench("_common.py")
    calls: list[str] = []
    sweep_speed = iter([1.0, 1.0, 2.0, 2.0, 1.5, 1.5])  # the machine drifts sweep to sweep
    seconds = {"default": 1.0, "faster": 0.8}

    def wall_times_s(fn, device, repeat):
        fn()
        return [seconds[calls[-1]] * next(sweep_speed)]

    def round_of(name):
        return lambda: calls.append(name)

    monkeypatch.setattr(common, "wall_times_s", wall_times_s)
    default, faster = common.side_by_side([round_of("default"), round_of("faster")],
                                          torch.device("cpu"), 3)
    assert calls == ["default"] * 2 + ["faster"] * 4 + ["default"] * 4 + ["faster"] * 2
    assert default["x_default"] == 1.0 and default["x_default_q"] == [1.0, 1.0]
    assert faster["x_default"] == pytest.approx(1.25)  # 1 / 0.8 in every sweep
    assert faster["x_default_q"] == [pytest.approx(1.25)] * 2
    assert faster["ms"] == pytest.approx(1200.0)  # 0.8 x the median drift 1.5


def test_the_decode_profile_prints_each_row_against_the_default(monkeypatch, capsys):
    bench = load_bench("decode_profile.py")
    figures = [{"ms": 1.0, "x_default": 1.0, "x_default_q": [1.0, 1.0]},
               {"ms": 0.8, "x_default": 1.25, "x_default_q": [1.2, 1.3]}]
    monkeypatch.setattr(bench, "side_by_side", lambda rounds, device, sweeps: figures)
    rows = [{"label": "default"}, {"label": "faster"}]
    bench.interleaved([(row, None) for row in rows], torch.device("cpu"), 3)
    assert rows[1]["ms_interleaved"] == 0.8 and rows[1]["x_default_q"] == [1.2, 1.3]
    assert "1.250x (1.200-1.300)  faster" in capsys.readouterr().out


def test_the_decode_bench_runs_quantized_experts_against_their_bound(capsys):
    bench = load_bench("decode.py")
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "4", "--repeat", "1",
            "--no-transformers", "--experts-dtype", "int8,int4", "--bandwidth-gbs", "10"]
    assert bench.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    int8, int4 = report["quantized"]["int8"], report["quantized"]["int4"]
    assert report["bytes_per_token"] > int8["bytes_per_token"] > int4["bytes_per_token"]
    for figures in (int8, int4):
        assert figures["decode_tok_s"] > 0 and figures["deterministic"]
        assert figures["bound_share"] == figures["decode_tok_s"] / figures["bound_tok_s"]
    assert bench.main(argv) == 0
    assert "experts int8: prefill" in capsys.readouterr().out


@pytest.mark.cuda
def test_cuda_graph_rounds_match_eager_rounds_across_windows():
    ckpt = cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32)
    model, tok = load_model(ckpt, device="cuda"), Tokenizer.from_dir(ckpt)
    prompt = tok.encode("graphs")
    # 300 rounds from position 6 cross the 256-cell window: two graphs, both captured up front.
    options = GenerateOptions(max_new=300, max_context=512, temperature=0.0, ignore_stop=True)
    graph = generate(model, tok, prompt, options)
    eager = generate(model, tok, prompt, dataclasses.replace(options, cuda_graphs=False))
    again = generate(model, tok, prompt, options)
    assert (graph.decode_path, eager.decode_path) == ("cuda-graph", "eager")
    assert graph.tokens == eager.tokens
    assert again.tokens == graph.tokens and torch.equal(again.first_logits, graph.first_logits)


@pytest.mark.cuda
def test_cpu_and_cuda_draw_the_same_tokens():
    from strata.engine.runtime.sampling import Sampler

    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    cpu, gpu = Sampler(1.0, 0.9, 50, seed=11), Sampler(1.0, 0.9, 50, seed=11)
    assert [cpu.sample(logits) for _ in range(50)] == [
        gpu.sample(logits.cuda()) for _ in range(50)
    ]


@pytest.mark.cuda
def test_compiled_decode_is_deterministic_and_follows_eager_in_fp32():
    ckpt = cached_checkpoint("olmoe", "tiny", dtype=torch.float32)
    model, tok = load_model(ckpt, device="cuda"), Tokenizer.from_dir(ckpt)
    prompt = tok.encode("compiled")
    options = GenerateOptions(
        max_new=40, max_context=256, temperature=0.0, ignore_stop=True, compile=True
    )
    first = generate(model, tok, prompt, options)
    second = generate(model, tok, prompt, options)
    eager = generate(model, tok, prompt, dataclasses.replace(options, cuda_graphs=False))
    assert first.decode_path == "compiled-cuda-graph"
    assert first.tokens == second.tokens
    # Inductor sums in another order than eager: fp32 keeps greedy choices the same here.
    assert first.tokens == eager.tokens


def test_every_decode_profile_row_the_code_and_docs_name_is_one_it_prints():
    """`bench/decode_profile.py's row "..."` in src/ and docs/ names a row the profile has: a
    row taken out of the profile fails here until its mentions go too."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    profile = (root / "bench" / "decode_profile.py").read_text()
    profile = re.sub(r'"\s+"', "", profile)  # a label's string literals, joined
    labels = {" ".join(label.split()) for label in re.findall(r'\("decode, [^"]*"', profile)}
    mentions = []
    for path in [*(root / "src").rglob("*.py"), *(root / "docs").rglob("*.md")]:
        text = " ".join(path.read_text().replace("#", " ").split())  # comments, line breaks
        mentions += [(path.name, m) for m in re.findall(r"decode_profile\.py's row \"([^\"]+)\"",
                                                        text)]
    assert mentions  # the check reads what it means to read
    for name, row in mentions:
        assert any(row in label for label in labels), (name, row)


def test_the_experts_one_read_bound_fits_the_shapes_it_runs_on():
    """decode_profile's bound hands back the first D of its act's K * 1.5F elements: olmoe's,
    qwen3's and mixtral's shapes hold a row of D, and a shape that cannot is left out."""
    from strata.engine.model.presets import get_preset

    bench = load_bench("decode_profile.py")
    for name in ("olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b"):
        assert bench.one_read_fits(get_preset(name))
    narrow = dataclasses.replace(get_preset("olmoe-1b-7b"), top_k=1, expert_width=512)
    assert not bench.one_read_fits(narrow)  # 1 x 768 < 2048


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_graph_launch_bench_says_it_needs_cuda(capsys):
    bench = load_bench("graph_launch.py")
    with pytest.raises(SystemExit):
        bench.main([])
    assert "graph_launch.py needs a CUDA device" in capsys.readouterr().err


def test_the_graph_launch_bench_refuses_an_empty_count(capsys):
    bench = load_bench("graph_launch.py")
    for flag in ("--kernels", "--launches"):
        with pytest.raises(SystemExit):
            bench.main([flag, "0"])
        assert f"{flag} takes a count >= 1, got 0" in capsys.readouterr().err


@pytest.mark.cuda
def test_the_graph_launch_bench_launches_the_graph_both_ways(capsys):
    bench = load_bench("graph_launch.py")
    assert bench.main(["--kernels", "3", "--launches", "100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["every_launch_ran"] and report["kernels"] == 3
    assert set(report["us_median"]) == {"torch replay", "cuGraphLaunch"}


@pytest.mark.parametrize("script", ["decode_profile.py", "decode_shapes.py"])
def test_the_side_by_side_benches_refuse_no_sweeps(script, capsys):
    bench = load_bench(script)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--repeat", "0"])
    assert "--repeat takes a count >= 1, got 0" in capsys.readouterr().err
