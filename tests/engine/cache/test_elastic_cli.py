"""`strata generate --kv-grow`: the notes, the cache sized around the start cells, the `kv`
stats line and `--json` object, the environment switch, and bad values as one line (status 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from strata.cli.main import main
from strata.engine.model.config import ModelConfig
from strata.formats.profile import Profile
from support.checkpoints import cached_checkpoint

FAST = ["Hello there, elastic cache", "--max-new", "6", "--device", "cpu", "--temperature",
        "0", "--max-context", "256"]
KV_KEYS = {"cells_mapped", "max_cells", "grows", "trims", "slots_given_up", "relocated",
           "refilled", "fresh_chunks"}


@pytest.fixture(autouse=True)
def small_steps(monkeypatch):
    # 4 KiB chunks: 32 cells of the tiny model's K/V a chunk, so it grows in small steps.
    monkeypatch.setenv("STRATA_VMM_CHUNK_BYTES", "4096")
    monkeypatch.setenv("STRATA_KV_GROW_INIT", "32")
    monkeypatch.setenv("STRATA_KV_GROW_STEP", "32")
    monkeypatch.setenv("STRATA_KV_GROW_FLOOR", "2")
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")
    monkeypatch.delenv("STRATA_KV_GROW", raising=False)


@pytest.fixture(scope="module")
def ckpt():
    return cached_checkpoint("olmoe", "tiny", dtype=torch.float32)  # L=2, E=8, 96 KiB blobs


@pytest.fixture(scope="module")
def profile(ckpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "tiny.npz"
    counts = np.random.default_rng(1).integers(1, 500, (2, 8))
    Profile.for_model(counts, ModelConfig.from_dir(ckpt)).save(path)
    return str(path)


def _run(capsys, *argv):
    status = main(["generate", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_kv_grow_grows_and_reports(capsys, ckpt, profile):
    status, _, err = _run(capsys, "--model", str(ckpt), *FAST, "--kv-grow",
                          "--expert-profile", profile)
    assert status == 0, err
    assert "strata: elastic K/V: 32 of 256 cells mapped at start, steps of 32, the cache " \
           "keeps at least 2 slots" in err
    line = next(line for line in err.splitlines() if line.startswith("kv "))
    assert "of 256 cells mapped (start 32, step 32, floor 2 slots); 1 grows, 0 trims" in line
    assert "fresh chunks 0" in line  # the host default budget: every chunk from the cache


def test_json_kv_object_and_the_environment_switch(capsys, ckpt, profile, monkeypatch):
    monkeypatch.setenv("STRATA_KV_GROW", "1")
    status, out, err = _run(capsys, "--model", str(ckpt), *FAST, "--expert-profile", profile,
                            "--json")
    assert status == 0, err
    document = json.loads(out)
    kv = document["kv"]
    assert kv.keys() >= KV_KEYS
    prompt = document["prompt_tokens"]
    # prompt + 6 new + a margin of 16, on the 32-cell grid.
    assert kv["cells_mapped"] == -(-(prompt + 6 + 16) // 32) * 32 and kv["max_cells"] == 256
    assert kv["grows"] == 1 and kv["slots_given_up"] >= 1
    assert kv["slots_given_up"] <= document["cache"]["slots"]


def test_the_cache_gets_the_slots_the_window_would_take(capsys, ckpt, profile):
    budget = ["--vram-budget-mib", "2.25", "--max-context", "1024", "--prefill-chunk", "32"]
    _, _, plain = _run(capsys, "--model", str(ckpt), *FAST, *budget, "--expert-profile",
                       profile)
    _, _, grown = _run(capsys, "--model", str(ckpt), *FAST, *budget, "--expert-profile",
                       profile, "--kv-grow")

    def slots(err):
        startup = next(line for line in err.splitlines() if "expert cache: budget" in line)
        return int(startup.split(": ")[-1].split(" slots")[0])

    assert slots(grown) > slots(plain)


def test_ignored_without_a_profile(capsys, ckpt):
    status, out, err = _run(capsys, "--model", str(ckpt), *FAST, "--kv-grow", "--json")
    assert status == 0
    assert "strata: --kv-grow ignored: it needs --expert-profile" in err
    assert "kv" not in json.loads(out)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("STRATA_KV_GROW_STEP", "lots", "STRATA_KV_GROW_STEP='lots': want a positive integer"),
    ("STRATA_KV_GROW_INIT", "0", "STRATA_KV_GROW_INIT='0': want a positive integer"),
    ("STRATA_KV_GROW", "maybe", "STRATA_KV_GROW='maybe': want 1 (on) or 0 (off)"),
])
def test_bad_environment_values_are_one_line(capsys, ckpt, profile, monkeypatch, name, value,
                                             message):
    monkeypatch.setenv(name, value)
    status, _, err = _run(capsys, "--model", str(ckpt), *FAST, "--kv-grow", "--expert-profile",
                          profile)
    assert status == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
