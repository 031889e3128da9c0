"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling.

Seeded and deterministic: the one random number a step needs is drawn from a torch.Generator on
the CPU, whatever device the logits are on, so the CPU and the GPU draw the same numbers and pick
the same token for the same probabilities. A step picks by inverse CDF over the candidates
sorted by probability (descending): the first whose cumulative probability passes u * total.
"""

from __future__ import annotations

import math

import torch


class Sampler:
    """Picks one token per step. `temperature` 0 means greedy (argmax, lowest id on ties); the
    draws then consume no random numbers. `top_k` 0 and `top_p` 1 switch those filters off."""

    def __init__(
        self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0
    ) -> None:
        if not (isinstance(temperature, int | float) and math.isfinite(temperature)) or (
            temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not (isinstance(top_p, int | float) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {top_k!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = top_k
        self.seed = seed
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sample(self, logits: torch.Tensor) -> int:
        """The next token id from logits [V] (any float dtype, any device): `pick` with this
        step's `draw`, read on the host."""
        return int(self.pick(logits, self.draw()).item())

    def draw(self) -> float | None:
        """This step's random number in [0, 1) (None when greedy: no draw). Drawn first, once
        per step, so the stream of draws never depends on the logits: a caller may draw a
        step's number before its logits exist."""
        if self.greedy:
            return None
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def pick(self, logits: torch.Tensor, u: float | None) -> torch.Tensor:
        """The next token id from logits [V] and the step's draw `u` (`draw`), as a [1] int64
        tensor on the logits' device: nothing is read on the host, so a decode loop can feed it
        to the next round before it knows its value."""
        if logits.dim() != 1 or logits.shape[0] < 1:
            raise ValueError(f"logits must be 1-D and non-empty, got shape {list(logits.shape)}")
        if self.greedy:
            return torch.argmax(logits).reshape(1)  # [1]
        scaled = logits.float() / self.temperature  # [V]
        if 0 < self.top_k < scaled.shape[0]:
            values, ids = torch.topk(scaled, self.top_k)  # [k], sorted, descending
        else:
            values, ids = torch.sort(scaled, descending=True, stable=True)  # [V]
        probs = torch.softmax(values, dim=0)  # [C] candidates, descending
        cumulative = torch.cumsum(probs, dim=0)  # [C]
        if self.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (always the first candidate).
            keep = (cumulative - probs) < self.top_p  # [C]
            probs = probs * keep
            cumulative = torch.cumsum(probs, dim=0)
        threshold = cumulative[-1:] * u  # [1]
        index = torch.searchsorted(cumulative, threshold, right=True)  # [1]
        index = index.clamp(max=probs.shape[0] - 1)
        return ids[index]  # [1]
