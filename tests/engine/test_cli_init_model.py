"""`strata init-model` through the real CLI."""

import json

import pytest
import torch

from strata.cli.main import main
from strata.engine.model.moe import load_model
from strata.engine.model.tokenizer import Tokenizer
from strata.engine.runtime.generate import GenerateOptions, generate


def _run(capsys, *argv):
    status = main(["init-model", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_writes_a_checkpoint_the_loader_runs(tmp_path, capsys):
    out_dir = tmp_path / "m"
    status, out, _ = _run(capsys, str(out_dir), "--family", "mixtral", "--preset", "tiny",
                          "--seed", "3", "--dtype", "fp32")
    assert status == 0
    assert out.startswith(f"wrote {out_dir}: mixtral tiny, 2 layers") and "random" in out
    model = load_model(out_dir)
    assert model.config.family == "mixtral" and model.dtype == torch.float32
    tok = Tokenizer.from_dir(out_dir)
    result = generate(model, tok, tok.encode("ok"), GenerateOptions(max_new=3, temperature=0))
    assert 1 <= len(result.tokens) <= 3
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # the staging directory is gone


def test_the_preset_picks_its_family_and_layers_shorten_it(tmp_path, capsys):
    status, out, _ = _run(capsys, str(tmp_path / "m"), "--preset", "small", "--layers", "1",
                          "--max-shard-mib", "1")
    assert status == 0 and "qwen3_moe small, 1 layers" in out
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_hidden_layers"] == 1
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()  # > 1 MiB: sharded


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--family", "llama"], "unknown family 'llama'; choose one of: mixtral"),
        (["--preset", "huge"], "unknown preset 'huge'; choose one of: tiny"),
        (["--layers", "5"], "--layers only shortens"),
        (["--dtype", "int8"], "unknown --dtype 'int8'"),
        (["--seed", "-2"], "seed must be a non-negative int"),
        (["--router-skew", "-1"], "--router-skew must be a finite number >= 0, got -1"),
        (["--router-skew", "nan"], "--router-skew must be a finite number >= 0, got nan"),
        (["--family", "olmoe", "--preset", "qwen3-30b-a3b", "--layers", "1"],
         "olmoe needs n_heads * head_dim == hidden_size"),
    ],
)
def test_bad_arguments_are_one_line_and_write_nothing(tmp_path, capsys, argv, message):
    status, out, err = _run(capsys, str(tmp_path / "m"), *argv)
    assert status == 2 and out == ""
    assert err.startswith("strata init-model: ") and message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_refuses_a_directory_with_files(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("keep me")
    status, _, err = _run(capsys, str(tmp_path / "m"))
    assert status == 2 and "not an empty directory" in err
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["notes.txt"]
