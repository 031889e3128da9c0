"""`Trace`: a checked routing trace in memory, its figures and counts.

Legend as in `strata.formats.trace`: N tokens, L layers, K experts per token, E experts per
layer, S steps, R requests. `strata.formats.trace` re-exports everything here, with the file
format (`save_trace`, `load_trace`) and `TraceWriter`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strata.formats.trace_check import (
    DECODE,
    PROMPT,
    check_expert_ids,
    check_meta,
    check_n_experts,
    check_offsets,
    check_router_weights,
    check_step_phase,
    int64_offsets,
)

FORMAT = "strata-routing-trace"
VERSION = 1
PHASES = {"prompt": PROMPT, "decode": DECODE}


@dataclass(frozen=True, eq=False)
class Trace:
    """A checked routing trace; its arrays are read-only.

    Attributes:
        n_experts: E, routed experts per layer.
        expert_ids: int32 [N, L, K], the experts each token was routed to at each layer,
            distinct within a token's K.
        step_offsets: int64 [S + 1], token ranges of the steps.
        step_phase: uint8 [S], PROMPT (0) or DECODE (1).
        request_offsets: int64 [R + 1], step ranges of the requests; in each request the
            prompt steps come before the decode steps.
        router_weights: float32 [N, L, K] (finite, >= 0) or None.
        meta: JSON-ready dict: where the trace came from (a synthetic spec, a model), and the
            model's geometry if known (`slot_bytes`, `kv_segment_cell_bytes`, `kv_segments`).

    Raises:
        TraceError: any array of the wrong dtype, shape or range, with what is wrong.
    """

    n_experts: int
    expert_ids: np.ndarray
    step_offsets: np.ndarray
    step_phase: np.ndarray
    request_offsets: np.ndarray
    router_weights: np.ndarray | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n_experts = check_n_experts(self.n_experts)
        ids = check_expert_ids(self.expert_ids, n_experts)
        step_offsets = int64_offsets("step_offsets", self.step_offsets)
        request_offsets = int64_offsets("request_offsets", self.request_offsets)
        check_offsets("step_offsets", step_offsets, ids.shape[0], "tokens")
        check_offsets("request_offsets", request_offsets, step_offsets.size - 1, "steps")
        fields = {
            "n_experts": n_experts,
            "expert_ids": ids,
            "step_offsets": step_offsets,
            "request_offsets": request_offsets,
            "step_phase": check_step_phase(self.step_phase, request_offsets),
            "router_weights": check_router_weights(self.router_weights, ids.shape),
            "meta": check_meta(self.meta),
        }
        for name, value in fields.items():  # frozen: the checked values replace the given
            object.__setattr__(self, name, value)

    # --- shape ---
    @property
    def n_layers(self) -> int:
        return int(self.expert_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[2])

    @property
    def n_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def n_steps(self) -> int:
        return int(self.step_offsets.size - 1)

    @property
    def n_requests(self) -> int:
        return int(self.request_offsets.size - 1)

    @property
    def n_accesses(self) -> int:
        """Routed (token, layer, expert) lookups: N * L * K."""
        return int(self.expert_ids.size)

    @property
    def step_tokens(self) -> np.ndarray:
        """int64 [S]: tokens per step."""
        return np.diff(self.step_offsets)

    @property
    def request_tokens(self) -> np.ndarray:
        """int64 [R]: tokens per request (prompt + decoded): the K/V cells it reaches."""
        return self.step_offsets[self.request_offsets[1:]] - self.step_offsets[
            self.request_offsets[:-1]
        ]

    def routing_counts(self) -> np.ndarray:
        """int64 [L, E]: how often each expert was routed to, over the whole trace."""
        flat = self.expert_ids + (np.arange(self.n_layers, dtype=np.int32) * self.n_experts)[
            None, :, None
        ]
        counts = np.bincount(flat.reshape(-1), minlength=self.n_layers * self.n_experts)
        return counts.reshape(self.n_layers, self.n_experts)

    def summary(self) -> dict[str, Any]:
        """The trace's figures, JSON-ready."""
        phase = self.step_phase
        tokens = self.step_tokens
        return {
            "format": FORMAT,
            "version": VERSION,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "requests": self.n_requests,
            "steps": self.n_steps,
            "prompt_tokens": int(tokens[phase == PROMPT].sum()),
            "decode_tokens": int(tokens[phase == DECODE].sum()),
            "accesses": self.n_accesses,
            "router_weights": self.router_weights is not None,
            "meta": dict(self.meta),
        }
