"""int8 K/V cells (`--kv-dtype int8`): the quantize/dequantize round trip's bound, attention
over int8 cells against a plain torch reference, the KVCache's segments on host memory (map,
unmap, remap all or nothing under faults), parking, and one chunk arithmetic everywhere (the
budget, the plan, the trace's meta and the simulator count what a real KVCache maps)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata import _vmm
from strata.engine.cache.budget import kv_bytes, plan_budget
from strata.engine.kv.conversations import ConversationCache
from strata.engine.kv.kv_cache import KVCache, new_kv
from strata.engine.kv.plan import cells_per_chunk
from strata.engine.model.config import ModelConfig
from strata.engine.model.kv_cells import (
    KvLayout,
    LayerCells,
    cell_dtype_of,
    dequantize,
    quantize,
)
from strata.engine.model.moe import load_model
from strata.engine.model.presets import get_preset
from strata.engine.runtime.recording import trace_meta
from strata.sim.kv_sim import KvConfig
from support.cache_state import raising_faults_until_done
from support.checkpoints import cached_checkpoint
from support.host_backend import HOST_CHUNK

CHUNK = HOST_CHUNK  # tests/engine/conftest.py's backend


# --- the round trip ---
finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([4, 8, 16, 128]), st.data())
def test_each_value_comes_back_within_half_a_step_of_its_scale(n, g, dh, data):
    values = data.draw(st.lists(finite, min_size=n * g * dh, max_size=n * g * dh))
    x = torch.tensor(values, dtype=torch.float32).view(n, g, dh)
    q, scale = quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (n, g)
    assert q.abs().max() <= 127
    assert torch.equal(scale, x.abs().amax(dim=-1) * (1.0 / 127))
    back = dequantize(q, scale, torch.float32)
    # Half a step, and float32's rounding of x / s and q * s on top.
    bound = scale.unsqueeze(-1) * (0.5 + 1e-5) + 1e-30
    assert ((back - x).abs() <= bound).all()
    # Symmetric: -x stores -q with the same scale; the largest value of a row is exact at 127.
    q_neg, scale_neg = quantize(-x)
    assert torch.equal(q_neg, -q) and torch.equal(scale_neg, scale)


def test_zero_rows_and_bf16_input_and_output():
    x = torch.zeros(2, 3, 8)
    x[1, 2] = torch.linspace(-1, 1, 8)
    q, scale = quantize(x.to(torch.bfloat16))
    assert not q[0].any() and not scale[0].any() and not q[1, :2].any()
    assert torch.isfinite(dequantize(q, scale, torch.bfloat16)).all()
    assert dequantize(q, scale, torch.bfloat16).dtype == torch.bfloat16
    assert q[1, 2].tolist() == [round(v * 127) for v in torch.linspace(-1, 1, 8).tolist()]


# --- the names ---
def test_kv_dtype_names():
    assert cell_dtype_of("auto", torch.float32) == torch.float32
    assert cell_dtype_of("auto", torch.bfloat16) == torch.bfloat16
    assert cell_dtype_of("bf16", torch.float32) == torch.bfloat16
    assert cell_dtype_of("int8", torch.bfloat16) == torch.int8
    with pytest.raises(ValueError, match="--kv-dtype must be one of auto, bf16, int8, got 'fp8'"):
        cell_dtype_of("fp8", torch.bfloat16)
    with pytest.raises(ValueError, match="head dim divisible by 4"):
        KvLayout(2, 2, 6, torch.int8)
    with pytest.raises(ValueError, match=r"cannot be torch\.float16"):
        KvLayout(2, 2, 8, torch.float16)


# --- attention over int8 cells against a plain torch reference ---
class ReferenceCells:
    """What int8 cells should hold, computed in plain torch: each written row of a (cell, kv
    head) as round(x * 127 / absmax) / 127 * absmax, kept in float32."""

    def __init__(self, n_cells: int, g: int, dh: int) -> None:
        self.k = torch.zeros(n_cells, g, dh)
        self.v = torch.zeros(n_cells, g, dh)

    @staticmethod
    def _round_trip(rows: torch.Tensor) -> torch.Tensor:
        rows = rows.float()
        absmax = rows.abs().amax(dim=-1, keepdim=True)
        step = absmax / 127
        safe = torch.where(step > 0, step, torch.ones_like(step))
        return torch.round(rows / safe) * step

    def write(self, positions, k, v):
        for dst, rows in ((self.k, k), (self.v, v)):
            dst[positions] = self._round_trip(rows)

    def read(self, n_ctx, dtype):
        return self.k[:n_ctx].to(dtype), self.v[:n_ctx].to(dtype)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_attention_over_int8_cells_matches_the_reference(backend, family):
    model = load_model(cached_checkpoint(family, "tiny", dtype=torch.float32),
                       dtype=torch.float32)
    cfg = model.config
    attn = model.layers[1].attn
    kv = KVCache(backend, cfg.n_layers, 64, cfg.n_kv_heads, cfg.head_dim, torch.float32,
                 cell_dtype=torch.int8)
    cells = kv.layer(1)
    reference = ReferenceCells(64, cfg.n_kv_heads, cfg.head_dim)
    x = torch.randn(20, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(20)
    cos, sin = (torch.randn(20, cfg.head_dim, generator=torch.Generator().manual_seed(i))
                for i in (1, 2))
    # A prompt from 0 (the causal kernel), then a masked piece and one decode token.
    calls = [(slice(0, 12), 12, None, True)]
    mask = torch.arange(19).unsqueeze(0) <= positions[12:19].unsqueeze(1)
    calls += [(slice(12, 19), 19, mask, False), (slice(19, 20), 20, None, False)]
    for rows, n_ctx, piece_mask, causal in calls:
        args = (x[rows], cos[rows], sin[rows], positions[rows])
        out = attn.forward(*args, cells, n_ctx, piece_mask, causal)
        expected = attn.forward(*args, reference, n_ctx, piece_mask, causal)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    k, v = cells.read(20, torch.float32)
    torch.testing.assert_close(k, reference.k[:20], rtol=0, atol=1e-6)
    torch.testing.assert_close(v, reference.v[:20], rtol=0, atol=1e-6)
    kv.close()


def test_a_model_over_int8_cells_is_close_and_deterministic():
    model = load_model(cached_checkpoint("olmoe", "tiny", dtype=torch.float32),
                       dtype=torch.float32)
    ids = torch.tensor([3, 17, 99, 5, 60, 200, 7, 8, 11, 42])
    with new_kv(model, 16) as exact:
        reference = model.forward(ids, 0, exact)
    runs = []
    for _ in range(2):
        with new_kv(model, 16, torch.int8) as kv:
            prompt = model.forward(ids[:6], 0, kv)
            rest = [model.forward(ids[i:i + 1], i, kv) for i in range(6, 10)]  # decode
            runs.append(torch.cat([prompt, *rest]))
    assert torch.equal(runs[0], runs[1])  # deterministic, bit for bit
    log_p, log_q = (torch.log_softmax(t.double(), -1) for t in (reference, runs[0]))
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    assert kl.max() < 1e-3 and (reference.argmax(-1) == runs[0].argmax(-1)).all()


def test_bf16_cells_under_an_fp32_model():
    model = load_model(cached_checkpoint("olmoe", "tiny", dtype=torch.float32),
                       dtype=torch.float32)
    ids = torch.tensor([3, 17, 99, 5])
    with new_kv(model, 8) as exact, new_kv(model, 8, torch.bfloat16) as half:
        assert half.k(0).dtype == torch.bfloat16 and half.dtype == torch.float32
        reference, logits = model.forward(ids, 0, exact), model.forward(ids, 0, half)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, reference, rtol=0.05, atol=0.05)


# --- the KVCache's segments ---
def _int8_kv(backend, mapped_cells=2048, n_layers=3):
    # 2 heads x 16 dims: 32-byte cells, 2048 a chunk; 3 layers: 6 value segments, and 4 scale
    # pairs a cell: 2 scale segments (the second half used). 8 segments of 4 chunks.
    return KVCache(backend, n_layers, 8192, 2, 16, torch.float32, mapped_cells=mapped_cells,
                   cell_dtype=torch.int8)


def test_int8_segments_views_and_zeroing(backend):
    kv = _int8_kv(backend)
    layout = kv.layout
    assert (kv.cell_bytes, layout.scale_pairs, layout.scale_segments, kv.n_segments) == (
        32, 4, 2, 8)
    assert kv.segment_chunks == 4 and kv.mapped_cells == 2048
    assert kv.bytes_mapped == 8 * CHUNK and layout.bytes_per_cell == 8 * 32
    base = kv.k(0).data_ptr()
    scales = kv.scales()
    assert [s.shape for s in scales] == [(2048, 4, 2)] * 2
    assert [s.data_ptr() - base for s in scales] == [6 * kv.segment_bytes, 7 * kv.segment_bytes]
    for layer in range(3):
        cells = kv.layer(layer)
        assert cells.k.dtype == torch.int8 and cells.k.shape == (2048, 2, 16)
        assert cells.k.data_ptr() - base == 2 * layer * kv.segment_bytes
        assert cells.k_scale.shape == (2048, 2)
        segment, row = layout.scale_row(layer, 0)
        assert cells.k_scale.data_ptr() == scales[segment - 6][:, row].data_ptr()
    # Every scale row is a pair's own: writing one layer's leaves the others zero.
    kv.layer(2).write(torch.tensor([5]), torch.ones(1, 2, 16), torch.full((1, 2, 16), 2.0))
    assert scales[1][5, 0].eq(1 / 127).all() and scales[1][5, 1].eq(2 / 127).all()
    assert not scales[0].any() and not scales[1][:, 2:].any()
    for layer in range(3):
        kv.layer(layer).k.fill_(7)
    for s in scales:
        s.fill_(3.0)
    kv.unmap_cells(2048)
    kv.map_cells(4096)  # fresh chunks: zero, the scales too
    assert all(not s[2048:].any() and s[:2048].eq(3.0).all() for s in kv.scales())
    assert not kv.k(1)[2048:].any() and kv.k(1)[:2048].eq(7).all()
    kv.close()


def _contents(kv):
    return [t.clone() for t in (*kv._k, *kv._v, *kv.scales())]


def _state(kv, backend):
    return {"contents": _contents(kv), "chunks": kv.mapped_chunks,
            "mapped": backend.bytes_mapped, "alive": backend.alive_chunks}


def _stamp(kv):
    gen = torch.Generator().manual_seed(0)
    for layer in range(kv.n_layers):
        kv.layer(layer).write(torch.arange(kv.mapped_cells),
                              torch.randn(kv.mapped_cells, 2, 16, generator=gen),
                              torch.randn(kv.mapped_cells, 2, 16, generator=gen))


@pytest.mark.parametrize("op", ["create", "map", "access"])
def test_a_fault_at_every_chunk_of_an_int8_growth_leaves_everything_as_it_was(backend, op):
    kv = _int8_kv(backend)
    _stamp(kv)
    given = []

    def give():
        given[:] = backend.create_chunks(5)  # 8 chunks a step: 5 given, 3 created

    def given_unmapped():
        assert not any(c.mapped for c in given)

    failed, _ = raising_faults_until_done(
        backend, op, lambda: kv.map_cells(4096, chunks=given), lambda: _state(kv, backend),
        check=given_unmapped, prepare=give)
    # One fault a chunk: 3 created, 8 mapped (one a segment), one access run a segment.
    assert failed == {"create": 3, "map": 8, "access": 8}[op]
    assert kv.mapped_cells == 4096 and not kv.scales()[1][2048:].any()
    kv.close()


def test_an_int8_unmap_under_faults_then_remap_keeps_every_byte(backend):
    kv = _int8_kv(backend, mapped_cells=8192)
    _stamp(kv)
    before = _contents(kv)
    failed, chunks = raising_faults_until_done(backend, "unmap", lambda: kv.unmap_cells(2048),
                                               lambda: _state(kv, backend))
    assert failed == 8 and len(chunks) == 24 and kv.mapped_cells == 2048
    kv.remap_cells(8192, chunks)
    assert all(torch.equal(a, b) for a, b in zip(_contents(kv), before, strict=True))
    kv.close()


def test_parking_int8_cells_keeps_values_and_scales(backend):
    kv = _int8_kv(backend)
    _stamp(kv)
    cache = ConversationCache(1 << 20, 2)
    entry, _ = cache.park(list(range(100)), kv)
    assert entry.nbytes == 100 * cache.cell_bytes(kv) == 100 * kv.layout.bytes_per_cell
    before = _contents(kv)
    for t in (*kv._k, *kv._v, *kv.scales()):
        t.zero_()
    cache.take(entry)
    other = KVCache(backend, 3, 8192, 2, 16, torch.float32, mapped_cells=2048)
    with pytest.raises(ValueError, match=r"cannot restore torch\.int8 cells into a K/V of "
                                         r"torch\.float32 cells"):
        cache.restore(entry, other, 100)
    other.close()
    cache.restore(entry, kv, 100)
    after = _contents(kv)
    assert all(torch.equal(a[:100], b[:100]) for a, b in zip(after, before, strict=True))
    kv.close()


def test_layer_cells_of_plain_cells_read_without_a_copy(backend):
    kv = KVCache(backend, 1, 64, 2, 16, torch.bfloat16)
    cells = kv.layer(0)
    assert cells == LayerCells(kv.k(0), kv.v(0)) and kv.scales() == []
    keys, _ = cells.read(10, torch.bfloat16)
    assert keys.data_ptr() == kv.k(0).data_ptr()
    kv.close()


# --- one chunk arithmetic: budget, plan, trace meta and simulator against a real KVCache ---
@pytest.mark.parametrize("preset", ["tiny", "small", "olmoe-1b-7b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("cell_dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_budget_plan_trace_and_simulator_count_what_the_kv_maps(preset, cell_dtype):
    p = get_preset(preset).with_layers(2)
    cfg = ModelConfig(family="qwen3_moe", n_layers=p.n_layers, hidden_size=64,
                      n_heads=p.n_heads, n_kv_heads=p.n_kv_heads, head_dim=p.head_dim,
                      vocab_size=64, n_experts=4, top_k=2, expert_width=32)
    chunk = 1 << 16
    layout = KvLayout.of(cfg, cell_dtype)
    backend = _vmm.HostBackend(chunk)
    with KVCache(backend, cfg.n_layers, 3000, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16,
                 mapped_cells=1, cell_dtype=cell_dtype) as kv:
        per_chunk = cells_per_chunk(cfg, cell_dtype, chunk)
        assert per_chunk == chunk // kv.cell_bytes and chunk % kv.cell_bytes == 0
        model = type("M", (), {"config": cfg, "dtype": torch.bfloat16, "experts_quant": None,
                               "experts_dtype": "bfloat16"})()
        meta = trace_meta(model, "t", kv_dtype=cell_dtype)["model"]
        assert (meta["kv_segment_cell_bytes"], meta["kv_segments"]) == (
            kv.cell_bytes, kv.n_segments)
        assert meta["kv_dtype"] == str(cell_dtype).removeprefix("torch.")
        sim = KvConfig(max_context=3000, slot_bytes=4096, chunk_bytes=chunk,
                       kv_segment_cell_bytes=meta["kv_segment_cell_bytes"],
                       kv_segments=meta["kv_segments"])
        for cells in (1, per_chunk, per_chunk + 1, 3000):
            kv.map_cells(cells)
            mapped = kv.mapped_chunks * kv.n_segments
            assert kv.bytes_mapped == mapped * chunk == kv_bytes(cfg, cells, cell_dtype, chunk)
            assert layout.mapped_bytes(cells, chunk) == kv.bytes_mapped
            grid = math.ceil(cells / per_chunk) * per_chunk
            assert sim.chunks_for(grid) == mapped
    budget = plan_budget(cfg, torch.bfloat16, torch.device("cpu"), slot_bytes=4096,
                         chunk_bytes=chunk, max_context=3000, prefill_chunk=64,
                         kv_dtype=cell_dtype)
    assert budget.kv_bytes == kv_bytes(cfg, 3000, cell_dtype, chunk)
    backend.close()
    if cell_dtype == torch.int8:  # half of bf16's cell, and ceil(2L / (Dh / 4)) more segments
        bf16 = KvLayout.of(cfg, torch.bfloat16)
        assert 2 * layout.cell_bytes == bf16.cell_bytes
        assert layout.n_segments == 2 * cfg.n_layers + math.ceil(8 * cfg.n_layers / cfg.head_dim)


# --- the CUDA twins (the host backend's tests above run in CI) ---
@pytest.mark.cuda
def test_cuda_int8_cells_segments_and_graph_rounds():
    import dataclasses

    from strata.engine.memory import device_backend
    from strata.engine.runtime.generate import GenerateOptions, generate

    backend = device_backend("cuda")
    with KVCache(backend, 2, 5000, 4, 128, torch.bfloat16, cell_dtype=torch.int8) as kv:
        assert kv.n_segments == 5 and kv.segment_bytes % backend.chunk_bytes == 0
        assert not kv.scales()[0].any().item() and not kv.k(1).any().item()
        x = torch.randn(3, 4, 128, device="cuda")
        kv.layer(1).write(torch.tensor([0, 9, 4999], device="cuda"), x, -x)
        keys, values = kv.layer(1).read(5000, torch.float32)
        host_q, host_s = quantize(x.cpu())
        torch.testing.assert_close(keys[[0, 9, 4999]].cpu(),
                                   dequantize(host_q, host_s, torch.float32), rtol=0, atol=0)
        assert torch.equal(values[[0, 9, 4999]], -keys[[0, 9, 4999]])
    backend.close()
    ckpt = cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32)
    model = load_model(ckpt, device="cuda")
    options = GenerateOptions(max_new=300, max_context=512, temperature=0.0, ignore_stop=True)
    runs = {}
    for graphs in (True, False):
        with new_kv(model, 512, torch.int8) as kv:
            runs[graphs] = generate(model, None, [5, 6, 7, 8, 9, 10], dataclasses.replace(
                options, cuda_graphs=graphs), cells=kv)
    assert (runs[True].decode_path, runs[False].decode_path) == ("cuda-graph", "eager")
    assert runs[True].tokens == runs[False].tokens
    with new_kv(model, 512, torch.int8) as kv:  # deterministic: the same bytes again
        again = generate(model, None, [5, 6, 7, 8, 9, 10], options, cells=kv)
    assert again.tokens == runs[True].tokens
