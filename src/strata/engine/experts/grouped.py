"""The decode path's experts: a few routed experts computed straight from stacked weights.

Legend: S experts in the stack (a layer's experts, or the cache's slots), R routed rows,
D hidden size, F expert width.

A decode step (one token) runs its K routed experts over one input row each. `expert_rows`
computes them from `gate_up` [S, 2F, D] and `down` [S, D, F], per-expert views into one buffer
(the layer's blobs of `ResidentExperts`, the arena's slots of the expert cache), picked by an
index tensor on the device, so no host read and static shapes: capture-safe.

Two implementations, one chosen by where the tensors are, never by routed data:
- CUDA with Triton: two kernels that read each routed expert's weights in place (no copy):
  `_gate_up_act` computes act = silu(x·gate) * (x·up) for a block of F rows of one expert,
  `_down` y = down·act for a block of D rows. Each output element is one program's fp32 sum
  in a fixed order, so results are deterministic. Every expert's weights are read once, the
  least any version can move: K blobs a layer (96 MiB for `olmoe-1b-7b`).
  `expert_sum_triton` adds the weighted sum of one token's rows to `_down`: the last program
  of each block of D to finish (counted with an atomic) sums the block's K rows in order, as
  `strata.engine.experts.combine` would, so it gives the same bytes with one kernel less.
- elsewhere (the CPU, or no Triton): `index_select` the R experts' weights (a copy, counted in
  the workspace: `copies_weights`) and two batched matmuls.
Under `torch.compile` (`strata.engine.runtime.compile`) the same kernels run as one custom
operator, `strata::expert_rows` (`torch.library.triton_op`): inductor compiles the step around
them instead of breaking its graph at a plain kernel launch.

The two round differently (the kernels round the gate and up sums to the model's dtype like a
matmul's output, but sum in another order), so a device's choice is part of what its output
bytes depend on; every user of one device takes the same path, which keeps the cache holding
every expert byte-identical to `ResidentExperts`.
"""

from __future__ import annotations

import functools

import torch

from strata.engine import cache_hints, dependent_launch
from strata.engine.experts.activation import silu_and_mul

__all__ = ["copies_weights", "expert_rows", "expert_rows_gathered", "expert_rows_triton",
           "expert_sum_triton", "sum_arrivals"]

# Rows of one expert each program reduces, the width of a step along the reduced axis, and
# the warps of a gate_up and of a down program. Measured on the H200 at the olmoe-1b-7b and
# qwen3-30b-a3b shapes (bench/grouped_experts.py): the fastest of the 32 tried for both.
GATE_UP_BLOCK_F, GATE_UP_BLOCK_D = 32, 128
DOWN_BLOCK_D, DOWN_BLOCK_F = 32, 128
NUM_WARPS = (8, 8)
# The software pipeline's depth of a gate_up and of a down program (Triton's num_stages: how
# many steps' loads are in flight ahead of the math). Triton's own default on CUDA.
NUM_STAGES = (3, 3)


@functools.cache
def _kernels():
    """The Triton kernels module (`strata.engine.experts._grouped_triton`), or None without
    Triton."""
    try:
        from strata.engine.experts import _grouped_triton
    except ImportError:
        return None
    return _grouped_triton


def copies_weights(device: torch.device) -> bool:
    """Whether `expert_rows` on `device` copies the routed experts' weights (the gathered
    path), which the workspace must hold: everywhere but CUDA with Triton."""
    return torch.device(device).type != "cuda" or _kernels() is None


def expert_rows(
    gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor, x_rows: torch.Tensor
) -> torch.Tensor:
    """[R, D] in x_rows' dtype: row r is expert index[r] applied to x_rows[r], i.e.
    down[e] @ (silu(g) * u) with [g; u] = gate_up[e] @ x_rows[r], e = index[r].

    gate_up [S, 2F, D] and down [S, D, F]: per-expert views, rows contiguous, any stride from
    one expert to the next; index [R] int64 on their device; x_rows [R, D]. The Triton kernels
    on CUDA when Triton is there, the gathered path elsewhere (see the module)."""
    if torch.compiler.is_compiling():  # first: what torch.compile traces reads no module cache
        if x_rows.is_cuda and _compiled["expert_rows"] is not None:
            return _compiled["expert_rows"](gate_up, down, index, x_rows)
    elif x_rows.is_cuda and _kernels() is not None:
        return expert_rows_triton(gate_up, down, index, x_rows)
    return expert_rows_gathered(gate_up, down, index, x_rows)


# The custom operator, once `define_compiled_op` made it (None: torch.compile traces the
# gathered path). Not made at import: defining one imports inductor (about a second).
_compiled = {"expert_rows": None}


def define_compiled_op() -> None:
    """Make `expert_rows_triton` the custom operator `strata::expert_rows`, which
    `torch.compile` then traces as its two kernels; before compiling (it cannot be made while
    tracing). Idempotent; nothing without Triton."""
    if _compiled["expert_rows"] is not None or _kernels() is None:
        return

    @torch.library.triton_op("strata::expert_rows", mutates_args=())
    def compiled_expert_rows(gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor,
                             x_rows: torch.Tensor) -> torch.Tensor:
        return expert_rows_triton(gate_up, down, index, x_rows,
                                  launch=torch.library.wrap_triton)

    _compiled["expert_rows"] = compiled_expert_rows


def expert_rows_gathered(
    gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor, x_rows: torch.Tensor
) -> torch.Tensor:
    """`expert_rows` by copying the R experts' weights out (`index_select`) and two batched
    matmuls."""
    h = torch.bmm(gate_up.index_select(0, index), x_rows.unsqueeze(-1)).squeeze(-1)  # [R, 2F]
    act = silu_and_mul(h)  # [R, F]
    return torch.bmm(down.index_select(0, index), act.unsqueeze(-1)).squeeze(-1)  # [R, D]


def expert_rows_triton(
    gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor, x_rows: torch.Tensor,
    *, gate_up_blocks: tuple[int, int] = (GATE_UP_BLOCK_F, GATE_UP_BLOCK_D),
    down_blocks: tuple[int, int] = (DOWN_BLOCK_D, DOWN_BLOCK_F),
    num_warps: tuple[int, int] = NUM_WARPS, num_stages: tuple[int, int] = NUM_STAGES,
    launch=None,
) -> torch.Tensor:
    """`expert_rows` with the Triton kernels, reading the weights in place. Runs wherever
    Triton does (its interpreter on the CPU, with TRITON_INTERPRET=1 set before import, is
    how the tests check it without a GPU). `gate_up_blocks` (F rows, D step) and
    `down_blocks` (D rows, F step) are the kernels' block sizes, powers of two, and
    `num_warps` and `num_stages` their programs' warps and pipeline depths (the benchmarks
    try others). `launch` wraps each
    kernel before its launch (`torch.library.wrap_triton` under the custom operator; None:
    launched as they are, as dependents where `dependent_launch` has them).
    RuntimeError without Triton."""
    kernels = _kernels()
    (gate_up_f, gate_up_d), (down_d, down_f) = gate_up_blocks, down_blocks
    if kernels is None:
        raise RuntimeError("expert_rows_triton needs Triton (pip install triton)")
    d, f = x_rows.shape[1], down.shape[2]
    launch, options = dependent_launch.launch_with(launch, x_rows.device)
    act, y = _gate_up_act(kernels, gate_up, down, index, x_rows, gate_up_f, gate_up_d,
                          num_warps[0], num_stages[0], launch, options)
    if x_rows.shape[0]:
        launch(kernels.down)[(x_rows.shape[0], -(-d // down_d))](
            down, index, act, y, down.stride(0), down.stride(1), d, f, act.stride(0),
            y.stride(0), BLOCK_D=down_d, BLOCK_F=down_f,
            EVICT=cache_hints.experts_eviction(), num_warps=num_warps[1],
            num_stages=num_stages[1], **options)
    return y


def _gate_up_act(kernels, gate_up, down, index, x_rows, block_f, block_d, num_warps,
                 num_stages, launch, options):
    """(act [R, F], y [R, D] unwritten): `gate_up_act`'s kernel launched over x_rows [R, D]
    with `options` (`dependent_launch.kernel_options`); ValueError for weights that are not
    [S, 2F, D] and [S, D, F] with contiguous rows."""
    n_rows, d = x_rows.shape
    f = down.shape[2]
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("expert_rows_triton needs each expert's rows contiguous")
    if gate_up.shape[1:] != (2 * f, d) or down.shape[1:] != (d, f):
        raise ValueError(f"gate_up {list(gate_up.shape)} and down {list(down.shape)} are not "
                         f"[S, 2F, D] and [S, D, F] for D = {d}, F = {f}")
    if x_rows.stride(1) != 1:  # any stride between rows: 0 repeats one token's row
        x_rows = x_rows.contiguous()
    act = x_rows.new_empty((n_rows, f))  # [R, F]
    y = x_rows.new_empty((n_rows, d))  # [R, D]
    if n_rows:
        launch(kernels.gate_up_act)[(n_rows, -(-f // block_f))](
            gate_up, index, x_rows, act, gate_up.stride(0), gate_up.stride(1), d, f,
            x_rows.stride(0), act.stride(0), BLOCK_F=block_f, BLOCK_D=block_d,
            EVICT=cache_hints.experts_eviction(),
            num_warps=num_warps, num_stages=num_stages, **options)
    return act, y


def sum_arrivals(hidden_size: int, device: torch.device) -> torch.Tensor:
    """The counter `expert_sum_triton` needs for rows of `hidden_size`: int32 zeros, one per
    block of DOWN_BLOCK_D; each launch leaves it zero. Its owner makes it outside any CUDA
    graph's capture and uses it on one stream."""
    return torch.zeros(-(-hidden_size // DOWN_BLOCK_D), dtype=torch.int32, device=device)


def expert_sum_triton(gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor,
                      x_rows: torch.Tensor, weights: torch.Tensor,
                      arrived: torch.Tensor) -> torch.Tensor:
    """[1, D]: `weighted_sum(expert_rows_triton(gate_up, down, index, x_rows), weights)` for
    one token's R rows (x_rows [R, D], weights [1, R] float32), with the sum made by the last
    `down` program of each block of D (`_grouped_triton.down_sum`): one kernel less, the same
    bytes. `arrived`: a `sum_arrivals` counter for D."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("expert_sum_triton needs Triton (pip install triton)")
    n_rows, d = x_rows.shape
    f = down.shape[2]
    if weights.shape != (1, n_rows) or weights.dtype != torch.float32 or \
            not weights.is_contiguous():
        raise ValueError(f"weights must be float32 [1, {n_rows}] contiguous, got "
                         f"{weights.dtype} {list(weights.shape)}")
    if arrived.numel() < -(-d // DOWN_BLOCK_D):
        raise ValueError(f"arrived holds {arrived.numel()} blocks, D = {d} needs "
                         f"{-(-d // DOWN_BLOCK_D)} (sum_arrivals)")
    launch, options = dependent_launch.launch_with(None, x_rows.device)
    act, y = _gate_up_act(kernels, gate_up, down, index, x_rows, GATE_UP_BLOCK_F,
                          GATE_UP_BLOCK_D, NUM_WARPS[0], NUM_STAGES[0], launch, options)
    out = x_rows.new_empty((1, d))  # [1, D]
    if n_rows:
        kernels.down_sum[(n_rows, -(-d // DOWN_BLOCK_D))](
            down, index, act, y, weights, out, arrived, down.stride(0), down.stride(1), d, f,
            act.stride(0), y.stride(0), n_rows, BLOCK_D=DOWN_BLOCK_D, BLOCK_F=DOWN_BLOCK_F,
            BLOCK_R=1 << max(n_rows - 1, 0).bit_length(),  # the least power of two >= R
            EVICT=cache_hints.experts_eviction(),
            num_warps=NUM_WARPS[1], num_stages=NUM_STAGES[1], **options)
    else:
        out.zero_()
    return out
