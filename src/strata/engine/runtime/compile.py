"""torch.compile applied to the model from outside: the model code stays plain eager torch.

The decode step (T = 1) is many small kernels; inductor fuses the elementwise work, and with
coordinate-descent tuning it lowers the dense matrix-vector products to reductions; the routed
experts run the plain step's Triton kernels, made custom operators it compiles around
(`strata.engine.experts.grouped.define_compiled_op`). This is gpt-fast's recipe.

What inductor compiles is kept on disk (its FX graph cache, the autotuned configurations and
the Triton kernels) under `strata.settings.cache_dir()`/inductor, unless
TORCHINDUCTOR_CACHE_DIR names another place: the first run on a machine compiles, later runs of
the same model and window load the kernels back (bench/results/ records both times).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from strata.settings import cache_dir


def compile_decode_step(fn: Callable[..., torch.Tensor],
                        backend: str | Callable[..., Any] = "inductor",
                        ) -> Callable[..., torch.Tensor]:
    """`fn` (`MoEModel.forward_at`) compiled by `backend`, not yet run.

    Two compilations at most, however many windows a run reaches: the first window's, with
    every shape static; then, at the second window, one in which the window (`n_ctx`, the
    only argument that changes) is a dynamic size (torch's automatic dynamic shapes), which
    every later window reuses. A compilation per window would cost each new 256-cell window
    its tens of seconds, and pass dynamo's recompile limit after eight.

    CUDA graphs are left to the caller (the generate loop captures its own), so the compiled
    function is plain kernels that a graph can capture.
    """
    # Inductor fixes its directory the first time it is asked for it, which importing its
    # config can do: set before.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    import torch._inductor.config as inductor_config

    inductor_config.coordinate_descent_tuning = True
    inductor_config.fx_graph_cache = True
    from strata.engine.experts import grouped, quantized

    # The experts' kernels as custom operators: the compiled step calls them as the plain
    # one does, reading each routed expert in place.
    grouped.define_compiled_op()
    quantized.define_compiled_op()
    return torch.compile(fn, backend=backend, dynamic=None, fullgraph=False)
