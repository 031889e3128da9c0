"""A catalogue of bad inputs to the command line: checkpoints, configs, tokenizers, prompts,
options and sizes, profiles and traces. Each `Case` builds its files in a fresh directory and
says how `strata` is run on them and what its one line of error must name.

The checkpoints are the tiny ones of `support.checkpoints.cached_checkpoint` (what `strata
init-model --preset tiny` writes), copied per case and broken in the copy.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from strata.formats.npz import write_npz
from support.checkpoints import cached_checkpoint

FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
FAST = ["--device", "cpu", "--max-new", "2", "--temperature", "0"]
DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's JSON parser can follow
SIZE_SECONDS = 30.0  # a size case must be refused within this ...
SIZE_RSS_BYTES = 1 << 30  # ... having grown by less than this


@dataclass
class Run:
    """How strata is run: `argv` (bytes items are raw command-line bytes), stdin (bytes, or
    a path), extra environment variables, and whether it needs no torch (a real subprocess
    then runs it)."""

    argv: list[Any]
    stdin: bytes = b""
    stdin_path: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    light: bool = False


@dataclass
class Case:
    """One bad input: `build(dir)` makes its files and returns the run; the error line must
    hold each of `expect`; a `size` case must also be refused quickly in little memory."""

    id: str
    build: Callable[[Path], Run]
    expect: tuple[str, ...]
    size: bool = False


def checkpoint(tmp: Path, family: str = "qwen3_moe", **fields: Any) -> Path:
    """A copy of the family's tiny checkpoint in `tmp`, with `fields` set in its config.json
    (`...` removes one)."""
    path = tmp / f"ckpt-{family}"
    if not path.exists():
        shutil.copytree(cached_checkpoint(family, "tiny"), path)
    if fields:
        config = json.loads((path / "config.json").read_text())
        for name, value in fields.items():
            if value is ...:
                config.pop(name, None)
            else:
                config[name] = value
        (path / "config.json").write_text(json.dumps(config))
    return path


def generate(path: Path, *extra: Any, prompt: Any = "hi") -> Run:
    """`strata generate PROMPT --model PATH` (no prompt argument when `prompt` is None)."""
    return Run(["generate", *([] if prompt is None else [prompt]), "--model", str(path), *FAST,
                *extra])


# --- config.json: every field each family reads -------------------------------------------

COMMON_FIELDS: list[tuple[str, Any, str]] = [
    # (field, bad value, what the message must say besides the field's name)
    ("model_type", "llama", "supported"),
    ("model_type", 7, "supported"),
    ("hidden_act", "gelu", "supported: silu"),
    ("hidden_act", ["silu"], "supported: silu"),
    ("torch_dtype", "int8", "supported"),
    ("torch_dtype", 16, "supported"),
    ("vocab_size", 0, "integer in [1,"),
    ("vocab_size", "260", "integer in [1,"),
    ("vocab_size", 2**31, "integer in [1,"),
    ("hidden_size", -64, "integer in [1,"),
    ("hidden_size", 64.0, "integer in [1,"),
    ("num_hidden_layers", [2], "integer in [1,"),
    ("num_hidden_layers", True, "integer in [1,"),
    ("num_attention_heads", 0, "integer in [1,"),
    ("num_attention_heads", "4", "integer in [1,"),
    ("num_key_value_heads", 3, "must divide num_attention_heads"),
    ("num_key_value_heads", 0, "integer in [1,"),
    ("num_experts_per_tok", 0, "integer in [1,"),
    ("num_experts_per_tok", 9, "must be at most"),
    ("num_experts_per_tok", 2.5, "integer in [1,"),
    ("rope_theta", 0, "finite number > 0"),
    ("rope_theta", "1e4", "finite number > 0"),
    ("rope_scaling", [1], "must be an object or null"),
    ("rope_scaling", {"type": "yarn", "factor": 4}, "supported: default"),
    ("rope_parameters", "default", "must be an object or null"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "x"},
     "finite number > 0"),
    ("max_position_embeddings", 0, "integer in [1,"),
    ("max_position_embeddings", None, "integer in [1,"),
    ("tie_word_embeddings", "false", "true or false"),
    ("tie_word_embeddings", 0, "true or false"),
    ("bos_token_id", -1, "integer in [0, 259]"),
    ("bos_token_id", "<s>", "integer in [0, 259]"),
    ("eos_token_id", "x", "token id in [0, 260)"),
    ("eos_token_id", [256, "y"], "token id in [0, 260)"),
    ("eos_token_id", 260, "token id in [0, 260)"),
    ("eos_token_id", {"id": 1}, "token id in [0, 260)"),
]
FAMILY_FIELDS: dict[str, list[tuple[str, Any, str]]] = {
    "mixtral": [
        ("num_local_experts", 0, "integer in [1,"),
        ("num_local_experts", "8", "integer in [1,"),
        ("intermediate_size", ..., "is missing"),
        ("intermediate_size", 0, "integer in [1,"),
        ("rms_norm_eps", 0, "finite number > 0"),
        ("rms_norm_eps", "1e-5", "finite number > 0"),
        ("sliding_window", 0, "integer in [1,"),
        ("sliding_window", 4.5, "integer in [1,"),
    ],
    "olmoe": [
        ("num_experts", 0, "integer in [1,"),
        ("intermediate_size", "128", "integer in [1,"),
        ("norm_topk_prob", "yes", "true or false"),
        ("rms_norm_eps", -1, "finite number > 0"),
        ("attention_bias", 0, "true or false"),
        ("clip_qkv", 0, "finite number > 0"),
        ("clip_qkv", "8", "finite number > 0"),
        ("num_attention_heads", 64, "head size"),
    ],
    "qwen2_moe": [
        ("moe_intermediate_size", 0, "integer in [1,"),
        ("shared_expert_intermediate_size", -1, "integer in [0,"),
        ("shared_expert_intermediate_size", "256", "integer in [0,"),
        ("decoder_sparse_step", 2, "dense"),
        ("decoder_sparse_step", "1", "integer in [1,"),
        ("mlp_only_layers", [1], "dense"),
        ("mlp_only_layers", "none", "list of layer numbers"),
        ("use_sliding_window", "false", "true or false"),
        ("use_sliding_window", True, "not supported"),
        ("qkv_bias", "true", "true or false"),
        ("norm_topk_prob", 1, "true or false"),
        ("head_dim", 15, "must be even"),
    ],
    "qwen3_moe": [
        ("moe_intermediate_size", ..., "is missing"),
        ("attention_bias", "no", "true or false"),
        ("head_dim", 0, "integer in [2,"),
        ("head_dim", "16", "integer in [2,"),
        ("decoder_sparse_step", 0, "integer in [1,"),
        ("use_sliding_window", 1, "true or false"),
        ("norm_topk_prob", None, "true or false"),
    ],
}


def _config_case(family: str, name: str, value: Any, says: str) -> Case:
    def build(tmp: Path) -> Run:
        return generate(checkpoint(tmp, family, **{name: value}))

    shown = "absent" if value is ... else json.dumps(value)[:20]
    return Case(f"config-{family}-{name}={shown}", build, (name, says))


def config_cases() -> list[Case]:
    """Every family's own fields; the common fields (one reader for every family) each in
    one family, in turn."""
    cases = [_config_case(FAMILIES[i % len(FAMILIES)], name, value, says)
             for i, (name, value, says) in enumerate(COMMON_FIELDS)]
    for family in FAMILIES:
        cases += [_config_case(family, *entry) for entry in FAMILY_FIELDS[family]]
    return cases


def _raw_config(text: str | bytes) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        path = checkpoint(tmp)
        data = text.encode() if isinstance(text, str) else text
        (path / "config.json").write_bytes(data)
        return generate(path)

    return build


def _nested_field(tmp: Path) -> Run:
    path = checkpoint(tmp)
    text = (path / "config.json").read_text()
    nested = text.replace('"rope_scaling": null', f'"rope_scaling": {DEEP}')
    (path / "config.json").write_text(nested)
    return generate(path)


def _long_integer(tmp: Path) -> Run:
    path = checkpoint(tmp)
    text = (path / "config.json").read_text()
    digits = text.replace('"vocab_size": 260', '"vocab_size": ' + "9" * 5000)
    (path / "config.json").write_text(digits)
    return generate(path)


def _config_dir(tmp: Path) -> Run:
    path = checkpoint(tmp)
    (path / "config.json").unlink()
    (path / "config.json").mkdir()
    return generate(path)


CONFIG_FILE_CASES = [
    Case("config-nested", _raw_config(DEEP), ("config.json", "nested too deeply")),
    Case("config-nested-field", _nested_field, ("config.json", "nested too deeply")),
    Case("config-array", _raw_config("[1, 2]"), ("config.json", "JSON object", "an array")),
    Case("config-not-utf8", _raw_config(b'{"model_type": "\xff"}'), ("config.json", "UTF-8")),
    Case("config-empty", _raw_config(""), ("config.json", "not readable JSON")),
    Case("config-long-integer", _long_integer, ("config.json", "not readable JSON")),
    Case("config-a-directory", _config_dir, ("config.json",)),
]


# --- the files around the weights ---------------------------------------------------------

INDEX = "model.safetensors.index.json"


def _indexed(tmp: Path, weight_map: Any = None, *, raw: str | None = None) -> Path:
    """A checkpoint with an index; `weight_map` (default: every tensor in model.safetensors)."""
    path = checkpoint(tmp)
    if raw is None:
        if weight_map is None:
            from safetensors import safe_open

            with safe_open(str(path / "model.safetensors"), framework="np") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}  # noqa: SIM118
        raw = json.dumps({"metadata": {}, "weight_map": weight_map})
    (path / INDEX).write_text(raw)
    return path


def _index_naming(name_of: Callable[[Path, Path], str]) -> Callable[[Path], Run]:
    """An index that places one tensor in the file `name_of(tmp, checkpoint)` names."""

    def build(tmp: Path) -> Run:
        path = _indexed(tmp)
        index = json.loads((path / INDEX).read_text())
        first = sorted(index["weight_map"])[0]
        index["weight_map"][first] = name_of(tmp, path)
        (path / INDEX).write_text(json.dumps(index))
        return generate(path)

    return build


def _outside_copy(tmp: Path, path: Path) -> Path:
    """A real safetensors file outside the checkpoint (so that only the rule refuses it)."""
    outside = tmp / "outside.safetensors"
    shutil.copy(path / "model.safetensors", outside)
    return outside


def _symlink_out(tmp: Path, path: Path) -> str:
    (path / "link.safetensors").symlink_to(_outside_copy(tmp, path))
    return "link.safetensors"


def _weights_link(target: Callable[[Path, Path], Path | str]) -> Callable[[Path], Run]:
    """No index; model.safetensors replaced by a symlink to `target(tmp, checkpoint)`."""

    def build(tmp: Path) -> Run:
        path = checkpoint(tmp)
        goal = target(tmp, path)
        (path / "model.safetensors").unlink()
        (path / "model.safetensors").symlink_to(goal)
        return generate(path)

    return build


def _replace(name: str, data: bytes | None, *, link_loop: bool = False) -> Callable[[Path], Run]:
    """A checkpoint whose file `name` holds `data` (None: removed), or is a symlink loop."""

    def build(tmp: Path) -> Run:
        path = checkpoint(tmp)
        target = path / name
        target.unlink(missing_ok=True)
        if link_loop:
            target.symlink_to(name)
        elif data is not None:
            target.write_bytes(data)
        return generate(path)

    return build


def _weights_dir(tmp: Path, path: Path) -> str:
    (path / "shards.safetensors").mkdir()
    return "shards.safetensors"


FILE_CASES = [
    Case("index-weight_map-list", lambda t: generate(_indexed(t, ["model.safetensors"])),
         (INDEX, "weight_map must be a non-empty object", "an array")),
    Case("index-weight_map-string", lambda t: generate(_indexed(t, "model.safetensors")),
         (INDEX, "weight_map must be a non-empty object", "a string")),
    Case("index-weight_map-empty", lambda t: generate(_indexed(t, {})),
         (INDEX, "weight_map must be a non-empty object")),
    Case("index-no-weight_map", lambda t: generate(_indexed(t, raw='{"metadata": {}}')),
         (INDEX, "weight_map must be a non-empty object", "none")),
    Case("index-a-list", lambda t: generate(_indexed(t, raw="[]")), (INDEX, "JSON object")),
    Case("index-not-json", lambda t: generate(_indexed(t, raw="{weight_map")),
         (INDEX, "not readable JSON")),
    Case("index-nested", lambda t: generate(_indexed(t, raw=DEEP)), (INDEX, "nested too deeply")),
    Case("index-file-a-number", _index_naming(lambda t, p: 7), ("weight_map[", "file name")),
    Case("index-absolute-path", _index_naming(lambda t, p: "/etc/passwd"),
         ("'/etc/passwd'", "outside the checkpoint directory")),
    Case("index-dotdot", _index_naming(lambda t, p: "../" + _outside_copy(t, p).name),
         ("'../outside.safetensors'", "outside the checkpoint directory")),
    Case("index-symlink-out", _index_naming(_symlink_out),
         ("link.safetensors", "outside the checkpoint directory")),
    Case("index-missing-file", _index_naming(lambda t, p: "gone.safetensors"),
         ("gone.safetensors", "is missing")),
    Case("index-a-directory", _index_naming(_weights_dir),
         ("shards.safetensors", "not a regular file")),
    Case("index-symlink-loop", _replace(INDEX, None, link_loop=True), (INDEX, "cannot be read")),
    Case("weights-symlink-loop", _replace("model.safetensors", None, link_loop=True),
         ("model.safetensors", "symlink loop")),
    Case("weights-symlink-out", _weights_link(_outside_copy),
         ("model.safetensors", "outside the checkpoint directory")),
    Case("weights-symlink-to-etc", _weights_link(lambda t, p: "/etc/hostname"),
         ("model.safetensors", "outside the checkpoint directory")),
    Case("weights-text", _replace("model.safetensors", b"not a safetensors file\n"),
         ("model.safetensors", "truncated or not a safetensors file")),
    Case("weights-none", _replace("model.safetensors", None), ("no *.safetensors files",)),
]


def _tokenizer_config(value: Any = None, *, raw: str | bytes | None = None, chat: bool = False,
                      extra: dict[str, Any] | None = None) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        path = checkpoint(tmp)
        config_file = path / "tokenizer_config.json"
        if raw is not None:
            config_file.write_bytes(raw.encode() if isinstance(raw, str) else raw)
        elif value is not None:
            config_file.write_text(json.dumps(value))
        else:
            config = json.loads(config_file.read_text())
            config.update(extra or {})
            config_file.write_text(json.dumps(config))
        return generate(path, *(["--chat"] if chat else []))

    return build


def _jinja_not_utf8(tmp: Path) -> Run:
    path = checkpoint(tmp)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_bytes(b"{{ messages }}\xff")
    return generate(path, "--chat")


TOKENIZER_CASES = [
    Case("tokenizer_config-list", _tokenizer_config([1, 2]),
         ("tokenizer_config.json", "JSON object", "an array")),
    Case("tokenizer_config-string", _tokenizer_config("eos"),
         ("tokenizer_config.json", "JSON object", "a string")),
    Case("tokenizer_config-nested", _tokenizer_config(raw=DEEP),
         ("tokenizer_config.json", "nested too deeply")),
    Case("tokenizer_config-not-json", _tokenizer_config(raw="{"),
         ("tokenizer_config.json", "not readable JSON")),
    Case("tokenizer_config-not-utf8", _tokenizer_config(raw=b'{"eos_token": "\xfe"}'),
         ("tokenizer_config.json", "UTF-8")),
    Case("tokenizer_config-loop", _replace("tokenizer_config.json", None, link_loop=True),
         ("tokenizer_config.json", "cannot be read")),
    Case("bos_token-number", _tokenizer_config(extra={"bos_token": 5}), ("bos_token", "string")),
    Case("eos_token-content-number", _tokenizer_config(extra={"eos_token": {"content": 5}}),
         ("eos_token", "string")),
    Case("chat_template-number", _tokenizer_config(extra={"chat_template": 5}, chat=True),
         ("chat_template", "an integer")),
    Case("chat_template-list-of-strings", _tokenizer_config(extra={"chat_template": ["x"]},
                                                            chat=True),
         ("chat_template", "'name' and 'template'")),
    Case("chat_template-jinja-not-utf8", _jinja_not_utf8, ("chat_template.jinja", "UTF-8")),
    Case("tokenizer-json-garbage", _replace("tokenizer.json", b"{]"),
         ("tokenizer.json", "could not be read")),
    Case("tokenizer-json-missing", _replace("tokenizer.json", None), ("tokenizer.json",)),
]


# --- prompts ------------------------------------------------------------------------------

def _prompt_file(data: bytes | None, *extra: Any) -> Callable[[Path], Run]:
    """generate with --prompt-file holding `data` (None: the file is absent)."""

    def build(tmp: Path) -> Run:
        prompt = tmp / "prompt.txt"
        if data is not None:
            prompt.write_bytes(data)
        return generate(checkpoint(tmp), "--prompt-file", str(prompt), *extra, prompt=None)

    return build


def _stdin(data: bytes = b"", path: str | None = None) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        run = generate(checkpoint(tmp), prompt=None)
        run.stdin, run.stdin_path = data, path
        return run

    return build


def _device_prompt(device: str, *extra: Any) -> Callable[[Path], Run]:
    return lambda tmp: generate(checkpoint(tmp), "--prompt-file", device, *extra, prompt=None)


def _profile_prompts(data: bytes | str, suffix: str = ".txt", *extra: Any
                     ) -> Callable[[Path], Run]:
    """`strata profile` with a prompts file of `data` (a str: that path)."""

    def build(tmp: Path) -> Run:
        prompts = tmp / f"prompts{suffix}"
        if isinstance(data, str):
            prompts = Path(data)
        else:
            prompts.write_bytes(data)
        return Run(["profile", "--model", str(checkpoint(tmp)), "--prompts", str(prompts),
                    "-o", str(tmp / "p.npz"), "--device", "cpu", "--quiet", *extra])

    return build


PROMPT_CASES = [
    Case("prompt-arg-not-utf8", lambda t: generate(checkpoint(t), prompt=b"caf\xe9"),
         ("the prompt argument", "UTF-8", "0xe9")),
    Case("prompt-arg-cut-utf8", lambda t: generate(checkpoint(t), prompt=b"\xc3"),
         ("the prompt argument", "UTF-8")),
    Case("prompt-file-not-utf8", _prompt_file(b"hello \xff world"),
         ("--prompt-file", "not UTF-8", "byte 6 is 0xff")),
    Case("prompt-file-cut-utf8", _prompt_file(b"caf\xc3"),
         ("--prompt-file", "ends inside a character")),
    Case("prompt-file-missing", _prompt_file(None),
         ("--prompt-file", "No such file")),
    Case("prompt-file-a-directory", _device_prompt("/"), ("--prompt-file /", "directory")),
    Case("prompt-file-urandom", _device_prompt("/dev/urandom"), ("/dev/urandom", "UTF-8"),
         size=True),
    Case("prompt-file-zero", _device_prompt("/dev/zero"), ("/dev/zero", "--max-context 4096"),
         size=True),
    Case("prompt-file-zero-long-context", _device_prompt("/dev/zero", "--max-context",
                                                         "100000000"),
         ("/dev/zero", "is over"), size=True),
    Case("prompt-stdin-not-utf8", _stdin(b"\xfe\xff"), ("stdin", "not UTF-8", "byte 0 is 0xfe")),
    Case("prompt-stdin-zero", _stdin(path="/dev/zero"), ("stdin", "is over"), size=True),
    Case("prompt-stdin-urandom", _stdin(path="/dev/urandom"), ("stdin", "UTF-8"), size=True),
    Case("prompt-arg-and-file", lambda t: generate(checkpoint(t), "--prompt-file", "x"),
         ("not both",)),
    Case("prompt-empty", _stdin(b""), ("the prompt is empty",)),
    Case("profile-prompts-not-utf8", _profile_prompts(b"one\n\xff two\n"),
         ("--prompts", "not UTF-8", "byte 4 is 0xff")),
    Case("profile-prompts-nested-jsonl", _profile_prompts(DEEP.encode() + b"\n", ".jsonl"),
         ("--prompts", ":1: not JSON", "nested too deeply")),
    Case("profile-prompts-long-integer", _profile_prompts(b"9" * 5000 + b"\n", ".jsonl"),
         ("--prompts", ":1: not JSON")),
    Case("profile-prompts-urandom", _profile_prompts("/dev/urandom"), ("--prompts", "UTF-8"),
         size=True),
]


# --- options and sizes --------------------------------------------------------------------

def _opts(*extra: Any, family: str = "qwen3_moe", **fields: Any) -> Callable[[Path], Run]:
    return lambda tmp: generate(checkpoint(tmp, family, **fields), *extra)


OPTION_CASES = [
    Case("max-context-float", _opts("--max-context", "1e12"),
         ("--max-context", "invalid int value")),
    Case("max-context-zero", _opts("--max-context", "0"), ("--max-context", "positive")),
    Case("max-new-past-context", _opts("--max-new", "1000000000"),
         ("--max-new", "exceed --max-context")),
    Case("top-k-negative", _opts("--top-k", "-1"), ("--top-k", ">= 0")),
    Case("top-k-past-vocab", _opts("--top-k", "100000000000000000000"),
         ("--top-k", "vocabulary of 260")),
    Case("cpu-threads-zero", _opts("--cpu-threads", "0"), ("--cpu-threads", ">= 1")),
    Case("cpu-threads-past-cpus", _opts("--cpu-threads", "1000000"),
         ("--cpu-threads 1000000", "CPUs")),
    Case("vram-budget-past-ram", _opts("--vram-budget-mib", "1e9"),
         ("--vram-budget-mib 1e+09", "more than")),
    Case("vram-budget-1e300", _opts("--vram-budget-mib", "1e300"),
         ("--vram-budget-mib 1e+300", "more than")),
    Case("vram-budget-inf", _opts("--vram-budget-mib", "inf"), ("--vram-budget-mib", ">= 0")),
    Case("vram-reserve-1e300", _opts("--vram-reserve-mib", "1e300"),
         ("--vram-reserve-mib 1e+300", "more than")),
    Case("expert-cache-negative", _opts("--expert-cache", "-5"), ("--expert-cache", "auto")),
    Case("expert-cache-nan", _opts("--expert-cache", "nan"), ("--expert-cache", "auto")),
    Case("temperature-nan", _opts("--temperature", "nan"), ("--temperature", "finite")),
    Case("top-p-zero", _opts("--top-p", "0"), ("--top-p", "(0, 1]")),
    Case("seed-negative", _opts("--seed", "-1"), ("--seed", "[0, 2**63)")),
    Case("prefill-chunk-zero", _opts("--prefill-chunk", "0"), ("--prefill-chunk", "positive")),
    Case("stream-misses-past-top-k", _opts("--stream-misses", "1000000"),
         ("--stream-misses", "[0, 2]")),
    Case("short-read-zero", _opts("--short-read", "0"), ("--short-read", ">= 1")),
    Case("device-unknown", _opts("--device", "tpu"), ("--device", "tpu")),
    Case("dtype-unknown", _opts("--dtype", "int4"), ("--dtype", "int4")),
    Case("kv-dtype-unknown", _opts("--kv-dtype", "int4"),
         ("--kv-dtype must be one of auto, bf16, int8", "'int4'")),
    Case("option-unknown", _opts("--frobnicate"), ("unrecognized arguments: --frobnicate",)),
    Case("command-unknown", lambda t: Run(["generat", "x"], light=True), ("invalid choice",)),
    Case("profile-missing-options", lambda t: Run(["profile"], light=True),
         ("--model", "--prompts", "required")),
]

SIZE_CASES = [
    Case("max-context-past-ram", _opts("--max-context", "1000000000"),
         ("K/V window of 1,000,000,000 cells", "more than", "cells fit"), size=True),
    Case("max-context-past-address-space", _opts("--max-context", "1000000000000"),
         ("K/V window of 1,000,000,000,000 cells", "more than"), size=True),
    Case("max-context-and-new-past-ram", _opts("--max-new", "1000000000", "--max-context",
                                               "2000000000"),
         ("K/V window", "more than"), size=True),
    Case("max-context-kv-grow-past-ram", _opts("--max-context", "1000000000", "--kv-grow"),
         ("K/V window", "more than"), size=True),
    Case("max-context-int8-past-ram", _opts("--max-context", "1000000000", "--kv-dtype",
                                            "int8"),
         ("K/V window of 1,000,000,000 cells", "of int8 scales", "cells fit"), size=True),
    Case("config-layers-1e8", _opts(num_hidden_layers=100_000_000),
         ("tensor 'model.layers.2.", "is missing", "100,000,000 layers"), size=True),
    Case("config-layers-1e9", _opts(num_hidden_layers=1_000_000_000),
         ("num_hidden_layers", "2147483647"), size=True),
    Case("config-experts-2e8", _opts(num_experts=200_000_000),
         ("mlp.gate.weight", "[200000000, 64]"), size=True),
    Case("config-experts-mixtral-2e8", _opts(family="mixtral", num_local_experts=200_000_000),
         ("block_sparse_moe.gate.weight", "[200000000, 64]"), size=True),
    Case("config-hidden-2e9", _opts(hidden_size=2_000_000_000),
         ("model.embed_tokens.weight", "2000000000"), size=True),
    Case("config-vocab-2e9", _opts(vocab_size=2_000_000_000),
         ("model.embed_tokens.weight", "2000000000"), size=True),
    Case("config-expert-width-2e9", _opts(moe_intermediate_size=2_000_000_000),
         ("experts.0.gate_proj.weight", "2000000000"), size=True),
    Case("config-heads-1e9", _opts(num_attention_heads=1_000_000_000, num_key_value_heads=...),
         ("self_attn.q_proj.weight", "16000000000"), size=True),
    Case("synth-layers-and-experts", lambda t: Run(
        ["trace", "synth", str(t / "x.npz"), "--layers", "100000", "--experts", "100000"],
        light=True), ("trace of up to", "more than"), size=True),
    Case("synth-requests", lambda t: Run(
        ["trace", "synth", str(t / "x.npz"), "--requests", "1000000000"], light=True),
         ("512,000,000,000 tokens", "more than"), size=True),
    Case("profile-decode-past-ram", _profile_prompts(b"hello\n", ".txt", "--decode",
                                                     "1000000000"),
         ("K/V window", "more than"), size=True),
]


# --- profiles and traces (.npz) -----------------------------------------------------------

_SHARED: dict[str, Path] = {}  # files made once a session (the bombs take a second each)


def npy_bytes(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def npz_of(path: Path, members: dict[str, bytes], *, deflate: bool = False) -> Path:
    """An .npz of raw `.npy` bytes per member (headers may lie)."""
    method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", method) as z:
        for name, data in members.items():
            z.writestr(f"{name}.npy", data)
    return path


def bomb(kind: str) -> Path:
    """A small .npz whose `counts` or `expert_ids` inflates to 128 MiB of zeros."""
    if kind not in _SHARED:
        name, dtype, shape = {"profile": ("counts", "<i8", (16384, 1024)),
                              "trace": ("expert_ids", "<i2", (32768, 1024, 4))}[kind]
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"strata-bomb-{os.getpid()}-{kind}.npz"
        header = _header_bytes(dtype, shape)
        total = int(np.prod(shape)) * np.dtype(dtype).itemsize
        fmt = "strata-expert-profile" if kind == "profile" else "strata-routing-trace"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("format.npy", npy_bytes(np.array(fmt)))
            with z.open(f"{name}.npy", "w") as member:
                member.write(header)
                zeros = bytes(1 << 20)
                for _ in range(total >> 20):
                    member.write(zeros)
        _SHARED[kind] = path
    return _SHARED[kind]


def _header_bytes(dtype: str, shape: tuple[int, ...]) -> bytes:
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def _lying_npz(path: Path) -> Path:
    """`counts` whose header declares 1000 int64 and holds one."""
    return npz_of(path, {"format": npy_bytes(np.array("strata-expert-profile")),
                         "counts": _header_bytes("<i8", (1000,)) + bytes(8)})


def _profile_of_shape(path: Path, shape: tuple[int, int]) -> Path:
    from strata.formats.profile import Profile, save_profile

    save_profile(Profile(np.ones(shape, np.int64), "0" * 64), path)
    return path


def _trace(path: Path) -> Path:
    from strata.formats.trace import save_trace
    from strata.sim.synth import SynthSpec, synth_trace

    save_trace(synth_trace(SynthSpec(n_layers=2, n_experts=8, top_k=2, n_requests=2,
                                     prompt_tokens=4, decode_tokens=3)), path)
    return path


def _corrupt_deflate(path: Path) -> Path:
    """A trace whose expert_ids' deflated bytes are damaged past its header."""
    npz_of(path, {"format": npy_bytes(np.array("strata-routing-trace")),
                  "expert_ids": npy_bytes(np.zeros((100, 2, 2), np.int16))}, deflate=True)
    data = bytearray(path.read_bytes())
    start = data.find(b"expert_ids.npy") + len("expert_ids.npy") + 40
    data[start:start + 30] = bytes(byte ^ 0x55 for byte in data[start:start + 30])
    path.write_bytes(bytes(data))
    return path


def _trace_with(path: Path, **arrays: np.ndarray) -> Path:
    """A valid trace with some arrays replaced (headers and all)."""
    _trace(path)
    with np.load(path) as z:
        data = {name.removesuffix(".npy"): z[name] for name in z.files}
    data.update(arrays)
    write_npz(path, data)
    return path


PROFILE_FILES: list[tuple[str, Callable[[Path], Path], tuple[str, ...], bool]] = [
    # (id, make the file, what the message must say, a size case)
    ("text", lambda p: (p.write_text("counts = [1, 2]\n"), p)[1], ("not a zip archive",), False),
    ("empty", lambda p: (p.write_bytes(b""), p)[1], ("not a zip archive",), False),
    ("directory", lambda p: (p.mkdir(), p)[1], ("not a regular file",), False),
    ("pickled", lambda p: (np.savez(p, format=np.array([{"a": 1}], dtype=object)), p)[1],
     ("Python objects", "no pickles"), False),
    ("lying-header", _lying_npz, ("declares", "needs"), False),
    ("bomb", lambda p: bomb("profile"), ("decompression bomb",), True),
    ("format-not-scalar", lambda p: npz_of(p, {"format": npy_bytes(np.array(["a", "b"]))}),
     ("format must be a text scalar",), False),
    ("bad-npy-header", lambda p: npz_of(p, {"format": b"\x93NUMPY garbage"}),
     ("format", "not a readable .npy array"), False),
]


def _expert_profile(make: Callable[[Path], Path]) -> Callable[[Path], Run]:
    return lambda tmp: generate(checkpoint(tmp), "--expert-profile", str(make(tmp / "p.npz")))


def _simulate_profile(make: Callable[[Path], Path]) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        trace = _trace(tmp / "t.npz")
        return Run(["simulate", str(trace), "--slots", "4", "--quiet", "--profile",
                    str(make(tmp / "p.npz"))], light=True)

    return build


def _trace_info(make: Callable[[Path], Path]) -> Callable[[Path], Run]:
    return lambda tmp: Run(["trace", "info", str(make(tmp / "t.npz"))], light=True)


def _nested_bandwidths(tmp: Path) -> Run:
    (tmp / "bw.json").write_text(DEEP)
    return Run(["simulate", str(_trace(tmp / "t.npz")), "--slots", "4", "--quiet",
                "--bandwidths", str(tmp / "bw.json"), "--slot-bytes", "1024"], light=True)


def format_cases() -> list[Case]:
    cases = []
    for name, make, says, size in PROFILE_FILES:
        named = says if name == "bomb" else ("p.npz", *says)  # the bomb is a shared file
        cases.append(Case(f"expert-profile-{name}", _expert_profile(make), named, size))
        # simulate takes any .npz with counts: a bad format field only makes it not a trace.
        sim_says = ("neither a trace",) if name == "format-not-scalar" else says
        cases.append(Case(f"simulate-profile-{name}", _simulate_profile(make), sim_says, size))
    cases += [
        Case("expert-profile-another-shape", _expert_profile(
            lambda p: _profile_of_shape(p, (64, 64))), ("(64, 64)", "this model has (2, 8)")),
        Case("expert-profile-a-trace", _expert_profile(_trace),
             ("'strata-routing-trace' file, not a 'strata-expert-profile'",)),
        Case("simulate-profile-another-shape", _simulate_profile(
            lambda p: npz_of(p, {"counts": npy_bytes(np.ones((4, 4), np.int64))})),
             ("counts must be", "(2, 8)", "(4, 4)")),
        Case("trace-text", _trace_info(lambda p: (p.write_text("hello\n"), p)[1]),
             ("not a zip archive",)),
        Case("trace-bomb", _trace_info(lambda p: bomb("trace")), ("decompression bomb",),
             size=True),
        Case("trace-offsets-past-tokens", _trace_info(
            lambda p: _trace_with(p, step_offsets=np.arange(1000, dtype=np.int64))),
             ("step_offsets has 1,000 entries",)),
        Case("trace-ids-scalar", _trace_info(
            lambda p: _trace_with(p, expert_ids=np.array(3, np.int16))),
             ("expert_ids must be [N, L, K]",)),
        Case("trace-bad-npy", _trace_info(
            lambda p: npz_of(p, {"format": npy_bytes(np.array("strata-routing-trace")),
                                 "expert_ids": b"\x93NUMPY\x01\x00garbage"})),
             ("expert_ids", "not a readable .npy array")),
        Case("trace-corrupt-deflate", _trace_info(_corrupt_deflate),
             ("expert_ids", "not a readable .npy array")),
        Case("simulate-trace-text", lambda t: Run(
            ["simulate", str((t / "t.npz", (t / "t.npz").write_text("x"))[0]), "--slots", "4",
             "--quiet"], light=True), ("not a zip archive",)),
        Case("simulate-bandwidths-nested", _nested_bandwidths, ("bw.json", "nested too deeply")),
    ]
    return cases


def all_cases() -> list[Case]:
    return [*config_cases(), *CONFIG_FILE_CASES, *FILE_CASES, *TOKENIZER_CASES, *PROMPT_CASES,
            *OPTION_CASES, *SIZE_CASES, *format_cases()]
