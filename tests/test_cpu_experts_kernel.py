"""strata._cpu_experts against a plain torch reference with the same roundings (hypothesis).

The kernel adds its sums in another order than torch's matmul, so it is compared within a
bound, and bit for bit with itself across thread counts (each output value is one thread's, in
one fixed order). Shapes are small and unaligned (D and F not multiples of the kernel's 32-wide
vectors or its 16-row blocks), so the tails are exercised.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from strata import _cpu_experts


def _u16(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.int16).numpy().view(np.uint16)


def _blobs(n_experts: int, f: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n_experts, 3 * f * d, generator=gen) * d**-0.5).bfloat16()


def _run(blobs, experts, starts, x, f, threads):
    out = torch.full((x.shape[0], x.shape[1]), 7.0, dtype=torch.bfloat16)
    _cpu_experts.experts_bf16(_u16(blobs), np.asarray(experts, dtype=np.int64),
                              np.asarray(starts, dtype=np.int64), x.float().numpy(), _u16(out),
                              f, threads)
    return out


def _reference(blobs, experts, starts, x, f):
    """The torch bf16 path's roundings over fp32 sums: h, silu(g) and the product in bf16."""
    d = x.shape[1]
    out = []
    for i, expert in enumerate(experts):
        typed = blobs[expert].float()
        gate_up, down = typed[: 2 * f * d].view(2 * f, d), typed[2 * f * d :].view(d, f)
        h = (x[starts[i] : starts[i + 1]].float() @ gate_up.T).bfloat16()
        act = F.silu(h[:, :f]) * h[:, f:]  # bf16, as torch's
        out.append((act.float() @ down.T).bfloat16())
    return torch.cat(out) if out else torch.empty(0, d, dtype=torch.bfloat16)


@st.composite
def calls(draw):
    d, f = draw(st.integers(1, 80)), draw(st.integers(1, 40))
    n_experts = draw(st.integers(1, 5))
    experts = draw(st.lists(st.integers(0, n_experts - 1), min_size=0, max_size=4))
    counts = draw(st.lists(st.integers(0, 3), min_size=len(experts), max_size=len(experts)))
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(int(starts[-1]), d, generator=torch.Generator().manual_seed(seed + 1))
    return _blobs(n_experts, f, d, seed), experts, starts, x.bfloat16(), f


@settings(max_examples=150, deadline=None)
@given(calls(), st.integers(2, 5))
def test_the_kernel_is_the_reference_within_bf16_roundings_at_any_thread_count(call, threads):
    blobs, experts, starts, x, f = call
    one = _run(blobs, experts, starts, x, f, 1)
    assert torch.equal(_run(blobs, experts, starts, x, f, threads).view(torch.int16),
                       one.view(torch.int16))
    expected = _reference(blobs, experts, starts, x, f)
    # A rounding of h to bf16 may fall the other way than the reference's: a few bf16 ulps of
    # the row's scale, where a wrong row, offset or tail would be off by the whole value.
    scale = expected.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-3)
    assert ((one.float() - expected.float()).abs() <= scale * 2**-5).all()


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


@pytest.mark.parametrize(("change", "message"), [
    (dict(f=7), r"blobs must be \[E, 3\*F\*D\]"),
    (dict(out_rows=2), r"out must be \[R, D\] = \[3, 16\]"),
    (dict(starts=[0, 2, 2]), r"row_starts must be \[M\+1\] = \[3\] from 0 to R = 3"),
    (dict(starts=[0, 1]), r"row_starts must be \[M\+1\] = \[3\]"),
    (dict(starts=[0, 3, 2, 3], experts=[0, 1, 1]), r"row_starts must not decrease"),
    (dict(experts=[0, 2]), r"expert 2 is out of range \[0, 2\)"),
    (dict(experts=[-1, 0]), r"expert -1 is out of range"),
    (dict(threads=0), r"n_threads must be >= 1, got 0"),
])
def test_bad_arguments_are_refused_before_anything_is_written(change, message):
    f, d = 8, 16
    blobs = _blobs(2, f, d, 0)
    x = torch.randn(3, d).bfloat16()
    out = torch.full((change.get("out_rows", 3), d), 7.0, dtype=torch.bfloat16)
    before = out.clone()
    with pytest.raises(ValueError, match=message):
        _cpu_experts.experts_bf16(_u16(blobs), np.asarray(change.get("experts", [0, 1]),
                                                          dtype=np.int64),
                                  np.asarray(change.get("starts", [0, 1, 3]), dtype=np.int64),
                                  x.float().numpy(), _u16(out), change.get("f", f),
                                  change.get("threads", 2))
    assert torch.equal(out, before)


def test_nan_and_infinity_propagate_as_in_torch():
    f, d = 4, 32
    blobs = _blobs(1, f, d, 0)
    x = torch.randn(2, d).bfloat16()
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    out = _run(blobs, [0], [0, 2], x, f, 2)
    expected = _reference(blobs, [0], [0, 2], x, f)
    assert torch.equal(out.isnan(), expected.isnan())
