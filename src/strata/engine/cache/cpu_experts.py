"""The miss path: experts computed on the CPU from the host store, on one worker thread.

Dimension letters: U distinct tokens of the misses, D hidden size, F expert width, R rows.

Each distinct missed expert runs once, over all the tokens routed to it, as two matmuls in the
store's dtype (torch releases the GIL and spreads each over its intra-op threads: few large
calls, not many small ones). The work runs on one worker thread so that the engine's thread can
launch the device's share meanwhile. Experts run in ascending order and each output row has
its own place, so the result does not depend on timing.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn.functional as F

from strata.engine.cache.routed import Routed
from strata.engine.experts import ExpertStore

__all__ = ["CpuExperts"]


class CpuExperts:
    """Computes routed rows of experts from `store` on the CPU, on one worker thread.

    `cpu_threads`: intra-op threads for the worker (`torch.set_num_threads` in that thread);
    None keeps torch's setting (its default: the physical cores).
    """

    def __init__(self, store: ExpertStore, cpu_threads: int | None = None) -> None:
        if cpu_threads is not None and (isinstance(cpu_threads, bool) or cpu_threads < 1):
            raise ValueError(f"cpu_threads must be None or an int >= 1, got {cpu_threads!r}")
        self.store = store
        self.cpu_threads = cpu_threads
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="strata-cpu-experts",
            initializer=torch.set_num_threads if cpu_threads else None,
            initargs=(cpu_threads,) if cpu_threads else (),
        )

    def compute(self, layer: int, x_rows: torch.Tensor, routed: Routed) -> torch.Tensor:
        """Outputs [R, D] in the store's dtype, rows in `routed.rows` order.

        x_rows [R, D] on the CPU: the input of each row (its token's hidden state), in the
        same order.
        """
        f = self.store.expert_width
        out = torch.empty((routed.n_rows, self.store.hidden_size), dtype=self.store.dtype)
        x_rows = x_rows.to(self.store.dtype)
        for i, expert in enumerate(routed.experts.tolist()):
            lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
            _, _, down = self.store.weights(layer, expert)  # [D, F]
            h = F.linear(x_rows[lo:hi], self._gate_up(layer, expert))  # [n, 2F]
            act = F.silu(h[:, :f]) * h[:, f:]  # [n, F]
            out[lo:hi] = F.linear(act, down)  # [n, D]
        return out

    def _gate_up(self, layer: int, expert: int) -> torch.Tensor:
        """[2F, D]: gate then up, adjacent in the blob, as one matrix (no copy)."""
        f, d = self.store.expert_width, self.store.hidden_size
        return self.store.blob(layer, expert).view(self.store.dtype)[: 2 * f * d].view(2 * f, d)

    def submit(
        self, layer: int, x_rows: torch.Tensor, routed: Routed
    ) -> Future[tuple[torch.Tensor, float]]:
        """`compute` on the worker thread; the future gives (outputs [R, D], CPU seconds)."""

        def work() -> tuple[torch.Tensor, float]:
            start = time.perf_counter()
            out = self.compute(layer, x_rows, routed)
            return out, time.perf_counter() - start

        return self._pool.submit(work)

    def close(self) -> None:
        """Stop the worker thread (after its current work). Idempotent."""
        self._pool.shutdown(wait=True)
