"""What the kernel launches of `ops` and `routing_ops` share: the Triton kernel module, loaded
where Triton is, a launch's block size, and the warps of a program that norms a row."""

from __future__ import annotations

import functools

__all__ = ["NORM_WARPS", "block", "kernels"]

# The warps of an `add_rms_norm` program. `add_norm_router_route`'s programs run as many: the
# layout of a row, and so the order its squares are summed in, follows the warps, and with
# the same order the two kernels' norms are the same bytes (`_ops_triton._rstd`).
NORM_WARPS = 8


@functools.cache
def kernels():
    """The Triton kernel module (`_ops_triton`), or None without Triton."""
    try:
        from strata.engine.model import _ops_triton
    except ImportError:
        return None
    return _ops_triton


def block(n: int) -> int:
    """The least power of two >= n: a kernel's block over n values."""
    return 1 << max(n - 1, 0).bit_length()
