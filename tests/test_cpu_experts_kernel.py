"""strata._cpu_experts against a plain torch reference with the same roundings (hypothesis),
for bf16 blobs and int8 ones (`strata.engine.experts.quant`).

The kernel adds its sums in another order than torch's matmul, so it is compared within a
bound, and bit for bit with itself across thread counts (each output value is one thread's, in
one fixed order). Shapes are small and unaligned (D and F not multiples of the kernel's 32-wide
vectors or its 16-row blocks), so the tails are exercised.
"""

import contextlib
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from strata import _cpu_experts
from strata.engine.experts.quant import (
    INT4_MAX,
    INT8_MAX,
    WEIGHT_FORMATS,
    dequantize_int4,
    dequantize_int8,
    fake_quantize,
    int4_blob,
    int4_blob_bytes,
    int8_blob,
    int8_blob_bytes,
    int8_parts,
    make_blob,
    quantize_int4,
    quantize_int8,
)


def _u16(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.int16).numpy().view(np.uint16)


def _blobs(n_experts: int, f: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n_experts, 3 * f * d, generator=gen) * d**-0.5).bfloat16()


def _run(blobs, experts, starts, x, f, threads, fmt=_cpu_experts.FORMAT_BF16,
         schedule="dynamic", prefetch_bytes=0, gate_up_rows=_cpu_experts.GATE_UP_ROWS,
         down_rows=_cpu_experts.DOWN_ROWS, down_block_rows=_cpu_experts.DOWN_BLOCK_ROWS):
    """blobs: bf16 [E, 3*F*D] (FORMAT_BF16) or uint8 [E, int8 blob bytes] (FORMAT_INT8)."""
    out = torch.full((x.shape[0], x.shape[1]), 7.0, dtype=torch.bfloat16)
    _cpu_experts.compute(blobs.contiguous().view(torch.uint8).numpy(), fmt,
                         np.asarray(experts, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                         x.float().numpy(), _u16(out), f, threads, schedule, prefetch_bytes,
                         gate_up_rows, down_rows, down_block_rows)
    return out


def _int8_blobs(blobs: torch.Tensor, f: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [E, int8 blob bytes], the weights they stand for: float32 [E, 3*F*D])."""
    packed, weights = [], []
    for typed in blobs.float():
        gate, up, down = typed[: f * d].view(f, d), typed[f * d : 2 * f * d].view(f, d), \
            typed[2 * f * d :].view(d, f)
        blob = int8_blob(gate, up, down)
        packed.append(blob)
        weights.append(torch.cat([dequantize_int8(q, s).reshape(-1)
                                  for q, s in int8_parts(blob, f, d)]))
    return torch.stack(packed), torch.stack(weights)


def _reference(blobs, experts, starts, x, f):
    """The torch bf16 path's roundings over fp32 sums: h, silu(g) and the product in bf16.
    blobs: each expert's weights [E, 3*F*D] in any float dtype."""
    d = x.shape[1]
    out = []
    for i, expert in enumerate(experts):
        typed = blobs[expert].float()
        gate_up, down = typed[: 2 * f * d].view(2 * f, d), typed[2 * f * d :].view(d, f)
        h = (x[starts[i] : starts[i + 1]].float() @ gate_up.T).bfloat16()
        act = F.silu(h[:, :f]) * h[:, f:]  # bf16, as torch's
        out.append((act.float() @ down.T).bfloat16())
    return torch.cat(out) if out else torch.empty(0, d, dtype=torch.bfloat16)


def _within_roundings(out, blobs, experts, starts, x, f):
    """Whether out [R, D] is the reference within what its roundings allow: each intermediate
    rounded to bf16 (2**-8 relative) may fall the other way in another summation order, so an
    output may move by a few 2**-8 of the magnitude of its terms, sum_f |act[f] * down[d, f]|
    (larger than the output itself where the terms cancel); a wrong row, offset or tail moves it
    by the whole value."""
    expected = _reference(blobs, experts, starts, x, f).float()
    d = x.shape[1]
    magnitude = []
    for i, expert in enumerate(experts):
        typed = blobs[expert].float()
        gate_up, down = typed[: 2 * f * d].view(2 * f, d), typed[2 * f * d :].view(d, f)
        h = x[starts[i] : starts[i + 1]].float() @ gate_up.T
        act = F.silu(h[:, :f]) * h[:, f:]
        magnitude.append(act.abs() @ down.abs().T)
    bound = torch.cat(magnitude) * 2**-5 + 1e-6 if magnitude else expected
    return bool(((out.float() - expected).abs() <= bound).all())


@st.composite
def calls(draw):
    d, f = draw(st.integers(1, 80)), draw(st.integers(1, 40))
    n_experts = draw(st.integers(1, 5))
    experts = draw(st.lists(st.integers(0, n_experts - 1), min_size=0, max_size=4))
    # Up to 9 rows an expert: int8 takes rows four at a time, then one by one.
    counts = draw(st.lists(st.integers(0, 9), min_size=len(experts), max_size=len(experts)))
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(int(starts[-1]), d, generator=torch.Generator().manual_seed(seed + 1))
    return _blobs(n_experts, f, d, seed), experts, starts, x.bfloat16(), f


@settings(max_examples=150, deadline=None)
@given(calls(), st.integers(2, 5), st.sampled_from(sorted(_cpu_experts.SCHEDULES)),
       st.sampled_from([0, 64, 1024, 4096]))
def test_the_kernel_is_the_reference_within_bf16_roundings_at_any_thread_count(
        call, threads, schedule, prefetch_bytes):
    """The same bytes on one thread and on several, whichever way the tasks reach them and
    however far ahead the weights are prefetched (past a blob's end too: never a fault)."""
    blobs, experts, starts, x, f = call
    one = _run(blobs, experts, starts, x, f, 1)
    assert torch.equal(_run(blobs, experts, starts, x, f, threads, schedule=schedule,
                            prefetch_bytes=prefetch_bytes).view(torch.int16),
                       one.view(torch.int16))
    assert _within_roundings(one, blobs, experts, starts, x, f)


def test_almost_every_value_is_torch_s_bf16_path_bit_for_bit():
    f, d = 128, 256
    blobs = _blobs(4, f, d, 0)
    experts, starts = [3, 0, 2], np.array([0, 1, 3, 4])
    x = torch.randn(4, d, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = _run(blobs, experts, starts, x, f, 3)
    torch_path = []
    for i, expert in enumerate(experts):
        typed = blobs[expert]
        h = F.linear(x[starts[i] : starts[i + 1]], typed[: 2 * f * d].view(2 * f, d))
        torch_path.append(F.linear(F.silu(h[:, :f]) * h[:, f:], typed[2 * f * d :].view(d, f)))
    assert (out == torch.cat(torch_path)).float().mean() > 0.97


@settings(max_examples=100, deadline=None)
@given(calls(), st.integers(2, 5), st.sampled_from([0, 64, 4096]))
def test_int8_blobs_are_their_dequantized_weights_within_bf16_roundings(call, threads,
                                                                      prefetch_bytes):
    """The same bytes whatever the threads, the schedule and the prefetch distance."""
    bf16_blobs, experts, starts, x, f = call
    blobs, weights = _int8_blobs(bf16_blobs, f, x.shape[1])
    assert blobs.shape[1] == int8_blob_bytes(f, x.shape[1]) == _cpu_experts.blob_bytes(
        _cpu_experts.FORMAT_INT8, f, x.shape[1])
    one = _run(blobs, experts, starts, x, f, 1, _cpu_experts.FORMAT_INT8)
    for schedule in _cpu_experts.SCHEDULES:
        assert torch.equal(_run(blobs, experts, starts, x, f, threads, _cpu_experts.FORMAT_INT8,
                                schedule, prefetch_bytes).view(torch.int16),
                           one.view(torch.int16))
    assert _within_roundings(one, weights, experts, starts, x, f)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["int8", "int4-g32", "int4-g64"]), st.integers(1, 3), st.integers(1, 2),
       st.integers(1, 11), st.integers(0, 2**16))
def test_rows_taken_four_at_a_time_are_each_row_alone_bit_for_bit(fmt, fd, dd, n_rows, seed):
    """A prompt's quantized expert of many rows (four at a time) gives each row the bytes a
    call of that row alone gives. int8 also at shapes off the vector width."""
    group = 32 if fmt == "int8" else int(fmt.removeprefix("int4-g"))
    f, d = group * fd - (3 if fmt == "int8" else 0), group * dd + (5 if fmt == "int8" else 0)
    bf16 = _blobs(2, f, d, seed).float()
    blobs = torch.stack([make_blob(fmt, t[: f * d].view(f, d), t[f * d : 2 * f * d].view(f, d),
                                   t[2 * f * d :].view(d, f)) for t in bf16])
    x = torch.randn(n_rows, d, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    kernel_fmt = {"int8": _cpu_experts.FORMAT_INT8, "int4-g32": _cpu_experts.FORMAT_INT4_G32,
                  "int4-g64": _cpu_experts.FORMAT_INT4_G64}[fmt]
    together = _run(blobs, [1], [0, n_rows], x, f, 2, kernel_fmt)
    alone = torch.cat([_run(blobs, [1], [0, 1], x[r : r + 1], f, 1, kernel_fmt)
                       for r in range(n_rows)])
    assert torch.equal(together.view(torch.int16), alone.view(torch.int16))


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["bf16", "int8", "int4-g32"]), st.integers(1, 70), st.integers(1, 70),
       st.lists(st.integers(0, 6), min_size=1, max_size=3), st.integers(0, 2**16),
       st.integers(1, 3), st.sampled_from(sorted(_cpu_experts.SCHEDULES)),
       st.sampled_from([0, 4096]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]),
       st.sampled_from([16, 32, 64]))
def test_weight_rows_read_at_once_give_the_bytes_of_one_at_a_time(fmt, f, d, counts, seed,
                                                                 threads, schedule,
                                                                 prefetch_bytes, gate_up_rows,
                                                                 down_rows, down_block_rows):
    """Gate's and up's rows read together, of one f or two (`gate_up_rows`), and down's two or
    four adjacent ones at a time (`down_rows`), in pass-2 tasks of 16 to 64 rows
    (`down_block_rows`), give every output the bytes of each row read alone in tasks of 16:
    each row's sums take the same steps in the same order. Blocks of rows and vectors of 32
    elements with tails (F and D drawn freely; int4's a multiple of its group), rows an expert
    up to 6 (a quantized expert's four at a time, then one by one)."""
    if fmt == "int4-g32":
        f, d = 32 * (1 + f % 3), 32 * (1 + d % 2)
    bf16 = _blobs(len(counts), f, d, seed)
    blobs = bf16 if fmt == "bf16" else torch.stack([
        make_blob(fmt, t[: f * d].view(f, d), t[f * d : 2 * f * d].view(f, d),
                  t[2 * f * d :].view(d, f)) for t in bf16.float()])
    kernel_fmt = {"bf16": _cpu_experts.FORMAT_BF16, "int8": _cpu_experts.FORMAT_INT8,
                  "int4-g32": _cpu_experts.FORMAT_INT4_G32}[fmt]
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    x = torch.randn(int(starts[-1]), d, generator=torch.Generator().manual_seed(seed + 1))
    experts = list(range(len(counts)))[::-1]
    alone = _run(blobs, experts, starts, x.bfloat16(), f, threads, kernel_fmt, schedule,
                 prefetch_bytes, 1, 1, 16)
    together = _run(blobs, experts, starts, x.bfloat16(), f, threads, kernel_fmt, schedule,
                    prefetch_bytes, gate_up_rows, down_rows, down_block_rows)
    assert torch.equal(together.view(torch.int16), alone.view(torch.int16))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([32, 64]), st.integers(1, 3), st.integers(1, 2), st.integers(0, 2**16),
       st.integers(2, 4), st.sampled_from([0, 64, 4096]))
def test_int4_blobs_are_their_dequantized_weights_within_bf16_roundings(group, fd, dd, seed,
                                                                      threads, prefetch_bytes):
    # F and D multiples of the group; a few experts and rows, as the bf16 property test.
    f, d = group * fd, group * dd
    rng = np.random.default_rng(seed)
    experts = rng.integers(0, 3, size=rng.integers(0, 4)).tolist()
    starts = np.concatenate(([0], np.cumsum(rng.integers(0, 3, size=len(experts)))))
    x = torch.randn(int(starts[-1]), d, generator=torch.Generator().manual_seed(seed)).bfloat16()
    bf16 = _blobs(3, f, d, seed)
    fmt = {32: _cpu_experts.FORMAT_INT4_G32, 64: _cpu_experts.FORMAT_INT4_G64}[group]
    blobs, weights = [], []
    for typed in bf16.float():
        gate, up, down = typed[: f * d].view(f, d), typed[f * d : 2 * f * d].view(f, d), \
            typed[2 * f * d :].view(d, f)
        blobs.append(int4_blob(gate, up, down, group))
        weights.append(torch.cat([fake_quantize(w, f"int4-g{group}").reshape(-1)
                                  for w in (gate, up, down)]))
    blobs = torch.stack(blobs)
    assert blobs.shape[1] == int4_blob_bytes(f, d, group) == _cpu_experts.blob_bytes(fmt, f, d)
    one = _run(blobs, experts, starts, x, f, 1, fmt)
    assert torch.equal(_run(blobs, experts, starts, x, f, threads, fmt,
                            prefetch_bytes=prefetch_bytes).view(torch.int16),
                       one.view(torch.int16))
    assert _within_roundings(one, torch.stack(weights), experts, starts, x, f)


def test_an_int4_blob_needs_f_and_d_multiples_of_its_group():
    with pytest.raises(ValueError, match=r"groups of 64 needs F and D multiples of 64, got "
                                         r"F = 32, D = 64"):
        _cpu_experts.blob_bytes(_cpu_experts.FORMAT_INT4_G64, 32, 64)
    assert _cpu_experts.blob_bytes(_cpu_experts.FORMAT_INT4_G32, 32, 64) == \
        int4_blob_bytes(32, 64, 32) == 3 * 32 * 64 // 2 + 4 * 3 * 32 * 64 // 32


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 2**16),
       st.sampled_from([1e-6, 1.0, 1e4]))
def test_int8_quantization_is_within_half_a_step_of_every_weight(rows, cols, seed, magnitude):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * magnitude
    w[0] = 0.0  # a row of zeros stays zeros
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (rows,)
    assert q.abs().max() <= INT8_MAX and scale[0] == 0 and (q[0] == 0).all()
    assert (q.abs().amax(dim=1)[1:] == INT8_MAX).all()  # each row's largest weight uses the range
    error = (dequantize_int8(q, scale) - w).abs()
    assert (error <= scale[:, None] * (0.5 + 1e-5) + 1e-30).all()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.sampled_from([32, 64]), st.integers(0, 2**16),
       st.sampled_from([1e-6, 1.0, 1e4]))
def test_int4_quantization_is_within_half_a_step_of_its_group(rows, groups, group, seed,
                                                             magnitude):
    w = torch.randn(rows, groups * group, generator=torch.Generator().manual_seed(seed))
    w *= magnitude
    w[0, :group] = 0.0  # a group of zeros stays zeros
    q, scale = quantize_int4(w, group)
    assert q.dtype == torch.int8 and q.abs().max() <= INT4_MAX and scale.shape == (rows, groups)
    assert scale[0, 0] == 0 and (q[0, :group] == 0).all()
    step = scale.repeat_interleave(group, dim=1)  # [R, C]: each weight's group scale
    assert ((dequantize_int4(q, scale) - w).abs() <= step * (0.5 + 1e-5) + 1e-30).all()
    assert torch.equal(fake_quantize(w, f"int4-g{group}"), dequantize_int4(q, scale))


def test_fake_quantize_knows_its_formats_and_int4_its_groups():
    w = torch.randn(2, 64)
    assert WEIGHT_FORMATS == ("int8", "int4-g32", "int4-g64")
    assert torch.equal(fake_quantize(w, "int8"), dequantize_int8(*quantize_int8(w)))
    with pytest.raises(ValueError, match=r"fmt must be one of \('int8', 'int4-g32', "):
        fake_quantize(w, "int3")
    with pytest.raises(ValueError, match=r"group must be one of \(32, 64\), got 16"):
        quantize_int4(w, 16)
    with pytest.raises(ValueError, match=r"C a multiple of 64"):
        quantize_int4(torch.randn(2, 96), 64)


def test_an_int8_blob_is_its_parts_and_refuses_bad_shapes():
    f, d = 3, 5
    gate, up, down = torch.randn(f, d), torch.randn(f, d), torch.randn(d, f)
    blob = int8_blob(gate, up, down)
    assert blob.dtype == torch.uint8 and blob.shape == (int8_blob_bytes(f, d),)
    for (q, s), w in zip(int8_parts(blob, f, d), (gate, up, down), strict=True):
        expected_q, expected_s = quantize_int8(w)
        assert torch.equal(q, expected_q) and torch.equal(s, expected_s)
    with pytest.raises(ValueError, match=r"gate and up must be \[F, D\] and down \[D, F\]"):
        int8_blob(gate, up, down.T)
    with pytest.raises(ValueError, match=r"an int8 blob of F = 3, D = 5 is uint8 \["):
        int8_parts(blob[:-1], f, d)
    with pytest.raises(ValueError, match=r"weight must be a float matrix \[R, C\]"):
        quantize_int8(torch.ones(3, dtype=torch.int32))


@pytest.mark.parametrize(("change", "message"), [
    (dict(f=7), r"blobs must be \[E, blob_bytes\]"),
    (dict(fmt=9), r"fmt must be FORMAT_BF16 \(0\), FORMAT_INT8 \(1\), FORMAT_INT4_G32 \(2\) "
                  r"or FORMAT_INT4_G64 \(3\), got 9"),
    (dict(out_rows=2), r"x must be \[R, D\] or \[1, D\] and out \[R, D\], got x \[3, 16\] "
                       r"and out \[2, 16\]"),
    (dict(x_rows=2), r"x must be \[R, D\] or \[1, D\] and out \[R, D\], got x \[2, 16\]"),
    (dict(starts=[0, 2, 2]), r"row_starts must be \[M\+1\] = \[3\] from 0 to R = 3"),
    (dict(starts=[0, 1]), r"row_starts must be \[M\+1\] = \[3\]"),
    (dict(starts=[0, 3, 2, 3], experts=[0, 1, 1]), r"row_starts must not decrease"),
    (dict(experts=[0, 2]), r"expert 2 is out of range \[0, 2\)"),
    (dict(experts=[-1, 0]), r"expert -1 is out of range"),
    (dict(threads=0), r"n_threads must be >= 1, got 0"),
    (dict(schedule="auto"), r"schedule must be one of \['dynamic', 'guided', 'static', 'steal'\], "
                            r"got 'auto'"),
    (dict(prefetch_bytes=100), r"prefetch_bytes must be a multiple of 64 \(a cache line\) "
                               r">= 0, got 100"),
    (dict(prefetch_bytes=-64), r"prefetch_bytes must be a multiple of 64"),
    (dict(gate_up_rows=3), r"gate_up_rows and down_rows must be 1, 2 or 4 \(weight rows a pass "
                           r"reads at once\), got 3 and 1"),
    (dict(down_rows=0), r"gate_up_rows and down_rows must be 1, 2 or 4 .*, got 1 and 0"),
    (dict(down_block_rows=24), r"down_block_rows must be a multiple of 16 from 16 to 1024 "
                               r"\(rows of down a task reads\), got 24"),
    (dict(down_block_rows=2048), r"down_block_rows must be a multiple of 16 .*, got 2048"),
])
def test_bad_arguments_are_refused_before_anything_is_written(change, message):
    f, d = 8, 16
    blobs = _blobs(2, f, d, 0)
    x = torch.randn(change.get("x_rows", 3), d).bfloat16()
    out = torch.full((change.get("out_rows", 3), d), 7.0, dtype=torch.bfloat16)
    before = out.clone()
    with pytest.raises(ValueError, match=message):
        _cpu_experts.compute(blobs.view(torch.uint8).numpy(), change.get("fmt", 0),
                             np.asarray(change.get("experts", [0, 1]), dtype=np.int64),
                             np.asarray(change.get("starts", [0, 1, 3]), dtype=np.int64),
                             x.float().numpy(), _u16(out), change.get("f", f),
                             change.get("threads", 2), change.get("schedule", "dynamic"),
                             change.get("prefetch_bytes", 0), change.get("gate_up_rows", 1),
                             change.get("down_rows", 1), change.get("down_block_rows", 16))
    assert torch.equal(out, before)


def test_a_steal_call_of_more_tasks_than_a_share_holds_is_refused():
    """A steal share packs a pass's task numbers in 32 bits: a call of 2**31 tasks or more
    (M * ceil(D / 16) here: 2**20 experts of D = 2**15) is refused by name, and runs under
    another schedule. Rows: none, so that the call costs nothing but its checks."""
    f, d, n_experts = 16, 2**15, 2**20
    blobs = _blobs(1, f, d, 0).view(torch.uint8).numpy()
    args = (blobs, 0, np.zeros(n_experts, dtype=np.int64),
            np.zeros(n_experts + 1, dtype=np.int64), np.zeros((1, d), dtype=np.float32),
            np.zeros((0, d), dtype=np.uint16), f, 2)
    with pytest.raises(ValueError, match=r"a 'steal' call takes fewer than 2\*\*31 tasks a pass "
                                         r"\(M \* ceil\(F / 16\) and M \* ceil\(D / 16\)\), "
                                         r"got M = 1048576, F = 16, D = 32768"):
        _cpu_experts.compute(*args, "steal")
    _cpu_experts.compute(*args, "dynamic")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["bf16", "int8", "int4-g32"]), st.integers(1, 2), st.integers(1, 2),
       st.lists(st.integers(0, 9), min_size=1, max_size=3), st.integers(0, 2**16),
       st.booleans())
def test_one_row_of_x_read_by_every_row_gives_the_bytes_of_its_copies(fmt, fd, dd, counts,
                                                                     seed, on_worker):
    """x [1, D] (a decode call's one token) against the same row copied R times, through
    `compute` and `CpuWorker.start`: the same bytes, on the rows taken one by one and four at a
    time."""
    f, d = 32 * fd, 64 * dd
    n_experts = len(counts)
    blobs = _blobs(n_experts, f, d, seed)
    if fmt != "bf16":
        blobs = torch.stack([make_blob(fmt, t[: f * d].view(f, d), t[f * d : 2 * f * d].view(f, d),
                                       t[2 * f * d :].view(d, f)) for t in blobs.float()])
    code = {"bf16": _cpu_experts.FORMAT_BF16, "int8": _cpu_experts.FORMAT_INT8,
            "int4-g32": _cpu_experts.FORMAT_INT4_G32}[fmt]
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    n_rows = int(starts[-1])
    one = torch.randn(1, d, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    outs = []
    for x in (one.expand(n_rows, d).contiguous(), one):
        out = torch.full((n_rows, d), 7.0, dtype=torch.bfloat16)
        args = (blobs.contiguous().view(torch.uint8).numpy(), code,
                np.arange(n_experts, dtype=np.int64), starts, x.float().numpy(), _u16(out), f, 2)
        if on_worker:
            worker = _cpu_experts.CpuWorker()
            worker.start(*args)
            worker.wait()
        else:
            _cpu_experts.compute(*args)
        outs.append(out)
    assert torch.equal(outs[1].view(torch.int16), outs[0].view(torch.int16))


def test_nan_and_infinity_propagate_as_in_torch():
    f, d = 4, 32
    blobs = _blobs(1, f, d, 0)
    x = torch.randn(2, d).bfloat16()
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    out = _run(blobs, [0], [0, 2], x, f, 2)
    expected = _reference(blobs, [0], [0, 2], x, f)
    assert torch.equal(out.isnan(), expected.isnan())


@settings(max_examples=60, deadline=None)
@given(calls(), st.integers(1, 4), st.sampled_from(sorted(_cpu_experts.SCHEDULES)),
       st.sampled_from([0, 512]), st.sampled_from([(1, 1), (2, 4), (4, 2)]))
def test_a_call_on_the_worker_thread_gives_compute_s_bytes(call, threads, schedule,
                                                           prefetch_bytes, rows_at_once):
    """CpuWorker.start returns at once and the call runs on the worker's thread; after wait,
    out holds compute's bytes (whatever its weight rows at once). One worker serves call after
    call."""
    blobs, experts, starts, x, f = call
    expected = _run(blobs, experts, starts, x, f, threads, schedule=schedule)
    worker = _cpu_experts.CpuWorker()
    for _ in range(2):
        out = torch.full(expected.shape, 7.0, dtype=torch.bfloat16)
        worker.start(blobs.contiguous().view(torch.uint8).numpy(), _cpu_experts.FORMAT_BF16,
                     np.asarray(experts, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                     x.float().numpy(), _u16(out), f, threads, schedule, prefetch_bytes,
                     *rows_at_once)
        worker.wait()
        assert not worker.pending
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_the_worker_takes_one_call_at_a_time_and_checks_each_as_compute_does():
    f, d = 8, 16
    blobs = _blobs(2, f, d, 0).view(torch.uint8).numpy()
    x = torch.randn(3, d).float().numpy()
    out = torch.zeros(3, d, dtype=torch.bfloat16)
    args = (blobs, 0, np.array([0, 1], dtype=np.int64), np.array([0, 1, 3], dtype=np.int64), x,
            _u16(out), f, 2)
    worker = _cpu_experts.CpuWorker()
    with pytest.raises(ValueError, match=r"expert 5 is out of range \[0, 2\)"):
        worker.start(blobs, 0, np.array([0, 5], dtype=np.int64), *args[3:])
    assert not worker.pending  # nothing started
    worker.wait()  # none in flight: returns at once
    assert worker.last_call_us is None  # no call waited for yet
    worker.start(*args)
    with pytest.raises(RuntimeError, match=r"a call is in flight on this CpuWorker: wait\(\)"):
        worker.start(*args)
    worker.wait()
    assert not worker.pending and out.abs().sum() > 0
    # Where the call went: each part a time, the team up within the run.
    hand_over, team_up, pass1, run, noticed = worker.last_call_us
    assert hand_over >= 0 and noticed >= 0 and run > 0
    assert 0 <= team_up <= run and 0 < pass1 <= run  # the last thread up may come after pass 1
    assert worker.last_call_us == (hand_over, team_up, pass1, run, noticed)  # read again
    # A start of no rows posts nothing: no times, rather than the last call's again.
    empty = torch.zeros(0, d, dtype=torch.bfloat16)
    worker.start(blobs, 0, np.array([0], dtype=np.int64), np.array([0, 0], dtype=np.int64),
                 x[:0], _u16(empty), f, 2)
    worker.wait()
    assert worker.last_call_us is None
    worker.start(*args)
    del worker  # in flight: waited for before the thread stops
    assert out.abs().sum() > 0


@pytest.mark.skipif(sys.platform != "linux", reason="threads are named on Linux")
def test_the_worker_and_its_team_carry_the_worker_s_name():
    """The worker's thread names itself, and the OpenMP team it starts takes the name: a
    profiler, and bench/thread_sched.py, tell them from every other thread. The caller's
    name does not change; docs/expert-cache.md names it."""
    assert _cpu_experts.WORKER_NAME == "strata-cpu"

    def named() -> set[str]:
        """The ids of the threads of that name (an earlier test's may still be ending)."""
        tids = set()
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                if (task / "comm").read_text().strip() == _cpu_experts.WORKER_NAME:
                    tids.add(task.name)
        return tids

    f, d = 8, 16
    blobs = _blobs(2, f, d, 0).view(torch.uint8).numpy()
    out = torch.zeros(3, d, dtype=torch.bfloat16)
    caller = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text()
    before = named()
    worker = _cpu_experts.CpuWorker()
    worker.start(blobs, 0, np.array([0, 1], dtype=np.int64), np.array([0, 1, 3], dtype=np.int64),
                 torch.randn(3, d).float().numpy(), _u16(out), f, 3)
    worker.wait()
    assert len(named() - before) >= 3  # the worker and the two threads its team of 3 added
    assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text() == caller
    del worker


@pytest.mark.parametrize("schedule", ["dynamic", "steal"])
def test_a_worker_keeping_its_team_up_gives_compute_s_bytes_and_stops_at_once(schedule):
    """`keep_team_up`: after each call the team spins for the next (up to 2 ms); calls that
    come within the spin, after it, and after the setting is turned off again give compute's
    bytes, under "steal" with the waiter taking part too; a worker dropped while its team
    spins stops."""
    f, d = 16, 64
    blobs = _blobs(4, f, d, 3)
    experts, starts = [2, 0, 3], [0, 1, 3, 4]
    x = torch.randn(4, d, generator=torch.Generator().manual_seed(5)).bfloat16()
    expected = _run(blobs, experts, starts, x, f, 3)
    worker = _cpu_experts.CpuWorker()
    assert not worker.keep_team_up  # off by default
    worker.keep_team_up = True
    for gap_s, on in [(0.0, True), (0.0005, True), (0.005, True), (0.0, False), (0.0, True)]:
        worker.keep_team_up = on
        time.sleep(gap_s)  # within the team's spin, or past it
        out = torch.full(expected.shape, 7.0, dtype=torch.bfloat16)
        worker.start(blobs.view(torch.uint8).numpy(), _cpu_experts.FORMAT_BF16,
                     np.asarray(experts, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                     x.float().numpy(), _u16(out), f, 3, schedule)
        worker.wait()
        assert worker.keep_team_up == on
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    started = time.perf_counter()
    del worker  # its team spinning for a next call: told to stop, it stops (no hang)
    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize("schedule", sorted(_cpu_experts.SCHEDULES))
def test_the_second_pass_reads_every_act_value_the_first_wrote(schedule):
    """Both passes run in one OpenMP region, pass 2 after every pass-1 task is done
    (`_cpu_experts_passes.h`): with more threads than cores, every call gives one thread's
    bytes. Without that wait a thread with no pass-1 task left would read act rows another is
    still writing (this test failed so)."""
    # Few long pass-1 tasks (F / 16 of them, D long each) and many short pass-2 ones: most
    # threads have no pass-1 task and go straight on to pass 2.
    f, d, n_experts = 64, 4096, 1
    blobs = _blobs(n_experts, f, d, 3)
    starts = [0, 2]  # one expert: every pass-2 task reads the act rows pass 1 writes
    # Two inputs in turn: a stale act row left by the other's call gives other bytes.
    xs = [torch.randn(2, d, generator=torch.Generator().manual_seed(seed)).bfloat16()
          for seed in (4, 5)]
    expected = [_run(blobs, range(n_experts), starts, x, f, 1, schedule=schedule) for x in xs]
    for i in range(20):
        got = _run(blobs, range(n_experts), starts, xs[i % 2], f, 8, schedule=schedule)
        assert torch.equal(got.view(torch.int16), expected[i % 2].view(torch.int16))


def test_a_steal_call_s_waiter_takes_its_tasks_and_the_bytes_stay_compute_s():
    """Under "steal", `CpuWorker.wait` runs the call's tasks on the waiting thread as one more
    thread of the team and returns how many it ran; under the others, and without `help`, it
    only waits (0). A call long enough that the waiter arrives while tasks are left: it takes
    some."""
    f, d, n_experts = 256, 1024, 8
    blobs = _blobs(n_experts, f, d, 6)
    starts = list(range(n_experts + 1))
    x = torch.randn(n_experts, d, generator=torch.Generator().manual_seed(7)).bfloat16()
    expected = _run(blobs, range(n_experts), starts, x, f, 1)
    worker = _cpu_experts.CpuWorker()
    for schedule, help in [("steal", True), ("dynamic", True), ("steal", False),
                           ("steal", True)]:
        out = torch.full(expected.shape, 7.0, dtype=torch.bfloat16)
        worker.start(blobs.view(torch.uint8).numpy(), _cpu_experts.FORMAT_BF16,
                     np.arange(n_experts, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                     x.float().numpy(), _u16(out), f, 1, schedule)
        ran = worker.wait(help)
        # Of 8 * (256 + 1024) / 16 = 640 tasks, on a team of one thread besides the waiter.
        assert 0 < ran <= 640 if schedule == "steal" and help else ran == 0
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert worker.wait() == 0  # none in flight


def test_the_second_pass_waits_for_the_pass_1_tasks_a_waiter_took():
    """A steal call's waiter takes pass-1 tasks too (`CpuWorker.wait`); the team's pass 2
    waits for them as for its own: every call gives one thread's bytes."""
    f, d = 64, 4096  # 4 long pass-1 tasks, 256 short pass-2 ones: the waiter takes pass-1's
    blobs = _blobs(1, f, d, 3)
    xs = [torch.randn(2, d, generator=torch.Generator().manual_seed(seed)).bfloat16()
          for seed in (4, 5)]
    expected = [_run(blobs, [0], [0, 2], x, f, 1) for x in xs]
    worker = _cpu_experts.CpuWorker()
    for i in range(20):
        out = torch.full((2, d), 7.0, dtype=torch.bfloat16)
        worker.start(blobs.view(torch.uint8).numpy(), _cpu_experts.FORMAT_BF16,
                     np.zeros(1, dtype=np.int64), np.array([0, 2], dtype=np.int64),
                     xs[i % 2].float().numpy(), _u16(out), f, 8, "steal")
        worker.wait()
        assert torch.equal(out.view(torch.int16), expected[i % 2].view(torch.int16))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.sampled_from(sorted(_cpu_experts.SCHEDULES)), st.integers(0, 300),
       st.integers(0, 300), st.sampled_from([0, 50, 2000, 30000]), st.booleans())
def test_every_task_runs_once_and_pass_2_after_all_of_pass_1(n_threads, schedule, n1, n2,
                                                              spins, helper):
    """The passes' scheduling over tasks that only count (`tally_passes`): each task runs
    exactly once, under every schedule and with the waiting thread taking part ('steal'), and
    no pass-2 task begins before every pass-1 task has finished. (The kernel's bytes cannot
    show a task run twice.) With more threads than cores and tasks that take a while, threads
    are preempted mid-task and steal from each other."""
    helper = helper and schedule == "steal"
    runs1, runs2, seen, helped = _cpu_experts.tally_passes(n_threads, schedule, n1, n2, spins,
                                                           helper)
    assert runs1.tolist() == [1] * n1 and runs2.tolist() == [1] * n2
    assert seen.tolist() == [n1] * n2
    assert 0 <= helped <= n1 + n2 and (helper or helped == 0)


def test_tally_passes_refuses_bad_arguments():
    for args, kwargs in [((0, "steal", 1, 1), {}), ((2, "auto", 1, 1), {}),
                         ((2, "steal", -1, 1), {}), ((2, "steal", 1, 2**31), {}),
                         ((2, "dynamic", 1, 1), {"helper": True})]:
        with pytest.raises(ValueError, match=r"tally_passes takes n_threads >= 1, a schedule"):
            _cpu_experts.tally_passes(*args, **kwargs)
