"""`--kv-dtype`: `strata generate` over int8 K/V cells (the same tokens twice, the dtype in
`--json`, with and without the elastic K/V and the cache), and bad values refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from strata.cli.main import main
from strata.engine.model.config import ModelConfig
from strata.engine.runtime.options import EngineOptions
from strata.formats.profile import Profile
from support.checkpoints import cached_checkpoint

FAST = ["Hello there, int8 cells", "--max-new", "8", "--device", "cpu", "--temperature", "0",
        "--max-context", "256", "--json"]


@pytest.fixture(scope="module")
def ckpt():
    return cached_checkpoint("olmoe", "tiny", dtype=torch.float32)  # L=2, G=2, Dh=16


def _generate(capsys, *argv):
    status = main(["generate", *argv])
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out)


def test_generate_over_int8_cells_is_deterministic_and_says_its_dtype(capsys, ckpt):
    runs = [_generate(capsys, "--model", str(ckpt), *FAST, "--kv-dtype", "int8")
            for _ in range(2)]
    assert runs[0]["tokens"] == runs[1]["tokens"] and len(runs[0]["tokens"]) == 8
    assert runs[0]["kv_dtype"] == "int8" and runs[0]["dtype"] == "float32"
    exact = _generate(capsys, "--model", str(ckpt), *FAST)
    assert exact["kv_dtype"] == "float32"
    assert _generate(capsys, "--model", str(ckpt), *FAST, "--kv-dtype", "bf16")["kv_dtype"] \
        == "bfloat16"


def test_int8_cells_in_the_elastic_kv_and_the_budget(capsys, ckpt, tmp_path, monkeypatch):
    # 4 KiB chunks: 128 int8 cells of the tiny model a chunk (32-byte cells), 5 segments.
    monkeypatch.setenv("STRATA_VMM_CHUNK_BYTES", "4096")
    monkeypatch.setenv("STRATA_KV_GROW_INIT", "128")
    monkeypatch.setenv("STRATA_KV_GROW_STEP", "128")
    monkeypatch.setenv("STRATA_KV_GROW_FLOOR", "2")
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")
    profile = tmp_path / "profile.npz"
    counts = np.random.default_rng(1).integers(1, 500, (2, 8))
    Profile.for_model(counts, ModelConfig.from_dir(ckpt)).save(profile)
    grow = ["--kv-grow", "--expert-profile", str(profile), "--max-context", "1024"]
    runs = [_generate(capsys, "--model", str(ckpt), *FAST, *grow, "--kv-dtype", dtype)
            for dtype in ("int8", "int8", "auto")]
    int8, again, exact = runs
    assert int8["tokens"] == again["tokens"] and int8["kv_dtype"] == "int8"
    assert int8["kv"]["init_cells"] == 128 and int8["kv"]["max_cells"] == 1024
    # The budget counts the cells mapped at start: 5 segments of one 4 KiB chunk (int8),
    # where float32 cells (128 bytes: 32 a chunk) take 4 segments of 4 chunks.
    assert int8["cache"]["budget"]["kv_bytes"] == 5 * 4096
    assert exact["cache"]["budget"]["kv_bytes"] == 4 * 4 * 4096
    assert exact["kv_dtype"] == "float32"


@pytest.mark.parametrize("value", ["fp8", "INT8", ""])
def test_a_bad_kv_dtype_is_one_line(capsys, ckpt, value):
    status = main(["generate", "--model", str(ckpt), *FAST, "--kv-dtype", value])
    _, err = capsys.readouterr()
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"--kv-dtype must be one of auto, bf16, int8, got {value!r}" in err


def test_engine_options_refuse_a_bad_kv_dtype():
    with pytest.raises(ValueError, match="--kv-dtype must be one of auto, bf16, int8, got 4"):
        EngineOptions(kv_dtype=4)
    assert EngineOptions(kv_dtype="int8").kv_dtype == "int8"


def test_a_trace_carries_the_int8_geometry_the_simulator_reads(capsys, ckpt, tmp_path):
    from strata.formats.trace import load_trace

    path = tmp_path / "t.npz"
    _generate(capsys, "--model", str(ckpt), *FAST, "--kv-dtype", "int8", "--trace", str(path))
    model = load_trace(path).meta["model"]
    # 2 kv heads x 16 int8 values: 32-byte cells; 4 value segments and 1 of scales.
    assert (model["kv_dtype"], model["kv_segment_cell_bytes"], model["kv_segments"]) == (
        "int8", 32, 5)
