"""`strata generate` through the real CLI: first run, output streams, JSON, and every error."""

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from strata.cli.generate import terminal_safe
from strata.cli.main import main
from strata.engine.model.builtin import BUILTIN_NAME
from support.checkpoints import (
    edit_config,
    make_checkpoint,
    remove_tensor,
    replace_tensor,
    truncate_shard,
)

FAST = ["--max-new", "6", "--device", "cpu"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gen") / "ckpt", "olmoe", "tiny")


def _run(capsys, *argv):
    status = main(["generate", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_first_run_creates_the_builtin_model_once(cache, capsys):
    status, out, err = _run(capsys, "Hello", *FAST)
    assert status == 0
    assert "created the built-in tiny model" in err and "random" in err
    models = cache / "models"
    assert [p.name for p in models.iterdir()] == [BUILTIN_NAME]  # no staging dir left
    assert (models / BUILTIN_NAME / "tokenizer.json").is_file()
    status, out_again, err = _run(capsys, "Hello", *FAST)
    assert status == 0 and "using the built-in tiny model" in err
    assert out_again == out  # same seed, same model: same text


def test_an_interrupted_first_run_leaves_no_model(cache, capsys, monkeypatch):
    import strata.engine.model.init_model as init_model

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(init_model, "save_file", disk_full)
    status, _, err = _run(capsys, "Hello", *FAST)
    assert status == 2 and "No space left on device" in err
    assert list((cache / "models").iterdir()) == []
    monkeypatch.undo()


def test_text_on_stdout_stats_on_stderr(ckpt, capsys):
    status, out, err = _run(capsys, "Hi", "--model", str(ckpt), *FAST, "--temperature", "0")
    assert status == 0
    assert "prompt tokens  2" in err and "tok/s" in err and "ms/round" in err
    assert "tok/s" not in out
    status, json_out, _ = _run(
        capsys, "Hi", "--model", str(ckpt), *FAST, "--temperature", "0", "--json"
    )
    document = json.loads(json_out)
    assert out == document["text"] + ("" if document["text"].endswith("\n") else "\n")
    for key in ("text", "tokens", "prompt_tokens", "prefill_tok_s", "decode_tok_s"):
        assert key in document
    assert document["prompt_tokens"] == 2 and len(document["tokens"]) <= 6


def test_prompt_from_file_and_stdin_and_chat(ckpt, capsys, tmp_path, monkeypatch):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("from a file")
    base = ["--model", str(ckpt), *FAST, "--json"]
    status, out, _ = _run(capsys, "--prompt-file", str(prompt_file), *base)
    assert status == 0 and json.loads(out)["prompt_tokens"] == len("from a file")
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
    status, out, _ = _run(capsys, *base)
    assert status == 0 and json.loads(out)["prompt_tokens"] == len("from stdin")
    status, out, _ = _run(capsys, "hi", "--chat", *base)
    # <|im_start|> "user\nhi" <|im_end|> "\n" <|im_start|> "assistant\n": 3 specials, 18 bytes
    assert status == 0 and json.loads(out)["prompt_tokens"] == 21
    assert "not both" in _error(capsys, "hi", "--prompt-file", str(prompt_file), *base)


def test_dump_first_logits_is_deterministic(ckpt, capsys, tmp_path, monkeypatch):
    dumps = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.f32"
        monkeypatch.setenv("STRATA_DUMP_FIRST_LOGITS", str(path))
        status, out, _ = _run(capsys, "same", "--model", str(ckpt), *FAST, "--json")
        assert status == 0
        dumps.append((path.read_bytes(), json.loads(out)["tokens"]))
    assert dumps[0] == dumps[1]
    logits = torch.frombuffer(bytearray(dumps[0][0]), dtype=torch.float32)
    assert logits.shape == (260,) and torch.isfinite(logits).all()


def _error(capsys, *argv):
    status, _, err = _run(capsys, *argv)
    assert status == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.fixture
def broken(tmp_path):
    return make_checkpoint(tmp_path / "broken", "mixtral", "tiny", max_shard_bytes=60_000)


def test_missing_safetensors_file(broken, capsys):
    shard = sorted(broken.glob("*.safetensors"))[1]
    shard.unlink()
    err = _error(capsys, "x", "--model", str(broken), *FAST)
    assert shard.name in err


def test_truncated_safetensors_file(broken, capsys):
    path = truncate_shard(broken)
    assert path.name in _error(capsys, "x", "--model", str(broken), *FAST)


def test_missing_tensor(broken, capsys):
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    remove_tensor(broken, name)
    assert name in _error(capsys, "x", "--model", str(broken), *FAST)


def test_shape_disagreeing_with_config(broken, capsys):
    name = "model.layers.0.self_attn.k_proj.weight"
    replace_tensor(broken, name, torch.zeros(16, 64, dtype=torch.bfloat16))
    err = _error(capsys, "x", "--model", str(broken), *FAST)
    assert name in err and "16" in err and "32" in err


def test_unsupported_model_type_lists_the_supported(broken, capsys):
    edit_config(broken, model_type="llama")
    err = _error(capsys, "x", "--model", str(broken), *FAST)
    assert "llama" in err and "mixtral" in err and "qwen3_moe" in err


def test_missing_model_directory(tmp_path, capsys):
    assert "does not exist" in _error(capsys, "x", "--model", str(tmp_path / "nope"), *FAST)


def test_prompt_longer_than_max_context(ckpt, capsys):
    err = _error(capsys, "x" * 40, "--model", str(ckpt), "--max-context", "32", *FAST)
    assert "--max-context 32" in err and "40 tokens" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "tpu"], "unknown --device 'tpu'; use cuda or cpu"),
        (["--dtype", "int4"], "unknown --dtype 'int4'"),
        (["--max-new", "0"], "--max-new must be a positive int"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-k", "-3"], "--top-k must be an int >= 0"),
        (["--prefill-chunk", "0"], "--prefill-chunk must be a positive int"),
        (["--prompt-file", "/nonexistent/prompt"], "--prompt-file /nonexistent/prompt"),
    ],
)
def test_bad_options(ckpt, capsys, argv, message):
    args = ["--model", str(ckpt), "--device", "cpu", "--max-new", "4", *argv]
    if "--prompt-file" not in argv:
        args = ["x", *args]
    assert message in _error(capsys, *args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only host")
def test_cuda_without_a_gpu(ckpt, capsys):
    assert "no CUDA device" in _error(capsys, "x", "--model", str(ckpt), "--device", "cuda")


def test_missing_tokenizer(broken, capsys):
    (broken / "tokenizer.json").unlink()
    assert "tokenizer.json not found" in _error(capsys, "x", "--model", str(broken), *FAST)


def test_the_process_exits_2_with_one_line(broken):
    edit_config(broken, model_type="llama")
    proc = subprocess.run(
        [sys.executable, "-m", "strata.cli", "generate", "x", "--model", str(broken), *FAST],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("strata generate: ") and proc.stderr.count("\n") == 1
    assert proc.stdout == ""


def test_the_readme_run_line_works_on_a_fresh_cache(tmp_path):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("## Set up and run", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    (line,) = [cmd for cmd in block.splitlines() if cmd.startswith("strata ")]
    argv = shlex.split(line, comments=True)
    assert argv[:2] == ["strata", "generate"]
    exe = shutil.which("strata")
    assert exe, "the `strata` console script is not installed"
    env = {**os.environ, "STRATA_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "random" in proc.stderr and "decode" in proc.stderr and proc.stdout


def test_control_characters_are_masked_for_a_terminal_only():
    assert terminal_safe("a\x1b[2Jb\n\tc\x07") == "a\ufffd[2Jb\n\tc\ufffd"




def test_a_bad_setting_is_one_line(cache, capsys, monkeypatch):
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "lots")
    status, out, err = _run(capsys, "x", *FAST)
    assert status == 2 and out == ""
    assert err == ("strata generate: STRATA_LOAN_KEEP_SLOTS='lots': want an integer >= 0 "
                   "(slots a loan leaves)\n")


def test_experts_dtype_quantizes_the_experts_and_the_json_says_so(ckpt, capsys):
    base = ["Hi", "--model", str(ckpt), *FAST, "--temperature", "0", "--json"]
    documents = {}
    for experts_dtype in ("auto", "int8", "int4", "int4-g64"):
        status, out, _ = _run(capsys, *base, "--experts-dtype", experts_dtype)
        assert status == 0
        documents[experts_dtype] = json.loads(out)
    assert documents["auto"]["experts_dtype"] == documents["auto"]["dtype"] == "bfloat16"
    assert documents["int8"]["experts_dtype"] == "int8"
    assert documents["int4"]["experts_dtype"] == "int4-g32"
    assert documents["int4-g64"]["experts_dtype"] == "int4-g64"
    # Through the cache, its slots hold the quantized blobs: more of them in the same MiB.
    slots = {}
    for experts_dtype in ("auto", "int8"):
        status, out, _ = _run(capsys, *base, "--experts-dtype", experts_dtype,
                              "--expert-cache", "0.2")
        slots[experts_dtype] = json.loads(out)["cache"]["budget"]["n_slots"]
    assert slots["int8"] > slots["auto"]
    err = _error(capsys, *base, "--experts-dtype", "int3")
    assert "--experts-dtype must be one of auto, bf16, int8, int4, int4-g32, int4-g64" in err
    err = _error(capsys, *base, "--dtype", "fp32", "--experts-dtype", "bf16")
    assert "--experts-dtype bf16 keeps the experts in the model's dtype" in err
