"""Checkpoint.open: single file and sharded checkpoints, and each loader error as one line."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.engine.model import families
from strata.engine.model.checkpoint import Checkpoint, CheckpointError
from strata.engine.model.moe import load_model
from support.checkpoints import (
    edit_config,
    make_checkpoint,
    remove_tensor,
    replace_tensor,
    shard_files,
    truncate_shard,
)
from support.hf_models import hf_checkpoint

EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


def open_error(path) -> str:
    """The CheckpointError message for `path`, checked to be one line."""
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(path)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_open_hf_checkpoint(tmp_path):
    path, hf_model = hf_checkpoint(tmp_path, "qwen2_moe")
    ckpt = Checkpoint.open(path)
    assert ckpt.config.family == "qwen2_moe" and ckpt.config.dtype == torch.float32
    assert set(families.expected_tensors(ckpt.config)) <= set(ckpt.names())
    state = hf_model.state_dict()
    assert torch.equal(ckpt.tensor("model.embed_tokens.weight"), state["model.embed_tokens.weight"])
    gate = "model.layers.1.mlp.experts.3.gate_proj.weight"
    if "model.layers.1.mlp.experts.gate_up_proj" in state:
        # Transformers 5 keeps experts fused in memory; the file holds the published names.
        fused = state["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2F, D]
        state = {gate: fused[3, :32], EXPERT: fused[3, 32:]}
    assert torch.equal(ckpt.tensor(gate), state[gate])
    assert torch.equal(ckpt.tensor(EXPERT), state[EXPERT])
    with pytest.raises(CheckpointError, match="'nope' is not in the checkpoint"):
        ckpt.tensor("nope")


def test_sharded_equals_single_file(tmp_path):
    single = make_checkpoint(tmp_path / "one", "olmoe", dtype=torch.float32)
    sharded = make_checkpoint(
        tmp_path / "many", "olmoe", dtype=torch.float32, max_shard_bytes=2**16
    )
    assert len(shard_files(sharded)) > 2 and (sharded / "model.safetensors.index.json").is_file()
    a, b = Checkpoint.open(single), Checkpoint.open(sharded)
    assert a.config == b.config and a.names() == b.names()
    for name in a.names():
        assert torch.equal(a.tensor(name), b.tensor(name)), name
    assert load_model(sharded).config == a.config


def test_dtype_from_tensors_when_config_has_none(tmp_path):
    path = make_checkpoint(tmp_path / "c", "mixtral", dtype=torch.bfloat16)
    edit_config(path, dtype=None, torch_dtype=None)
    assert Checkpoint.open(path).config.dtype == torch.bfloat16
    edit_config(path, torch_dtype="float32")
    assert Checkpoint.open(path).config.dtype == torch.float32


def test_missing_directory_and_files(tmp_path):
    assert "does not exist" in open_error(tmp_path / "absent")
    path = make_checkpoint(tmp_path / "c", "olmoe")
    for shard in shard_files(path):
        shard.unlink()
    assert open_error(path).startswith("no *.safetensors files")


def test_truncated_file(tmp_path):
    path = make_checkpoint(tmp_path / "c", "olmoe")
    shard = truncate_shard(path)
    text = open_error(path)
    assert text.startswith(f"{shard} is truncated or not a safetensors file")


def test_index_names_a_missing_file(tmp_path):
    path = make_checkpoint(tmp_path / "c", "qwen3_moe", max_shard_bytes=2**16)
    gone = shard_files(path)[1]
    gone.unlink()
    assert open_error(path) == f"{gone} is missing (model.safetensors.index.json lists it)"


def test_missing_tensor_single_file(tmp_path):
    path = make_checkpoint(tmp_path / "c", "olmoe")
    remove_tensor(path, EXPERT)
    assert open_error(path) == f"tensor {EXPERT!r} is missing from model.safetensors in {path}"


def test_missing_tensor_sharded(tmp_path):
    path = make_checkpoint(tmp_path / "c", "olmoe", max_shard_bytes=2**16)
    shard = remove_tensor(path, EXPERT)  # the index still places it in `shard`
    assert open_error(path) == (
        f"tensor {EXPERT!r} is missing from {shard} (model.safetensors.index.json places it there)"
    )
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][EXPERT]
    index_path.write_text(json.dumps(index))
    assert open_error(path) == (
        f"tensor {EXPERT!r} is missing from model.safetensors.index.json in {path}"
    )


def test_shape_disagrees_with_config(tmp_path):
    path = make_checkpoint(tmp_path / "c", "mixtral")
    name = "model.layers.0.self_attn.k_proj.weight"
    good = Checkpoint.open(path).tensor(name)
    replace_tensor(path, name, torch.zeros(good.shape[0] + 1, good.shape[1]))
    text = open_error(path)
    expected = [good.shape[0], good.shape[1]]
    found = [good.shape[0] + 1, good.shape[1]]
    assert text == (
        f"tensor {name!r} in {path / 'model.safetensors'} has shape {found}, but config.json "
        f"implies {expected}"
    )


def test_config_disagrees_with_tensors(tmp_path):
    path = make_checkpoint(tmp_path / "c", "olmoe")
    config = json.loads((path / "config.json").read_text())
    edit_config(path, intermediate_size=config["intermediate_size"] * 2)
    text = open_error(path)
    assert re.fullmatch(r"tensor 'model\.layers\.0\..*' in .* has shape \[.*\], but config\.json "
                        r"implies \[.*\]", text)


def test_unsupported_model_type(tmp_path):
    path = make_checkpoint(tmp_path / "c", "olmoe")
    edit_config(path, model_type="deepseek_v3")
    assert open_error(path) == (
        f"{path / 'config.json'}: model_type 'deepseek_v3' is not supported; supported: mixtral, "
        "olmoe, qwen2_moe, qwen3_moe"
    )


def test_integer_tensor_rejected(tmp_path):
    path = make_checkpoint(tmp_path / "c", "olmoe")
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, str(file))
    assert "has dtype I32; supported: BF16, F16, F32" in open_error(path)
