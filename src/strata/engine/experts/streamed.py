"""The streamed share of a decode call's misses: uploaded over the bus, computed on the device.

Dimension letters: T tokens, K experts per token, D hidden size, F expert width, N staging blobs,
R rows.

With `stream_misses` = N > 0 the cache keeps a staging buffer of N blobs on the device (counted
in the budget's workspace). In a decode call (T == 1) the first N missed experts (by id) are
copied into it from the host store, asynchronously (the store is pinned on CUDA) and in stream
order before their compute, and computed by `strata.engine.experts.grouped.expert_rows` over
the staging slots; the CPU computes the other misses meanwhile (`CpuExperts`), so the bus and
the CPU share the misses. On the H200 an `olmoe-1b-7b` expert uploads in 0.23 ms and computes
on the CPU in about 0.45 ms: N = 4 of 8 took a 4 GiB decode round from 49 to 38 ms
(bench/results/cache-h200-2026-11-29.md).

The device and the CPU round differently, so N is part of what the output bytes depend on.
A call's copies are queued after the previous call's reads of the buffer (one stream), so the
buffer is reused safely without a sync.
"""

from __future__ import annotations

import torch

from strata.engine.experts import ExpertStore
from strata.engine.experts.grouped import expert_rows
from strata.engine.experts.routed import Routed

__all__ = ["StreamedMisses"]


class StreamedMisses:
    """A staging buffer of `n_blobs` blobs of `store` on `device`, and the math over it."""

    def __init__(self, store: ExpertStore, device: torch.device, n_blobs: int) -> None:
        if isinstance(n_blobs, bool) or not isinstance(n_blobs, int) or n_blobs < 1:
            raise ValueError(f"n_blobs must be an int >= 1, got {n_blobs!r}")
        self.store, self.n_blobs = store, n_blobs
        f, d = store.expert_width, store.hidden_size
        self._staging = torch.empty((n_blobs, store.blob_bytes), dtype=torch.uint8,
                                    device=device)  # [N, blob]
        typed = self._staging.view(store.dtype)  # [N, 3*F*D]
        self._gate_up = typed[:, : 2 * f * d].unflatten(1, (2 * f, d))  # [N, 2F, D]
        self._down = typed[:, 2 * f * d : 3 * f * d].unflatten(1, (d, f))  # [N, D, F]
        self._index = torch.arange(n_blobs, device=device)  # [N]: staging slot of each

    @property
    def nbytes(self) -> int:
        return self._staging.numel()

    def split(self, misses: Routed) -> tuple[Routed, Routed | None]:
        """(the rows of the first `n_blobs` missed experts by id, the other misses' or None)."""
        n = min(self.n_blobs, misses.n_experts)
        rest = misses.group(n, misses.n_experts) if n < misses.n_experts else None
        return misses.group(0, n), rest

    def compute(self, layer: int, x: torch.Tensor, streamed: Routed) -> torch.Tensor:
        """[R, D] on the device, rows in `streamed.rows` order: the experts' blobs copied from
        the host store into the staging buffer, then computed over the one token x [1, D]
        (T == 1: one row an expert)."""
        n = streamed.n_experts
        if streamed.n_rows != n or x.shape[0] != 1:
            raise ValueError(f"streamed misses are for one token: {n} experts, "
                             f"{streamed.n_rows} rows, {x.shape[0]} tokens")
        if n > self.n_blobs:
            raise ValueError(f"{n} streamed experts do not fit {self.n_blobs} staging blobs")
        for i, expert in enumerate(streamed.experts.tolist()):
            self._staging[i].copy_(self.store.blob(layer, expert), non_blocking=True)
        return expert_rows(self._gate_up, self._down, self._index[:n], x.expand(n, -1))
