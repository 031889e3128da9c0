"""Presets: the real models' published shapes, and their validation."""

import dataclasses
from pathlib import Path

import pytest

from strata.engine.model.presets import BYTE_LEVEL_VOCAB, PRESETS, get_preset


def test_olmoe_preset_is_the_published_shape():
    p = PRESETS["olmoe-1b-7b"]
    assert (p.n_layers, p.hidden_size, p.head_dim) == (16, 2048, 128)
    assert (p.n_heads, p.n_kv_heads) == (16, 16)
    assert (p.n_experts, p.top_k, p.expert_width, p.vocab_size) == (64, 8, 1024, 50304)
    assert (p.rope_theta, p.rms_norm_eps, p.norm_topk_prob) == (10000.0, 1e-5, False)


def test_qwen3_preset_is_the_published_shape():
    p = PRESETS["qwen3-30b-a3b"]
    assert (p.n_layers, p.hidden_size, p.head_dim) == (48, 2048, 128)
    assert (p.n_heads, p.n_kv_heads) == (32, 4)
    assert (p.n_experts, p.top_k, p.expert_width, p.vocab_size) == (128, 8, 768, 151936)
    assert (p.rope_theta, p.rms_norm_eps, p.norm_topk_prob) == (1e6, 1e-6, True)


def test_mixtral_preset_is_the_published_shape():
    p = PRESETS["mixtral-8x7b"]
    assert (p.n_layers, p.hidden_size, p.head_dim, p.default_family) == (32, 4096, 128, "mixtral")
    assert (p.n_heads, p.n_kv_heads) == (32, 8)
    assert (p.n_experts, p.top_k, p.expert_width, p.vocab_size) == (8, 2, 14336, 32000)
    assert (p.rope_theta, p.rms_norm_eps, p.norm_topk_prob) == (1e6, 1e-5, True)


def test_toy_presets_use_the_byte_level_vocabulary():
    assert PRESETS["tiny"].vocab_size == PRESETS["small"].vocab_size == BYTE_LEVEL_VOCAB == 260
    assert PRESETS["tiny"].n_layers == 2 and PRESETS["tiny"].hidden_size == 64


def test_with_layers_shortens_and_keeps_the_rest():
    short = PRESETS["olmoe-1b-7b"].with_layers(2)
    assert short.n_layers == 2
    assert dataclasses.replace(short, n_layers=16) == PRESETS["olmoe-1b-7b"]


@pytest.mark.parametrize("n_layers", [0, -1, 17])
def test_with_layers_rejects_what_is_not_a_shortening(n_layers):
    with pytest.raises(ValueError, match="n_layers"):
        PRESETS["olmoe-1b-7b"].with_layers(n_layers)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="tiny, small, olmoe-1b-7b, qwen3-30b-a3b"):
        get_preset("huge")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_kv_heads": 3}, "multiple of n_kv_heads"),
        ({"head_dim": 15}, "even"),
        ({"top_k": 9}, "at most n_experts"),
        ({"vocab_size": 100}, "at least 260"),
        ({"hidden_size": 0}, "hidden_size must be a positive int"),
        ({"rope_theta": 0.0}, "rope_theta"),
    ],
)
def test_bad_shapes_are_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(PRESETS["tiny"], **change)


def test_the_docs_table_of_presets_is_the_code_s():
    """docs/reference/engine-tooling.md lists every preset with its shape, as the code has it."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "engine-tooling.md")
    rows = {}
    for line in page.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 12 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1:11]
    assert set(rows) == set(PRESETS)
    for name, p in PRESETS.items():
        assert rows[name] == [p.default_family, *map(str, (
            p.n_layers, p.hidden_size, p.n_heads, p.n_kv_heads, p.head_dim, p.n_experts,
            p.top_k, p.expert_width, p.vocab_size))], name
