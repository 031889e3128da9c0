"""The cost model: a replay's counts as an estimated time per decode round, hence tok/s.

Per step (one forward pass), with B the bytes of one expert:

    time = dense_bytes / device
         + sum over layers of max(distinct hits * B / device, distinct misses * B / host)
         + uploads * B / pcie

The device computes the hits from VRAM while the CPU computes each missed expert once, reading
it from host RAM; the two overlap, so a layer takes the longer of them. Uploads (admissions and
refills) cross PCIe and are counted as not overlapped, which makes the estimate conservative
for an engine that overlaps them. Batch-one decode is bound by memory bandwidth, so FLOPs are
left out. Bandwidths are in GB/s (1e9 bytes per second), as the user gives them or as the
engine measured them (a JSON file with `device_gbps`, `host_gbps`, `pcie_gbps`).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from strata.formats.jsonfile import read_json
from strata.formats.trace import DECODE, PROMPT
from strata.sim.result import ReplayResult

GB = 1e9
BANDWIDTH_KEYS = ("device_gbps", "host_gbps", "pcie_gbps")


@dataclass(frozen=True)
class Bandwidths:
    """Device memory, host memory (read by the CPU) and PCIe (host to device), in GB/s."""

    device_gbps: float
    host_gbps: float
    pcie_gbps: float

    def __post_init__(self) -> None:
        for name in BANDWIDTH_KEYS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0 (GB/s), got {value!r}")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Bandwidths:
        """Read `{"device_gbps": .., "host_gbps": .., "pcie_gbps": ..}` (other keys ignored)."""
        try:
            data = read_json(path, what="bandwidths", error=ValueError)
        except ValueError as exc:
            raise ValueError(f"cannot read bandwidths from {os.fspath(path)}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{os.fspath(path)}: want a JSON object with {BANDWIDTH_KEYS}")
        missing = [key for key in BANDWIDTH_KEYS if key not in data]
        if missing:
            raise ValueError(f"{os.fspath(path)}: the keys {missing} are missing; want "
                             f"{', '.join(BANDWIDTH_KEYS)} in GB/s")
        return cls(**{key: data[key] for key in BANDWIDTH_KEYS})


@dataclass(frozen=True)
class CostModel:
    """Bandwidths, the bytes of one expert, and the dense bytes every round reads."""

    bandwidths: Bandwidths
    expert_bytes: int
    dense_bytes: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.expert_bytes, bool) or not isinstance(self.expert_bytes, int) \
                or self.expert_bytes < 1:
            raise ValueError(f"expert_bytes must be an int >= 1, got {self.expert_bytes!r}")
        if isinstance(self.dense_bytes, bool) or not isinstance(self.dense_bytes, int) \
                or self.dense_bytes < 0:
            raise ValueError(f"dense_bytes must be an int >= 0, got {self.dense_bytes!r}")

    def step_seconds(self, result: ReplayResult) -> np.ndarray:
        """float64 [S]: the estimated time of each step."""
        bw = self.bandwidths
        device_s = self.expert_bytes / (bw.device_gbps * GB)
        host_s = self.expert_bytes / (bw.host_gbps * GB)
        upload_s = self.expert_bytes / (bw.pcie_gbps * GB)
        steps = result.steps
        layers = np.maximum(steps.distinct_hits * device_s, steps.distinct_misses * host_s)
        return (self.dense_bytes / (bw.device_gbps * GB) + layers.sum(axis=1)
                + steps.uploads * upload_s)

    def estimate(self, result: ReplayResult, step_tokens: np.ndarray) -> dict[str, Any]:
        """Decode: ms per round and tok/s; prompt: tok/s (None where the trace has no such
        steps). `step_tokens` int [S] are the tokens of each step."""
        seconds = self.step_seconds(result)
        out: dict[str, Any] = {}
        decode = result.step_phase == DECODE
        prompt = result.step_phase == PROMPT
        out["decode_round_ms"] = float(seconds[decode].mean() * 1e3) if decode.any() else None
        for name, mask in (("decode_tok_s", decode), ("prompt_tok_s", prompt)):
            total = float(seconds[mask].sum())
            out[name] = float(step_tokens[mask].sum() / total) if mask.any() and total else None
        return out

    def describe(self) -> dict[str, Any]:
        return {**asdict(self.bandwidths), "expert_bytes": self.expert_bytes,
                "dense_bytes": self.dense_bytes}
