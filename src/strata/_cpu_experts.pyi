"""The CPU miss path's kernel: bf16 experts read in place from the host store, on all cores.

Each output value is computed by one thread in one fixed order (the result does not depend on
the thread count); the roundings to bf16 are where torch's bf16 matmul path has them.
"""

import numpy as np

def experts_bf16(
    blobs: np.ndarray,
    experts: np.ndarray,
    row_starts: np.ndarray,
    x: np.ndarray,
    out: np.ndarray,
    expert_width: int,
    n_threads: int,
) -> None:
    """Compute `experts` of one layer over their rows, into `out`.

    Args:
        blobs: uint16 [E, 3*F*D], C-contiguous: the layer's blobs (gate [F, D] | up [F, D] |
            down [D, F]) as bf16 bits, the store's bytes, not a copy.
        experts: int64 [M]: the blob row of each expert of the call.
        row_starts: int64 [M+1] from 0 to R, not decreasing: expert i owns rows
            [row_starts[i], row_starts[i+1]) of `x` and `out`.
        x: float32 [R, D]: each row's input.
        out: uint16 [R, D]: each row's output as bf16 bits (written, not read).
        expert_width: F.
        n_threads: the OpenMP threads of both passes, >= 1.

    Raises:
        ValueError: shapes that disagree, an expert out of range, bad row_starts or
            n_threads < 1, before anything is written.
    """
