"""torch.compile applied to the model from outside: the model code stays plain eager torch.

The decode step (T = 1) is many small kernels; inductor fuses the elementwise work, and with
coordinate-descent tuning it lowers matrix-vector products to reductions, so the routed experts'
weights are read straight from the stacked [E, ...] tensors (the gather fuses into the reduction
as indirect loads) instead of being copied out first. This is gpt-fast's recipe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def compile_decode_step(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` compiled for static shapes (one compilation per decode window), not yet run.

    CUDA graphs are left to the caller (the generate loop captures its own), so the compiled
    function is plain kernels that a graph can capture.
    """
    import torch._inductor.config as inductor_config

    inductor_config.coordinate_descent_tuning = True
    inductor_config.fx_graph_cache = True
    return torch.compile(fn, dynamic=False, fullgraph=False)
