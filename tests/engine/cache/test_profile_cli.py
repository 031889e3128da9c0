"""`strata profile` on real tiny checkpoints: counts, same bytes, the simulator reads it, errors."""

import json
import re

import numpy as np
import pytest
import torch

from strata.cli.main import main
from strata.engine.model.config import ModelConfig
from strata.engine.model.moe import load_model
from strata.engine.model.tokenizer import Tokenizer
from strata.engine.runtime.calibrate import collect_counts
from strata.engine.runtime.generate import GenerateOptions, generate
from strata.engine.runtime.recording import (
    RoutingCounter,
    RoutingRecorder,
    installed,
    new_trace_writer,
)
from strata.formats.profile import load_profile
from strata.policies.registry import load_registry
from strata.sim import ReplayConfig, load_trace, replay
from support.checkpoints import cached_checkpoint

PROMPTS = ["Hello world", "", "The quick brown fox jumps", "  ", "a"]


@pytest.fixture(scope="module")
def ckpt():
    return cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def _profile(capsys, *argv):
    status = main(["profile", "--device", "cpu", "--quiet", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_counts_are_the_routing_of_prompts_and_decoded_tokens(ckpt, prompts, tmp_path, capsys):
    out_path = tmp_path / "profile.npz"
    status, _, err = _profile(capsys, "--model", str(ckpt), "--prompts", str(prompts),
                                "-o", str(out_path), "--decode", "3", "--prefill-chunk", "4")
    assert status == 0, err
    assert "profiled 3 prompts" in err and str(out_path) in err
    profile = load_profile(out_path)
    profile.check(ModelConfig.from_dir(ckpt))
    # The same runs recorded as a trace (ids copied to the host, per step, per layer).
    model, tok = load_model(ckpt), Tokenizer.from_dir(ckpt)
    writer = new_trace_writer(model, "test")
    recorder = RoutingRecorder(model.experts, writer)
    texts = [p for p in PROMPTS if p.strip()]
    with installed(model, recorder):
        for text in texts:
            ids = tok.encode(text)
            with recorder.request(len(ids)):
                generate(model, None, ids, GenerateOptions(
                    max_new=4, temperature=0, prefill_chunk=4, ignore_stop=True))
    trace = writer.finish()
    assert np.array_equal(profile.counts, trace.routing_counts())
    n_tokens = sum(len(tok.encode(t)) for t in texts) + 3 * len(texts)
    assert (profile.counts.sum(axis=1) == n_tokens * 2).all()  # top-2 at every layer
    assert profile.meta["prompts"] == 3 and profile.meta["decode_tokens"] == 9
    assert profile.meta["prompt_tokens"] == n_tokens - 9


def test_same_inputs_same_bytes_and_json_summary(ckpt, prompts, tmp_path, capsys):
    paths = [tmp_path / "a.npz", tmp_path / "b.npz"]
    for path in paths:
        status, out, _ = _profile(capsys, "--model", str(ckpt), "--prompts", str(prompts),
                                  "-o", str(path), "--json")
        assert status == 0
    assert paths[0].read_bytes() == paths[1].read_bytes()
    summary = json.loads(out)
    assert summary["path"] == str(paths[1]) and summary["n_layers"] == 2
    assert summary["routed"] == int(load_profile(paths[1]).counts.sum())


def test_the_counter_leaves_output_unchanged_and_is_removed(ckpt):
    model = load_model(ckpt)
    experts = model.experts
    options = GenerateOptions(max_new=5, temperature=0, ignore_stop=True)
    plain = generate(model, None, [5, 6, 7, 8], options)
    counts, figures = collect_counts(model, [[5, 6, 7, 8]], decode_tokens=4)
    assert model.experts is experts
    assert figures == {"prompts": 1, "prompt_tokens": 4, "decode_tokens": 4}
    counter = RoutingCounter(experts, 2, 8, "cpu")
    with installed(model, counter):
        counted = generate(model, None, [5, 6, 7, 8], options)
    assert counted.tokens == plain.tokens
    assert torch.equal(counted.first_logits, plain.first_logits)
    assert np.array_equal(counter.counts(), counts) and counter.tokens == 8


def test_through_the_expert_cache_with_a_trace(ckpt, prompts, tmp_path, capsys):
    """A model that does not fit (here: a 0.5 MiB cache) is profiled through the expert cache;
    --trace records the same run, one request per prompt."""
    out_path, trace_path = tmp_path / "p.npz", tmp_path / "t.npz"
    status, _, err = _profile(capsys, "--model", str(ckpt), "--prompts", str(prompts),
                              "-o", str(out_path), "--decode", "2", "--expert-cache", "0.5",
                              "--policy", "lru", "--trace", str(trace_path))
    assert status == 0, err
    assert "expert cache: budget" in err and "slots" in err
    trace = load_trace(trace_path)
    assert trace.n_requests == 3 and trace.meta["source"] == "strata profile"
    assert np.array_equal(load_profile(out_path).counts, trace.routing_counts())


def test_jsonl_prompts(ckpt, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('"plain string"\n\n{"prompt": "an object"}\n{"text": "text key"}\n')
    out_path = tmp_path / "p.npz"
    status, _, err = _profile(capsys, "--model", str(ckpt), "--prompts", str(path),
                              "-o", str(out_path))
    assert status == 0, err
    assert load_profile(out_path).meta["prompts"] == 3


def test_simulate_reads_the_profile(ckpt, prompts, tmp_path, capsys):
    """`strata simulate --profile profile.npz` starts from the profile's counts."""
    out_path = tmp_path / "profile.npz"
    assert _profile(capsys, "--model", str(ckpt), "--prompts", str(prompts),
                    "-o", str(out_path))[0] == 0
    model = load_model(ckpt)
    writer = new_trace_writer(model, "test")
    recorder = RoutingRecorder(model.experts, writer)
    with installed(model, recorder), recorder.request(6):
        generate(model, None, [3, 1, 4, 1, 5, 9], GenerateOptions(max_new=12, temperature=0,
                                                                  ignore_stop=True))
    trace_path = tmp_path / "trace.npz"
    trace = writer.save(trace_path)
    status = main(["simulate", str(trace_path), "--policy", "lru", "--slots", "5",
                   "--profile", str(out_path), "--bounds", "none", "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, err
    row = json.loads(out)["results"][0]
    expected = replay(trace, load_registry().create("lru"), ReplayConfig(slots=5),
                      load_profile(out_path).counts)
    assert (row["hits"], row["misses"]) == (expected.hits, expected.misses)
    empty = replay(trace, load_registry().create("lru"), ReplayConfig(slots=5), None)
    assert expected.hits != empty.hits  # the profile did fill the cache


@pytest.mark.parametrize(
    "setup,argv,message",
    [
        (None, ["--prompts", "{missing}"], "--prompts .*No such file"),
        ("\n  \n", [], "holds no prompt"),
        ('"ok"\n[1]\n', ["--prompts", "{jsonl}"], r"p.jsonl:2: want a non-empty string"),
        ('"ok"\n{bad\n', ["--prompts", "{jsonl}"], r"p.jsonl:2: not JSON"),
        ("x\n", ["-o", "{tmp}/no/dir/p.npz"], "its directory does not exist"),
        ("x\n", ["-o", "{tmp}"], "is a directory"),
        ("x\n", ["--decode", "-1"], "--decode must be >= 0, got -1"),
        ("x\n", ["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
        ("x\n", ["--model", "{tmp}/nothing"], "does not exist"),
        ("x\n", ["--device", "tpu"], "unknown --device 'tpu'"),
        ("x\n", ["--trace", "{tmp}/no/t.npz"], "--trace .*its directory does not exist"),
        ("x\n", ["--expert-cache", "lots"], "--expert-cache must be auto or a number"),
        ("x\n", ["--expert-profile", "{missing}"], "--expert-profile .*absent.txt"),
    ],
)
def test_errors_are_one_line_usage_errors(ckpt, tmp_path, capsys, setup, argv, message):
    text_path, jsonl_path = tmp_path / "p.txt", tmp_path / "p.jsonl"
    if setup is not None:
        text_path.write_text(setup)
        jsonl_path.write_text(setup)
    fill = {"missing": tmp_path / "absent.txt", "jsonl": jsonl_path, "tmp": tmp_path}
    argv = [a.format(**fill) for a in argv]
    base = {"--model": str(ckpt), "--prompts": str(text_path), "-o": str(tmp_path / "o.npz")}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value
    status, _, err = _profile(capsys, *[x for kv in base.items() for x in kv])
    assert status == 2
    assert err.startswith("strata profile: ") and err.count("\n") == 1
    assert re.search(message, err), err
    assert not (tmp_path / "o.npz").exists()
