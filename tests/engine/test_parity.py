"""Parity with the Transformers implementations of all four families, on the same checkpoint.

Each family: a random 2-layer model (hidden 64, 8 experts, top 2) saved with `save_pretrained`
(published per-expert names), loaded by `load_model` in float32 on the CPU.
Tolerance (float32): max |logit difference| <= 1e-4 on logits of magnitude ~5-10, for the prompt
and for each decode step; greedy tokens identical to `generate(do_sample=False)`.
"""

from __future__ import annotations

import pytest
import torch

from strata.engine.kv.kv_cache import new_kv
from strata.engine.model.moe import load_model
from support.hf_models import FAMILIES, hf_checkpoint, hf_logits, hf_new_cache

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
PROMPT = [5, 17, 3, 44, 9, 81, 23, 60, 7, 12, 33, 90]
N_DECODE = 6


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    path, hf_model = hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, load_model(path, dtype=torch.float32), hf_model


def hf_logits_with_decode(hf_model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Transformers' logits for the prompt, then for each of `tokens` fed one at a time."""
    cache = hf_new_cache(hf_model)
    return [hf_logits(hf_model, prompt, cache)] + [hf_logits(hf_model, [t], cache) for t in tokens]


def hf_greedy_tokens(hf_model) -> list[int]:
    """N_DECODE greedy tokens from Transformers' generate, not stopping at an eos token."""
    config = transformers.GenerationConfig(
        max_new_tokens=N_DECODE, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    out = hf_model.generate(torch.tensor([PROMPT]), generation_config=config)
    tokens = out[0, len(PROMPT) :].tolist()
    assert len(tokens) == N_DECODE
    return tokens


def test_prompt_and_decode_logits_match(pair):
    family, model, hf_model = pair
    hf_greedy = hf_greedy_tokens(hf_model)
    reference = hf_logits_with_decode(hf_model, PROMPT, hf_greedy[:-1])
    with new_kv(model, 64) as kv:
        ours = [model.forward(torch.tensor(PROMPT), 0, kv)]
        for i, token in enumerate(hf_greedy[:-1]):
            ours.append(model.forward(torch.tensor([token]), len(PROMPT) + i, kv))
    for step, (mine, ref) in enumerate(zip(ours, reference, strict=True)):
        assert mine.dtype == torch.float32 and mine.shape == ref.shape
        diff = (mine - ref).abs().max().item()
        assert diff <= ATOL, f"{family} step {step}: max |diff| {diff:.2e} > {ATOL}"
    assert ref.abs().max() > 1.0  # the logits are not trivially small


def test_greedy_tokens_identical(pair):
    family, model, hf_model = pair
    hf_greedy = hf_greedy_tokens(hf_model)
    ours = []
    with new_kv(model, 64) as kv:
        logits = model.forward(torch.tensor(PROMPT), 0, kv, last_only=True)
        for step in range(N_DECODE):
            token = int(logits[-1].argmax())
            ours.append(token)
            logits = model.forward(torch.tensor([token]), len(PROMPT) + step, kv)
    assert ours == hf_greedy, family


def test_prompt_in_pieces_matches_prompt_at_once(pair):
    """A prompt read in two parts (the second at start_pos > 0) gives the same logits."""
    _, model, hf_model = pair
    (reference,) = hf_logits_with_decode(hf_model, PROMPT, [])
    with new_kv(model, 32) as kv:
        first = model.forward(torch.tensor(PROMPT[:5]), 0, kv)
        rest = model.forward(torch.tensor(PROMPT[5:]), 5, kv)
    assert (torch.cat((first, rest)) - reference).abs().max() <= ATOL


def test_forward_at_matches_forward(pair):
    """The capture-friendly entry (positions as a tensor, fixed n_ctx) gives the same logits."""
    _, model, _ = pair
    with new_kv(model, 32) as kv_a, new_kv(model, 32) as kv_b:
        a = [model.forward(torch.tensor(PROMPT), 0, kv_a)]
        b = [model.forward_at(torch.tensor(PROMPT), torch.arange(len(PROMPT)), kv_b, 32)]
        for i, token in enumerate((4, 8, 15)):
            pos = len(PROMPT) + i
            a.append(model.forward(torch.tensor([token]), pos, kv_a))
            b.append(model.forward_at(torch.tensor([token]), torch.tensor([pos]), kv_b, 32))
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max() <= ATOL


def test_mixtral_sliding_window(tmp_path):
    """A window shorter than the context: prompt and decode logits still match Transformers."""
    path, hf_model = hf_checkpoint(tmp_path, "mixtral", sliding_window=5)
    model = load_model(path, dtype=torch.float32)
    assert model.config.sliding_window == 5
    tokens = [11, 22, 33]
    reference = hf_logits_with_decode(hf_model, PROMPT, tokens)
    with new_kv(model, 32) as kv:
        ours = [model.forward(torch.tensor(PROMPT), 0, kv)]
        for i, token in enumerate(tokens):
            ours.append(model.forward(torch.tensor([token]), len(PROMPT) + i, kv))
    for mine, ref in zip(ours, reference, strict=True):
        assert (mine - ref).abs().max() <= ATOL


def test_tied_embeddings(tmp_path):
    path, hf_model = hf_checkpoint(tmp_path, "qwen3_moe", tie_word_embeddings=True)
    model = load_model(path, dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.lm_head is model.embed
    (reference,) = hf_logits_with_decode(hf_model, PROMPT, [])
    with new_kv(model, 16) as kv:
        assert (model.forward(torch.tensor(PROMPT), 0, kv) - reference).abs().max() <= ATOL


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_float32_parity(family, tmp_path):
    """On the GPU in float32: within 5e-4 of Transformers on the CPU, same greedy tokens."""
    path, hf_model = hf_checkpoint(tmp_path, family)
    hf_greedy = hf_greedy_tokens(hf_model)
    reference = hf_logits_with_decode(hf_model, PROMPT, hf_greedy[:-1])
    model = load_model(path, device="cuda", dtype=torch.float32)
    device = model.device
    with new_kv(model, 64) as kv:
        ours = [model.forward(torch.tensor(PROMPT, device=device), 0, kv)]
        for i, token in enumerate(hf_greedy[:-1]):
            ours.append(model.forward(torch.tensor([token], device=device), len(PROMPT) + i, kv))
    for step, (mine, ref) in enumerate(zip(ours, reference, strict=True)):
        diff = (mine.cpu() - ref).abs().max().item()
        assert diff <= 5e-4, f"{family} step {step}: max |diff| {diff:.2e}"
        if step:
            assert int(ours[step - 1][-1].argmax()) == hf_greedy[step - 1]
