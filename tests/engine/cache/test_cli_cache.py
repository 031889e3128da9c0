"""`strata generate` with the expert cache: when it is used, the startup line, the stats, the
`cache` object of `--json`, `--trace`, and each bad option as one line with exit status 2."""

import argparse
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from strata.cli.cache_options import add_cache_arguments
from strata.cli.main import main
from strata.engine.cache.build import default_stream_misses
from strata.engine.model.config import ModelConfig
from strata.formats.profile import Profile
from strata.formats.trace import load_trace
from support.checkpoints import cached_checkpoint

FAST = ["Hello there, cache", "--max-new", "6", "--device", "cpu", "--temperature", "0",
        "--max-context", "64"]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setenv("STRATA_VMM_CHUNK_BYTES", "65536")


@pytest.fixture(scope="module")
def ckpt():
    return cached_checkpoint("olmoe", "tiny", dtype=torch.float32)  # L=2, E=8, 96 KiB blobs


def _run(capsys, *argv):
    status = main(["generate", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def _json(capsys, *argv):
    status, out, err = _run(capsys, *argv, "--json")
    assert status == 0, err
    return json.loads(out), err


def test_without_cache_options_every_expert_is_resident(capsys, ckpt):
    document, err = _json(capsys, "--model", str(ckpt), *FAST)
    assert "cache" not in document and "expert cache:" not in err


@pytest.mark.parametrize("policy", [["--policy", "coldest-in-loan"], ["--policy", "static"],
                                    ["--policy", "lru", "--policy-opt", "max_admits=1"]])
def test_naming_a_policy_is_no_cache_option(capsys, ckpt, policy):
    """The policy decides what a cache holds; naming one, the default (as the default does) or
    another, never switches a cache on where every expert fits: once `--policy static` did and
    `--policy coldest-in-loan` did not."""
    document, err = _json(capsys, "--model", str(ckpt), *FAST, *policy)
    assert "cache" not in document and "expert cache:" not in err


def test_a_cache_prints_its_sizing_and_its_stats(capsys, ckpt):
    status, _, err = _run(capsys, "--model", str(ckpt), *FAST, "--expert-cache", "0.5")
    assert status == 0
    lines = err.splitlines()
    startup = next(line for line in lines if "expert cache: budget" in line)
    assert "(host default: every expert)" in startup and "5 slots of 96.0 KiB" in startup
    assert any("no --expert-profile" in line for line in lines)
    block = [line for line in lines if line.startswith("cache ")]
    assert len(block) == 3 and "5 slots (coldest-in-loan)" in block[0]
    assert block[1].startswith("cache prompt") and block[2].startswith("cache decode")


def test_json_cache_object(capsys, ckpt):
    document, _ = _json(capsys, "--model", str(ckpt), *FAST, "--vram-budget-mib", "3.5",
                        "--policy", "lru", "--no-prefill-loan")
    cache = document["cache"]
    budget = cache["budget"]
    assert budget["budget_bytes"] == int(3.5 * 2**20) and budget["n_slots"] == cache["slots"]
    assert 0 < cache["slots"] < 16 and cache["policy"] == "lru"
    assert cache["lookups"] == cache["prompt"]["lookups"] + cache["decode"]["lookups"]
    assert cache["lookups"] == 2 * 2 * (document["prompt_tokens"] + 5)  # L * K * tokens fed
    assert cache["decode"]["admitted"] > 0 and cache["uploaded_bytes"] > 0
    for key in ("hits", "hit_rate", "cpu_experts_per_layer", "cpu_tokens_per_layer",
                "lent_slots", "device_s", "cpu_s", "wait_s"):
        assert key in cache
    assert document["decode_path"] == "eager"


def test_stream_misses_shows_in_the_stats(capsys, ckpt):
    document, _ = _json(capsys, "--model", str(ckpt), *FAST, "--expert-cache", "0.5",
                        "--stream-misses", "1")
    decode = document["cache"]["decode"]
    assert decode["streamed_experts"] > 0 and decode["uploaded_bytes"] > 0
    status, _, err = _run(capsys, "--model", str(ckpt), *FAST, "--expert-cache", "0.5",
                          "--stream-misses", "1")
    assert status == 0
    assert any(line.startswith("cache decode") and re.search(r"streamed [\d.]+ experts", line)
               for line in err.splitlines()), err


def test_prefetch_misses_off_cuda_keeps_the_tokens(capsys, ckpt):
    """Off CUDA no decode call is split around graphs, so nothing is predicted: the tokens
    and streamed misses of the same run without it."""
    runs = [_json(capsys, "--model", str(ckpt), *FAST, "--expert-cache", "0.5",
                  "--stream-misses", "1", *extra)[0]
            for extra in ([], ["--prefetch-misses", "1"])]
    plain, ahead = runs
    assert ahead["tokens"] == plain["tokens"]
    assert ahead["cache"]["decode"]["streamed_experts"] == \
        plain["cache"]["decode"]["streamed_experts"] > 0


def test_stream_misses_defaults_to_auto_which_is_0_off_cuda(capsys, ckpt, tmp_path,
                                                            monkeypatch):
    # Off CUDA there is no bus: auto, given or the default, streams nothing and measures
    # nothing (no rates file). The fixed count that sizes a cache before auto is resolved
    # (and that benches pass as it was) stays three eighths of K.
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    config = ModelConfig.from_dir(ckpt)
    assert default_stream_misses(config, torch.device("cuda")) == \
        (3 * config.top_k + 4) // 8 > 0
    for top_k, streamed in [(1, 0), (2, 1), (4, 2), (6, 2), (8, 3), (16, 6)]:
        # three eighths of K, rounded half up
        assert default_stream_misses(SimpleNamespace(top_k=top_k), torch.device("cuda")) \
            == streamed
    assert default_stream_misses(config, torch.device("cpu")) == 0
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)  # the flag's help says the same rule
    assert "auto (the default) splits them as the calls timed once on this machine and kept " \
        "in the cache directory ran fastest (0 off CUDA: all on the CPU)" in \
        " ".join(parser.format_help().split())
    for given in ([], ["--stream-misses", "auto"]):
        document, err = _json(capsys, "--model", str(ckpt), *FAST, "--expert-cache", "0.5",
                              "--no-piecewise-graphs", *given)  # on the CPU: rounds eager
        assert document["cache"]["decode"]["streamed_experts"] == 0
        assert document["decode_path"] == "eager" and "--stream-misses auto" not in err
    assert not (tmp_path / "rates.json").exists()


def test_a_full_cache_gives_the_same_tokens(capsys, ckpt):
    plain, _ = _json(capsys, "--model", str(ckpt), *FAST)
    cached, _ = _json(capsys, "--model", str(ckpt), *FAST, "--expert-cache", "auto")
    assert cached["cache"]["slots"] == 16 and cached["cache"]["hit_rate"] == 1.0
    assert cached["tokens"] == plain["tokens"]


def test_trace_records_the_request(capsys, ckpt, tmp_path):
    path = tmp_path / "run.npz"
    document, _ = _json(capsys, "--model", str(ckpt), *FAST, "--expert-cache", "0.3",
                        "--trace", str(path))
    trace = load_trace(path)
    assert trace.n_requests == 1 and trace.n_experts == 8
    assert trace.expert_ids.shape == (document["prompt_tokens"] + 5, 2, 2)  # [N, L, K]
    assert document["cache"]["lookups"] == trace.expert_ids.size


def test_a_profile_fills_hottest_first(capsys, ckpt, tmp_path):
    config = ModelConfig.from_dir(ckpt)
    counts = np.zeros((2, 8), np.int64)
    counts[1, 5], counts[0, 2] = 50, 40
    path = tmp_path / "profile.npz"
    Profile.for_model(counts, config).save(path)
    status, _, err = _run(capsys, "--model", str(ckpt), *FAST, "--expert-cache", "0.2",
                          "--expert-profile", str(path))
    assert status == 0 and "no --expert-profile" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--vram-budget-mib", "1"], r"the device budget of 1\.0 MiB \(--vram-budget-mib\) is "
     r"[0-9.]+ MiB short"),
    (["--expert-cache", "lots"], "--expert-cache must be auto or a number of MiB >= 0, got 'lots'"),
    (["--vram-reserve-mib", "-3"], "--vram-reserve-mib must be a number of MiB >= 0"),
    (["--short-read", "0"], "--short-read must be >= 1, got 0"),
    (["--cpu-threads", "0"], "--cpu-threads must be >= 1, got 0"),
    (["--stream-misses", "-1"], r"--stream-misses must be auto or in \[0, 2\] .* got -1"),
    (["--stream-misses", "3"], r"--stream-misses must be auto or in \[0, 2\] \(a decode layer "
     r"misses at most the model's 2 experts a token\), got 3"),
    (["--stream-misses", "half"], "--stream-misses must be auto or a number of experts, got "
     "'half'"),
    (["--prefetch-misses", "1"], r"--prefetch-misses uploads predicted misses with the "
     r"streamed ones, and none are streamed here: give --stream-misses N > 0"),
    (["--prefetch-misses", "1", "--stream-misses", "0"], "none are streamed here"),
    (["--prefetch-misses", "-1"], r"--prefetch-misses must be a number of experts >= 0 \(0: "
     r"off\), got -1"),
    (["--prefetch-misses", "2", "--stream-misses", "1"], r"--prefetch-misses 2 is more than "
     r"the 1 streamed misses' staging blobs \(--stream-misses\): give at most 1"),
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--policy", "lru", "--policy-opt", "max_admits=-1"], "max_admits"),
    (["--expert-profile", "/nonexistent/p.npz"], "--expert-profile /nonexistent/p.npz: "),
    (["--trace", "/nonexistent/dir/t.npz"], "--trace /nonexistent/dir/t.npz: its directory"),
])
def test_bad_options_are_one_line(capsys, ckpt, argv, message):
    status, out, err = _run(capsys, "--model", str(ckpt), *FAST, *argv)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("strata generate: ")
    assert re.search(message, err), err


def test_a_profile_for_another_model_is_refused(capsys, ckpt, tmp_path):
    other = ModelConfig.from_dir(cached_checkpoint("qwen3_moe", "tiny"))  # also 2 x 8 experts
    path = tmp_path / "other.npz"
    Profile.for_model(np.ones((2, 8), np.int64), other).save(path)
    status, _, err = _run(capsys, "--model", str(ckpt), *FAST, "--expert-profile", str(path))
    assert status == 2 and err.count("\n") == 1
    assert f"--expert-profile {path}: the profile was made for another model" in err
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    status, _, err = _run(capsys, "--model", str(ckpt), *FAST, "--expert-profile", str(garbage))
    assert status == 2 and err.count("\n") == 1 and str(garbage) in err


def test_experts_beyond_the_host_are_one_line_before_the_load(capsys, ckpt, monkeypatch):
    from strata.engine.experts import store
    from strata.machine import MemoryLimit

    monkeypatch.setattr(store, "host_limit", lambda: MemoryLimit(1 << 20, "the host's RAM"))
    status, out, err = _run(capsys, "--model", str(ckpt), *FAST)  # every expert resident too
    assert status == 2 and out == "" and err.count("\n") == 1
    assert re.search(r"its experts as float32 need [\d.]+ MiB of host memory, more than the "
                     r"host's RAM \(1\.0 MiB\): quantized experts \(--experts-dtype int8 or "
                     r"int4\)", err), err
