"""The trace format: round trips, byte-identical files, the writer, and every rejected file."""

import hashlib
import json
import re
import zipfile

import numpy as np
import pytest

from strata.formats.trace import (
    DECODE,
    FORMAT,
    PROMPT,
    VERSION,
    Trace,
    TraceError,
    TraceWriter,
    load_trace,
    save_trace,
)


def small_trace(weights=False):
    """2 requests: a 3-token prompt step and 2 decode steps; then a 2-token prompt, 1 decode.
    2 layers, 5 experts, top-2."""
    rng = np.random.default_rng(0)
    ids = np.stack([
        np.stack([rng.choice(5, 2, replace=False) for _ in range(2)]) for _ in range(8)
    ]).astype(np.int32)  # [8, 2, 2]
    return Trace(
        n_experts=5,
        expert_ids=ids,
        step_offsets=np.array([0, 3, 4, 5, 7, 8]),
        step_phase=np.array([PROMPT, DECODE, DECODE, PROMPT, DECODE], np.uint8),
        request_offsets=np.array([0, 3, 5]),
        router_weights=rng.random(ids.shape).astype(np.float32) if weights else None,
        meta={"source": "test"},
    )


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rewrite(path, **changes):
    """The .npz at `path` with some fields replaced (None: removed), written back."""
    with np.load(path) as z:
        data = {name: z[name] for name in z.files}
    for name, value in changes.items():
        if value is None:
            data.pop(name)
        else:
            data[name] = value
    np.savez(path, **data)


def test_round_trip_and_figures(tmp_path):
    trace = small_trace(weights=True)
    path = tmp_path / "t.npz"
    save_trace(trace, path)
    back = load_trace(path)
    for name in ("expert_ids", "step_offsets", "step_phase", "request_offsets",
                 "router_weights"):
        assert np.array_equal(getattr(back, name), getattr(trace, name)), name
    assert back.meta == {"source": "test"}
    assert (back.n_layers, back.n_experts, back.top_k) == (2, 5, 2)
    assert (back.n_tokens, back.n_steps, back.n_requests, back.n_accesses) == (8, 5, 2, 32)
    assert back.request_tokens.tolist() == [5, 3]
    assert back.step_tokens.tolist() == [3, 1, 1, 2, 1]
    counts = back.routing_counts()
    assert counts.sum() == 32 and counts.shape == (2, 5)
    assert counts[1, 3] == np.count_nonzero(trace.expert_ids[:, 1] == 3)
    summary = back.summary()
    assert (summary["prompt_tokens"], summary["decode_tokens"]) == (5, 3)
    assert not back.expert_ids.flags.writeable


def test_same_trace_same_bytes(tmp_path):
    save_trace(small_trace(), tmp_path / "a.npz")
    save_trace(small_trace(), tmp_path / "b.npz")
    assert digest(tmp_path / "a.npz") == digest(tmp_path / "b.npz")
    with zipfile.ZipFile(tmp_path / "a.npz") as z:
        assert "router_weights.npy" not in z.namelist()
        assert z.getinfo("expert_ids.npy").date_time == (1980, 1, 1, 0, 0, 0)
    with np.load(tmp_path / "a.npz") as z:
        assert z["expert_ids"].dtype == np.int16  # E fits: stored small
        assert str(z["format"]) == FORMAT and int(z["version"]) == VERSION


def test_writer_builds_the_same_trace():
    trace = small_trace(weights=True)
    writer = TraceWriter(2, 5, 2, router_weights=True, meta={"source": "test"})
    for r in range(trace.n_requests):
        writer.begin_request()
        for s in range(trace.request_offsets[r], trace.request_offsets[r + 1]):
            t0, t1 = trace.step_offsets[s], trace.step_offsets[s + 1]
            writer.begin_step("prompt" if trace.step_phase[s] == PROMPT else "decode")
            for layer in (1, 0):  # any order of layers
                writer.record(layer, trace.expert_ids[t0:t1, layer],
                              trace.router_weights[t0:t1, layer])
            writer.end_step()
        writer.end_request()
    built = writer.finish()
    for name in ("expert_ids", "step_offsets", "step_phase", "request_offsets",
                 "router_weights"):
        assert np.array_equal(getattr(built, name), getattr(trace, name)), name


def test_writer_add_step_and_save(tmp_path):
    writer = TraceWriter(2, 4, 1)
    writer.begin_request()
    writer.add_step("prompt", [[[0], [1]], [[2], [3]]])
    writer.add_step(DECODE, [[[1], [1]]])
    writer.end_request()
    trace = writer.save(tmp_path / "w.npz")
    assert load_trace(tmp_path / "w.npz").expert_ids.tolist() == trace.expert_ids.tolist()
    assert trace.step_phase.tolist() == [PROMPT, DECODE]


@pytest.mark.parametrize(("calls", "message"), [
    ([("begin_step", "prompt")], "no request is open"),
    ([("begin_request",), ("begin_request",)], "was not ended"),
    ([("begin_request",), ("begin_step", "both")], "phase must be 'prompt' or 'decode'"),
    ([("begin_request",), ("record", 0, [[0, 1]])], "no step is open"),
    ([("begin_request",), ("begin_step", 0), ("record", 2, [[0, 1]])], "layer 2 is outside"),
    ([("begin_request",), ("begin_step", 0), ("record", 0, [[0, 0]])], "routed to one expert"),
    ([("begin_request",), ("begin_step", 0), ("record", 0, [[0, 5]])], "outside [0, 5)"),
    ([("begin_request",), ("begin_step", 0), ("record", 0, [[0, 1, 2]])], "int [T, 2]"),
    ([("begin_request",), ("begin_step", 0), ("record", 0, [[0.0, 1.0]])], "int [T, 2]"),
    ([("begin_request",), ("begin_step", 0), ("record", 0, [[0, 1]]),
      ("record", 1, [[0, 1], [2, 3]])], "has 2 tokens, other layers of this step 1"),
    ([("begin_request",), ("begin_step", 0), ("record", 0, [[0, 1]]),
      ("record", 0, [[0, 1]])], "already recorded"),
    ([("begin_request",), ("begin_step", 0), ("record", 0, [[0, 1]]), ("end_step",)],
     "layers [1] were not recorded"),
    ([("begin_request",), ("begin_step", 1), ("record", 0, [[0, 1]]), ("record", 1, [[0, 1]]),
      ("end_step",), ("begin_step", 0)], "prompt step cannot follow a decode step"),
    ([("begin_request",), ("end_request",)], "has no steps"),
    ([("begin_request",), ("finish",)], "still open"),
    ([("finish",)], "no request was recorded"),
    ([("begin_request",), ("begin_step", 0), ("record", 0, [[0, 1]], [[0.5, 0.5]])],
     "router_weights=False"),
])
def test_writer_rejects_misuse(calls, message):
    writer = TraceWriter(2, 5, 2)
    *setup, last = calls
    for name, *args in setup:
        getattr(writer, name)(*args)
    before = (len(writer._ids), writer._step and list(writer._step), writer._in_request)
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(writer, last[0])(*last[1:])
    assert (len(writer._ids), writer._step and list(writer._step), writer._in_request) == before


def test_writer_checks_its_shape():
    with pytest.raises(ValueError, match="top_k 6 exceeds n_experts 5"):
        TraceWriter(2, 5, 6)
    with pytest.raises(ValueError, match="n_layers must be an int >= 1"):
        TraceWriter(0, 5, 2)


def test_load_missing_and_unreadable(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trace file"):
        load_trace(tmp_path / "none.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceError, match=r"junk\.npz is not a readable \.npz trace"):
        load_trace(tmp_path / "junk.npz")
    np.savez(tmp_path / "other.npz", counts=np.zeros(3))
    with pytest.raises(TraceError, match="has no 'format' field"):
        load_trace(tmp_path / "other.npz")


@pytest.mark.parametrize(("changes", "message"), [
    ({"format": np.array("strata-residency-table")}, "is a 'strata-residency-table' file"),
    ({"version": np.array(2)}, "format version 2; this strata reads version 1"),
    ({"step_phase": None}, r"fields \['step_phase'\] are missing"),
    ({"expert_ids": np.zeros((8, 2, 2), np.float32)}, "must be int16 or int32"),
    ({"expert_ids": np.full((8, 2, 2), 7, np.int16)}, r"expert_ids\[0, 0, 0\] = 7 is outside"),
    ({"expert_ids": np.zeros((8, 2, 2), np.int16)}, "token 0 is routed to one expert twice"),
    ({"expert_ids": np.zeros((8, 2), np.int16)}, r"must be \[N, L, K\]"),
    ({"step_offsets": np.array([0, 3, 4, 5, 7, 9])}, "must start at 0 and end at 8"),
    ({"step_offsets": np.array([0, 3, 3, 5, 7, 8])}, "must increase strictly"),
    ({"step_offsets": np.array([0, 3, 4, 5, 7, 8], np.int32)}, "step_offsets must be int64"),
    ({"request_offsets": np.array([0, 3, 6])}, "must start at 0 and end at 5"),
    ({"step_phase": np.array([0, 1, 2, 0, 1], np.uint8)}, r"step_phase\[2\] = 2"),
    ({"step_phase": np.array([0, 1, 1, 0], np.uint8)}, r"must be integers \[S\] = \[5\]"),
    ({"step_phase": np.array([0, 1, 0, 0, 1], np.uint8)}, "step 2 is a prompt step after"),
    ({"request_offsets": np.array([0, 5])}, "step 3 is a prompt step after a decode step"),
    ({"n_experts": np.array(0)}, "n_experts must be >= 1"),
    ({"n_experts": np.array(1)}, "top_k 2 .* exceeds n_experts 1"),
    ({"meta": np.array("{not json")}, "meta is not JSON"),
    ({"meta": np.array("[1, 2]")}, "meta must be a JSON object"),
    ({"router_weights": np.ones((8, 2, 2), np.float64)}, "float16 or float32"),
    ({"router_weights": np.full((8, 2, 2), np.nan, np.float32)}, "want a finite weight"),
    ({"router_weights": np.ones((8, 2, 1), np.float32)}, "of expert_ids' shape"),
])
def test_load_rejects_a_bad_file_with_the_reason(tmp_path, changes, message):
    path = tmp_path / "t.npz"
    save_trace(small_trace(), path)
    rewrite(path, **changes)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert str(path) in str(info.value)


def test_meta_must_be_json_ready():
    with pytest.raises(TraceError, match="meta must be JSON-ready"):
        Trace(5, np.zeros((1, 1, 1), np.int32), [0, 1], [0], [0, 1], meta={"x": object()})
    trace = Trace(5, np.zeros((1, 1, 1), np.int32), [0, 1], [0], [0, 1], meta={"n": (1, 2)})
    assert json.dumps(trace.meta) == '{"n": [1, 2]}'
