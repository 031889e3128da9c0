"""`DeviceHeat`: routing counted on the device, folded into the books' heat later.

On the device-only decode path (every expert resident, nothing read on the host) each layer
call adds its routed ids to a device counter instead of the books' heat; `flush` folds the
counter into the books (one host read) before anything reads the heat: at the next call that
goes through the host, at a phase change, at the end of a request, when the loan opens, and
before the elastic K/V asks the policy.
"""

from __future__ import annotations

import numpy as np
import torch

from strata._residency import ResidencyTable

__all__ = ["DeviceHeat"]


class DeviceHeat:
    """A device counter of routed ids, flat [L*E], for the books `table`."""

    def __init__(self, table: ResidencyTable, device: torch.device) -> None:
        self.table = table
        self.n_layers, self.n_experts = table.n_layers, table.n_experts
        self._counts = torch.zeros(self.n_layers * self.n_experts, dtype=torch.int64,
                                   device=device)  # [L*E]
        self._pending = False

    def count(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Add one call's routed ids [T, K] of `layer` (on the device, no sync)."""
        flat = topk_ids.reshape(-1) + layer * self.n_experts  # [T*K] flat expert ids
        self._counts.index_add_(0, flat, torch.ones_like(flat))
        self._pending = True

    def mark_pending(self) -> None:
        """Counts were added outside `count` (a replayed CUDA graph that captured it)."""
        self._pending = True

    def discard(self) -> None:
        """Drop the counts not yet folded (a capture's warm-ups), in stream order."""
        self._counts.zero_()
        self._pending = False

    def flush(self) -> None:
        """Fold the counts into the books' heat (one host read) and zero them."""
        if not self._pending:
            return
        # A copy: on the CPU `.cpu()` is the counter itself, which is zeroed next.
        counts = self._counts.to("cpu", copy=True).numpy().reshape(self.n_layers,
                                                                    self.n_experts)
        self._counts.zero_()
        self._pending = False
        experts = np.arange(self.n_experts, dtype=np.int64)
        for layer in np.flatnonzero(counts.sum(axis=1)).tolist():
            self.table.record(layer, np.repeat(experts, counts[layer]))
