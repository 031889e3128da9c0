"""The miss path: experts computed on the CPU from the host store, on the engine's thread.

Dimension letters: U distinct tokens of the misses, D hidden size, F expert width, R rows.

Each distinct missed expert runs once, over all the tokens routed to it, as two matmuls in the
store's dtype (torch spreads each over its intra-op threads: few large calls, not many small
ones). Experts run in ascending order and each output row has its own place, so the result does
not depend on timing.

The calls run on the thread that makes them: the cache issues the device's share first (kernels
run asynchronously), then computes the misses here, so the two overlap without a second thread.
A worker thread was measured to cost 1.7-2.8x per expert on the 16-core GPU machine
(bench/cpu_experts.py, `worker`): its intra-op team and the calling thread's contend for the
same cores. The thread count is part of what the output bytes depend on (a matmul's split of its
sums), so it is fixed for a run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.engine.experts import ExpertStore
from strata.engine.experts.routed import Routed

__all__ = ["CpuExperts"]


class CpuExperts:
    """Computes routed rows of experts from `store` on the CPU, on the calling thread.

    `cpu_threads`: the intra-op threads of these calls (set around each, the caller's count
    restored after); None: torch's count (by default the physical cores).
    """

    def __init__(self, store: ExpertStore, cpu_threads: int | None = None) -> None:
        if cpu_threads is not None and (isinstance(cpu_threads, bool) or cpu_threads < 1):
            raise ValueError(f"cpu_threads must be None or an int >= 1, got {cpu_threads!r}")
        self.store = store
        self.cpu_threads = cpu_threads
        # Per layer, views into the store's blobs (no copy), made once: gate and up as one
        # matrix [E, 2F, D] (adjacent in a blob), down [E, D, F].
        f, d = store.expert_width, store.hidden_size
        self._gate_up: list[torch.Tensor] = []
        self._down: list[torch.Tensor] = []
        for layer in range(store.n_layers):
            typed = store.layer_blobs(layer).view(store.dtype)  # [E, 3*F*D]
            self._gate_up.append(typed[:, : 2 * f * d].unflatten(1, (2 * f, d)))
            self._down.append(typed[:, 2 * f * d : 3 * f * d].unflatten(1, (d, f)))

    def compute(self, layer: int, x_rows: torch.Tensor, routed: Routed) -> torch.Tensor:
        """Outputs [R, D] in the store's dtype, rows in `routed.rows` order.

        x_rows [R, D] on the CPU: the input of each row (its token's hidden state), in the
        same order.
        """
        caller_threads = torch.get_num_threads()
        if self.cpu_threads is not None and self.cpu_threads != caller_threads:
            torch.set_num_threads(self.cpu_threads)
        try:
            return self._compute(layer, x_rows, routed)
        finally:
            if torch.get_num_threads() != caller_threads:
                torch.set_num_threads(caller_threads)

    def _compute(self, layer: int, x_rows: torch.Tensor, routed: Routed) -> torch.Tensor:
        f = self.store.expert_width
        out = torch.empty((routed.n_rows, self.store.hidden_size), dtype=self.store.dtype)
        x_rows = x_rows.to(self.store.dtype)
        gate_up, down = self._gate_up[layer], self._down[layer]  # [E, 2F, D], [E, D, F]
        starts = routed.starts.tolist()
        for i, expert in enumerate(routed.experts.tolist()):
            lo, hi = starts[i], starts[i + 1]
            h = F.linear(x_rows[lo:hi], gate_up[expert])  # [n, 2F]
            act = F.silu(h[:, :f]) * h[:, f:]  # [n, F]
            out[lo:hi] = F.linear(act, down[expert])  # [n, D]
        return out
