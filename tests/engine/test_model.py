"""load_model and MoEModel.forward: determinism, dtypes, argument errors, every family loads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from strata.engine.experts import ResidentExperts
from strata.engine.kv.kv_cache import new_kv
from strata.engine.model import layers
from strata.engine.model.checkpoint import CheckpointError
from strata.engine.model.moe import load_model
from support.checkpoints import cached_checkpoint, edit_config, make_checkpoint

FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
PROMPT = torch.tensor([3, 141, 59, 26, 5, 35, 89, 79])


def greedy(model, n_new: int, max_cells: int = 32) -> tuple[list[int], torch.Tensor]:
    """The first logits (on the CPU) and n_new greedy tokens."""
    with new_kv(model, max_cells) as kv:
        first = model.forward(PROMPT.to(model.device), 0, kv)
        tokens, logits = [], first
        for step in range(n_new):
            tokens.append(int(logits[-1].argmax()))
            ids = torch.tensor(tokens[-1:], device=model.device)
            logits = model.forward(ids, len(PROMPT) + step, kv)
    return tokens, first.cpu()


@pytest.mark.parametrize("family", FAMILIES)
def test_two_runs_are_byte_identical(family):
    path = cached_checkpoint(family)
    tokens_a, first_a = greedy(load_model(path, dtype=torch.float32), 8)
    tokens_b, first_b = greedy(load_model(path, dtype=torch.float32), 8)
    assert tokens_a == tokens_b
    assert first_a.numpy().tobytes() == first_b.numpy().tobytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_dtype_and_bf16(family):
    path = cached_checkpoint(family)  # written in bfloat16
    model = load_model(path)
    assert model.dtype == torch.bfloat16 and model.config.dtype == torch.bfloat16
    assert model.device == torch.device("cpu") and isinstance(model.experts, ResidentExperts)
    _, first = greedy(model, 4)
    assert first.dtype == torch.float32 and first.shape == (len(PROMPT), model.config.vocab_size)
    assert torch.isfinite(first).all()
    _, reference = greedy(load_model(path, dtype=torch.float32), 0)
    # bf16 rounds activations (and can flip a near-tied routing choice of the tiny random
    # model): close to the fp32 run of the same weights on average, not equal.
    assert (first - reference).abs().mean() < 0.02 * reference.abs().max()


def test_last_only_is_the_last_row():
    model = load_model(cached_checkpoint("olmoe"), dtype=torch.float32)
    with new_kv(model, 16) as kv_a, new_kv(model, 16) as kv_b:
        full = model.forward(PROMPT, 0, kv_a)
        last = model.forward(PROMPT, 0, kv_b, last_only=True)
    assert last.shape == (1, model.config.vocab_size)
    # Not bit-equal: the head's matmul over 1 row rounds differently than over T rows.
    torch.testing.assert_close(last[0], full[-1], rtol=1e-5, atol=1e-5)


def test_forward_argument_errors():
    model = load_model(cached_checkpoint("mixtral"), dtype=torch.float32)
    with new_kv(model, 8) as kv:
        with pytest.raises(ValueError, match=r"positions \[4, 12\) do not fit the K/V's 8"):
            model.forward(PROMPT, 4, kv)
        with pytest.raises(ValueError, match="token_ids must be a non-empty 1-D int64 tensor"):
            model.forward(PROMPT.to(torch.int32), 0, kv)
        with pytest.raises(ValueError, match="token_ids must be a non-empty 1-D int64 tensor"):
            model.forward(PROMPT[None], 0, kv)
        with pytest.raises(ValueError, match=r"positions must be \[8\] and n_ctx in \[1, 8\]"):
            model.forward_at(PROMPT, torch.arange(8), kv, 9)
    bf16 = load_model(cached_checkpoint("mixtral"))
    with new_kv(bf16, 8) as kv, pytest.raises(ValueError, match="K/V geometry"):
        model.forward(PROMPT, 0, kv)


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match=r"dtype torch\.float16 is not supported"):
        load_model(cached_checkpoint("olmoe"), dtype=torch.float16)
    path = make_checkpoint(tmp_path / "c", "qwen3_moe")
    edit_config(path, model_type="gpt2")
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        load_model(path)


def test_progress_bar(capsys):
    load_model(cached_checkpoint("qwen2_moe"), progress=True)
    err = capsys.readouterr().err
    assert "loading" in err and "tensor" in err


@pytest.mark.cuda
def test_cuda_bf16_runs_are_byte_identical():
    path = cached_checkpoint("qwen3_moe")
    model = load_model(path, device="cuda")
    assert model.device == torch.device("cuda", torch.cuda.current_device())
    assert model.dtype == torch.bfloat16
    tokens_a, first_a = greedy(model, 8)
    tokens_b, first_b = greedy(load_model(path, device="cuda"), 8)
    assert tokens_a == tokens_b
    assert first_a.numpy().tobytes() == first_b.numpy().tobytes()


@pytest.mark.cuda
def test_cuda_graph_replay_of_forward_at_equals_eager():
    """A decode step captured once replays with new token/position values, bit for bit."""
    model = load_model(cached_checkpoint("olmoe"), device="cuda")
    device, start = model.device, len(PROMPT)
    with new_kv(model, 64) as kv_graph, new_kv(model, 64) as kv_eager:
        model.forward(PROMPT.to(device), 0, kv_graph)
        model.forward(PROMPT.to(device), 0, kv_eager)
        token = torch.tensor([7], device=device)
        position = torch.tensor([start], device=device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up outside the capture
                model.forward_at(token, position, kv_graph, 64)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model.forward_at(token, position, kv_graph, 64)
        for step, value in enumerate((7, 11, 13, 17)):
            token.fill_(value)
            position.fill_(start + step)
            graph.replay()
            eager = model.forward_at(
                torch.tensor([value], device=device),
                torch.tensor([start + step], device=device),
                kv_eager,
                64,
            )
            assert torch.equal(logits, eager), step


class _Recorder:
    """Wraps the model's experts and Attention.attend (every attention call's): the rows each
    call saw."""

    def __init__(self, model, monkeypatch):
        self.attention_rows: list[int] = []
        self.masked: list[bool] = []  # per attention call: through a mask (not the causal call)
        self.expert_rows: list[int] = []
        inner, recorder = model.experts, self
        original = layers.Attention.attend

        def attention(self_, qkv, cos, sin, positions, cells, n_ctx, mask, causal,
                      project=True):
            recorder.attention_rows.append(qkv.shape[0])
            recorder.masked.append(mask is not None)
            return original(self_, qkv, cos, sin, positions, cells, n_ctx, mask, causal,
                            project)

        monkeypatch.setattr(layers.Attention, "attend", attention)

        class Experts:
            def forward(self_, layer, x, ids, weights):
                recorder.expert_rows.append(x.shape[0])
                return inner.forward(layer, x, ids, weights)

        model.experts = Experts()


def _one_by_one(model, prompt, start, kv):
    """[T, V]: the tokens of `prompt` fed one forward each from `start` (a reference)."""
    return torch.cat([model.forward(prompt[i : i + 1], start + i, kv)
                      for i in range(prompt.shape[0])])


@pytest.mark.parametrize(("family", "piece", "calls"), [
    ("olmoe", 3, [(15, False)]),  # longer than a piece: one causal call, no mask
    ("qwen3_moe", 3, [(15, False)]),
    ("olmoe", 15, [(15, True)]),  # at most a piece: one masked piece
    ("qwen3_moe", 16, [(15, True)]),
])
def test_a_later_chunk_attends_in_one_call_and_reads_its_experts_once(family, piece, calls,
                                                                      monkeypatch):
    model = load_model(cached_checkpoint(family), dtype=torch.float32)
    monkeypatch.setattr("strata.engine.model.moe.ATTENTION_PIECE_TOKENS", piece)
    prompt = torch.arange(1, 20) % model.config.vocab_size  # [19]
    with new_kv(model, 32) as kv_chunk, new_kv(model, 32) as kv_ref:
        model.forward(prompt[:4], 0, kv_chunk)  # a first chunk
        model.forward(prompt[:4], 0, kv_ref)
        recorder = _Recorder(model, monkeypatch)
        chunk = model.forward(prompt[4:], 4, kv_chunk)  # 15 tokens at cell 4: no window
        seen = (list(zip(recorder.attention_rows, recorder.masked, strict=True)),
                list(recorder.expert_rows))
        ref = _one_by_one(model, prompt[4:], 4, kv_ref)
        n_layers = model.config.n_layers
        assert seen == (calls * n_layers, [15] * n_layers)
        # Causal from cell 4: row t attends cells [0, 4 + t], as one token at a time does.
        torch.testing.assert_close(chunk, ref, rtol=1e-5, atol=1e-5)
        for layer in range(n_layers):
            torch.testing.assert_close(kv_chunk.k(layer)[:19], kv_ref.k(layer)[:19])
            torch.testing.assert_close(kv_chunk.v(layer)[:19], kv_ref.v(layer)[:19])


def test_past_a_sliding_window_a_chunk_attends_in_masked_pieces(monkeypatch):
    model = load_model(cached_checkpoint("olmoe"), dtype=torch.float32)
    model.config = dataclasses.replace(model.config, sliding_window=6)
    monkeypatch.setattr("strata.engine.model.moe.ATTENTION_PIECE_TOKENS", 3)
    prompt = torch.arange(1, 20) % model.config.vocab_size  # [19]
    with new_kv(model, 32) as kv_chunk, new_kv(model, 32) as kv_ref:
        model.forward(prompt[:4], 0, kv_chunk)  # within the window: one causal call
        model.forward(prompt[:4], 0, kv_ref)
        recorder = _Recorder(model, monkeypatch)
        chunk = model.forward(prompt[4:], 4, kv_chunk)  # reaches cell 19, past the window
        seen = (list(recorder.attention_rows), list(recorder.expert_rows))
        ref = _one_by_one(model, prompt[4:], 4, kv_ref)
    n_layers = model.config.n_layers
    assert seen == ([3] * 5 * n_layers, [15] * n_layers)
    torch.testing.assert_close(chunk, ref, rtol=1e-5, atol=1e-5)


def test_a_first_chunk_attends_causally_in_one_piece(monkeypatch):
    model = load_model(cached_checkpoint("olmoe"), dtype=torch.float32)
    monkeypatch.setattr("strata.engine.model.moe.ATTENTION_PIECE_TOKENS", 2)
    with new_kv(model, 16) as kv:
        recorder = _Recorder(model, monkeypatch)
        model.forward(PROMPT, 0, kv)
    assert recorder.attention_rows == [len(PROMPT)] * model.config.n_layers


def test_the_mask_is_added_to_the_scores_in_the_models_dtype():
    positions = torch.tensor([3, 4])
    for window, allowed in ((None, [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]),
                            (2, [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0]])):
        mask = layers.attention_mask(positions, 6, window, torch.bfloat16)
        assert mask.dtype == torch.bfloat16 and mask.shape == (2, 6)
        assert torch.equal(mask == 0, torch.tensor(allowed, dtype=torch.bool))
        assert torch.isneginf(mask[mask != 0]).all()
