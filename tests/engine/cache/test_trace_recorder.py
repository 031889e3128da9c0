"""Recording routing traces from real generate runs (no cache): steps, phases, requests, meta."""

import json

import numpy as np
import pytest
import torch

from strata.cli.main import main
from strata.engine.cache.arena import slot_bytes_for
from strata.engine.model.moe import load_model
from strata.engine.runtime.generate import GenerateOptions, generate
from strata.engine.runtime.recording import (
    RoutingRecorder,
    installed,
    new_trace_writer,
    trace_meta,
)
from strata.formats.trace import DECODE, PROMPT, TraceWriter, save_trace
from strata.sim import load_trace
from support.checkpoints import cached_checkpoint


@pytest.fixture(scope="module")
def model():
    return load_model(cached_checkpoint("mixtral", "tiny", dtype=torch.float32))


def _record(model, prompts, options):
    writer = new_trace_writer(model, "test", run=1)
    recorder = RoutingRecorder(model.experts, writer)
    results = []
    with installed(model, recorder):
        for prompt in prompts:
            with recorder.request(len(prompt)):
                results.append(generate(model, None, prompt, options))
    return writer.finish(), results


def test_steps_phases_and_requests_follow_the_run(model):
    options = GenerateOptions(max_new=4, temperature=0, prefill_chunk=3, ignore_stop=True)
    trace, _ = _record(model, [list(range(1, 8)), [9, 8]], options)
    # Request 0: chunks of 3, 3, 1 prompt tokens, then 3 decode rounds; request 1: 2, then 3.
    assert trace.step_tokens.tolist() == [3, 3, 1, 1, 1, 1, 2, 1, 1, 1]
    assert trace.step_phase.tolist() == [PROMPT] * 3 + [DECODE] * 3 + [PROMPT] + [DECODE] * 3
    assert trace.request_offsets.tolist() == [0, 6, 10]
    assert trace.n_layers == 2 and trace.top_k == 2 and trace.n_experts == 8
    assert trace.meta["source"] == "test" and trace.meta["run"] == 1


def test_the_ids_are_the_routers_and_output_is_unchanged(model):
    prompt = [5, 17, 33, 2, 200, 41]
    options = GenerateOptions(max_new=6, temperature=0, ignore_stop=True)
    plain = generate(model, None, prompt, options)
    seen = []

    class Spy:  # a second, independent witness of the ids: what the experts were asked for
        def __init__(self, inner):
            self.inner = inner

        def forward(self, layer, x, ids, w):
            seen.append((layer, ids.clone()))
            return self.inner.forward(layer, x, ids, w)

    spy = Spy(model.experts)
    with installed(model, spy):
        trace, (recorded,) = _record(model, [prompt], options)
    assert recorded.tokens == plain.tokens
    assert torch.equal(recorded.first_logits, plain.first_logits)
    assert model.experts is spy.inner
    rows = [ids.numpy() for _, ids in seen]
    for s in range(trace.n_steps):
        t0, t1 = trace.step_offsets[s], trace.step_offsets[s + 1]
        for layer in range(trace.n_layers):
            assert np.array_equal(trace.expert_ids[t0:t1, layer], rows[2 * s + layer])


def test_meta_carries_the_geometry_the_simulator_reads(model, tmp_path, capsys):
    meta = trace_meta(model, "x")["model"]
    cfg = model.config
    blob = 3 * cfg.expert_width * cfg.hidden_size * 4
    assert meta["slot_bytes"] == slot_bytes_for(blob)
    assert meta["kv_segment_cell_bytes"] == cfg.n_kv_heads * cfg.head_dim * 4
    assert meta["kv_segments"] == 2 * cfg.n_layers
    assert meta["config_hash"] == cfg.config_hash()
    options = GenerateOptions(max_new=5, temperature=0, ignore_stop=True)
    trace, _ = _record(model, [[1, 2, 3], [4, 5]], options)
    path = tmp_path / "t.npz"
    save_trace(trace, path)
    assert load_trace(path).meta == trace.meta
    # --kv-grow needs the geometry: the trace's meta supplies it, no flags.
    status = main(["simulate", str(path), "--slots", "4", "--kv-grow", "--bounds", "none",
                   "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert json.loads(out)["settings"]["kv"]["slot_bytes"] == meta["slot_bytes"]


def test_misuse_is_refused(model):
    writer = TraceWriter(2, 8, 2)
    recorder = RoutingRecorder(model.experts, writer)
    x = torch.zeros(1, model.config.hidden_size)
    ids, w = torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]])
    with pytest.raises(ValueError, match="outside a request"):
        recorder.forward(0, x, ids, w)
    with pytest.raises(ValueError, match="prompt_tokens must be an int >= 1, got 0"):
        recorder.begin_request(0)
    recorder.begin_request(2)
    with pytest.raises(ValueError, match="layer 1 ran where layer 0 was expected"):
        recorder.forward(1, x, ids, w)
    recorder.forward(0, x, ids, w)
    with pytest.raises(ValueError, match="stopped at layer 0 of 2"):
        recorder.end_request()
    recorder.forward(1, x, ids, w)
    # 1 of the 2 prompt tokens is read; a pass of 2 more would cross into the decode phase.
    two = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="straddles the end of the 2-token prompt"):
        recorder.forward(0, torch.zeros(2, model.config.hidden_size), two, w.expand(2, 2))
    stranger = RoutingRecorder(object(), writer)
    with pytest.raises(ValueError, match="must wrap the model's own experts"), \
            installed(model, stranger):
        pass
