"""Short prompt chunks replayed from CUDA graphs (strata.engine.runtime.prompt_graphs).

CI runs the host twin: the same padded chunk run eagerly (`capture=False`), against the plain
forward and one token at a time; the CUDA tests check the replays against it and an engine's
requests through them.
"""

from __future__ import annotations

import pytest
import torch

from strata.engine.kv.kv_cache import new_kv
from strata.engine.model.moe import load_model
from strata.engine.runtime.generate import GenerateOptions, _Run
from strata.engine.runtime.prompt_graphs import PromptGraphs, padded_chunk
from support.checkpoints import cached_checkpoint


@pytest.mark.parametrize(("n_tokens", "start", "mapped", "shape"), [
    (32, 0, 4096, (32, 256)),  # a power of two: no padding, the least window
    (33, 0, 4096, (64, 256)),
    (1, 0, 4096, (16, 256)),  # the least bucket
    (512, 0, 4096, (512, 512)),
    (513, 0, 4096, None),  # past the longest bucket: eagerly
    (100, 1000, 4096, (128, 2048)),  # a later turn: the window from its last padded cell
    (100, 3969, 4096, None),  # the padded cells [3969, 4097) pass the mapped cells
    (100, 3968, 4096, (128, 4096)),
    (16, 0, 100, (16, 100)),  # the window never passes the mapped cells
])
def test_buckets_and_windows(n_tokens, start, mapped, shape):
    assert padded_chunk(n_tokens, start, mapped) == shape


@pytest.mark.parametrize(("family", "cell_dtype"), [
    ("olmoe", None), ("qwen3_moe", None), ("qwen3_moe", torch.int8)])
def test_a_padded_chunk_gives_the_plain_forwards_logits_and_cells(family, cell_dtype):
    model = load_model(cached_checkpoint(family), dtype=torch.float32)
    vocab = model.config.vocab_size
    prompt = (torch.arange(3, 3 + 45) * 7) % vocab  # [45]: chunks of 20, 20, 5 below
    with new_kv(model, 300, cell_dtype) as kv_graph, new_kv(model, 300, cell_dtype) as kv_ref:
        graphs = PromptGraphs(model, kv_graph, capture=False)
        for start in (0, 20, 40):  # buckets of 32, 32, 16, the later ones at cells 20 and 40
            chunk = prompt[start : start + 20]
            padded = graphs(chunk, start)
            plain = model.forward(chunk, start, kv_ref, last_only=True)
            assert padded.shape == plain.shape == (1, vocab)
            torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
        for layer in range(model.config.n_layers):  # the prompt's cells; the padding's after
            torch.testing.assert_close(kv_graph.k(layer)[:45], kv_ref.k(layer)[:45])
            torch.testing.assert_close(kv_graph.v(layer)[:45], kv_ref.v(layer)[:45])
        assert kv_graph.k(0)[45:56].abs().sum() > 0 and not kv_ref.k(0)[45:56].any()
        # The padding's cells are written again by the tokens that reach them before any
        # forward attends them: decode rounds after the prompt match.
        for position, token in enumerate((5, 9, 11), start=45):
            ids = torch.tensor([token])
            torch.testing.assert_close(model.forward(ids, position, kv_graph),
                                       model.forward(ids, position, kv_ref),
                                       rtol=1e-5, atol=1e-5)
        assert len(graphs.buckets) == 2 and not graphs.graphs and not graphs.seen  # host twin


def test_a_chunk_without_a_graph_runs_nothing():
    model = load_model(cached_checkpoint("olmoe"), dtype=torch.float32)
    with new_kv(model, 64) as kv:
        graphs = PromptGraphs(model, kv, capture=False)
        assert graphs(torch.zeros(60, dtype=torch.int64), 8) is None  # cells [8, 72) > 64
        assert not kv.k(0).any()


def test_a_failed_capture_leaves_every_chunk_to_the_eager_path(monkeypatch, capsys):
    model = load_model(cached_checkpoint("olmoe"), dtype=torch.float32)
    prompt = torch.arange(3, 23) % model.config.vocab_size  # [20]
    with new_kv(model, 300) as kv, new_kv(model, 300) as kv_ref:
        graphs = PromptGraphs(model, kv)  # as on CUDA: chunks are captured
        attempts = []

        def refused(step):
            attempts.append(step())  # the warm-up runs before the capture fails
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during capture")

        monkeypatch.setattr(graphs, "_capture", refused)
        reference = PromptGraphs(model, kv_ref, capture=False)
        expected = reference(prompt, 0)
        for _ in range(3):  # eagerly (the first use), the failed capture, eagerly since
            assert torch.equal(graphs(prompt, 0), expected)
        assert len(attempts) == 1  # never tried again
        assert not graphs.graphs and graphs.failed.startswith("RuntimeError: Cannot copy")
        err = capsys.readouterr().err
        assert err.count("short prompt chunks run eagerly from here on") == 1
        # The warm-up wrote the chunk's cells as the eager chunk does: nothing half-changed.
        assert torch.equal(kv.k(1)[:20], kv_ref.k(1)[:20])


def test_off_cuda_no_request_uses_them():
    model = load_model(cached_checkpoint("olmoe"), dtype=torch.float32)
    with new_kv(model, 64) as kv:
        options = GenerateOptions(max_new=2)
        for warm in (None, {}):  # with an engine's warm steps or without
            run = _Run(model, kv, None, None, options, frozenset(), warm)
            assert run._prompt_graphs() is None
            assert not warm


# --- the CUDA twins ---
def _cuda_model(family: str = "olmoe"):
    from strata.engine.experts import sorted_grouped

    if not sorted_grouped.available_for(torch.device("cuda"), torch.bfloat16):
        pytest.skip("prompt graphs need the grouped products: bf16 on Hopper and later")
    return load_model(cached_checkpoint(family), device="cuda", dtype=torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize(("family", "cell_dtype"), [
    ("olmoe", None), ("qwen3_moe", None), ("qwen3_moe", torch.int8)])
def test_cuda_replays_equal_the_eager_padded_chunk(family, cell_dtype):
    model = _cuda_model(family)
    prompt = (torch.arange(3, 3 + 45, device="cuda") * 7) % model.config.vocab_size
    with new_kv(model, 300, cell_dtype) as kv_graph, new_kv(model, 300, cell_dtype) as kv_eager:
        graphs = PromptGraphs(model, kv_graph)
        eager = PromptGraphs(model, kv_eager, capture=False)
        # (32, 256) met at 0 (eagerly), captured at 20, replayed at 0 and 20; (16, 256) met at
        # 40, captured at 40 again: the same bytes whichever way.
        for start in (0, 20, 40, 0, 20, 40):
            chunk = prompt[start : start + 20]
            assert torch.equal(graphs(chunk, start), eager(chunk, start)), start
        assert sorted(graphs.graphs) == [(16, 256), (32, 256)] and graphs.failed is None
        assert torch.equal(kv_graph.k(1)[:45], kv_eager.k(1)[:45])  # int8: the quantized values


@pytest.mark.cuda
def test_cuda_only_an_engines_requests_with_graphs_on_use_them():
    model = _cuda_model()
    with new_kv(model, 64) as kv:
        warm = {}
        for options, steps in ((GenerateOptions(max_new=2), None),  # one request alone
                               (GenerateOptions(max_new=2, cuda_graphs=False), warm)):
            assert _Run(model, kv, None, None, options, frozenset(), steps)._prompt_graphs() \
                is None
        graphs = _Run(model, kv, None, None, GenerateOptions(max_new=2), frozenset(),
                      warm)._prompt_graphs()
        assert isinstance(graphs, PromptGraphs) and warm == {("prompt", id(kv)): graphs}


@pytest.mark.cuda
def test_cuda_engine_requests_replay_prompt_graphs_deterministically():
    from strata.engine.runtime.engine import Engine

    ckpt = cached_checkpoint("olmoe")
    _cuda_model()
    options = GenerateOptions(max_new=6, temperature=0.0, max_context=512)
    with Engine.open(ckpt, device="cuda", dtype=torch.bfloat16, max_context=512) as engine:
        runs = []
        for _ in range(3):  # eagerly (the shape's first use), captured, replayed
            runs.append(engine.generate([5, 6, 7, 8, 9], options))
            engine.reset()  # the next reads its whole prompt again
        graphs = [step for key, step in engine.warm.items() if key[0] == "prompt"]
    assert len(graphs) == 1 and list(graphs[0].graphs) == [(16, 256)]
    for run in runs[1:]:  # the same bytes, with or without the graph
        assert run.tokens == runs[0].tokens
        assert torch.equal(run.first_logits, runs[0].first_logits)
