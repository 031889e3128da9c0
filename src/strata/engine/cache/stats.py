"""`CacheStats`: what the expert cache did during one request, by phase (prompt, decode).

A *layer call* is one MoE layer of one forward pass. Lookups count routed (token, k) rows;
`cpu_experts` counts distinct experts computed on the CPU per layer call, `cpu_tokens` the rows
they computed. Times are wall seconds on the engine's thread, summed over the layer calls:
`wait_s` waiting for the device (reading each layer's routing and the misses' inputs to the
host), `device_s` issuing the device's share (hits, the loan), `upload_s` the cache's own
uploads (admissions and refills, which the thread waits for; the loan's batches, which it only
queues unless `STRATA_LOAN_UPLOAD_BATCHES` is 1: `device_s` holds the loan's), `cpu_s`
computing misses on the CPU (while the device runs its share), `forward_s` everything inside
the expert cache. Of the CPU's calls run on its own thread (a decode call's, on CUDA),
`cpu_tasks` counts the kernel's tasks (`CpuExperts.tasks`) and `cpu_waiter_tasks` those the
engine's thread ran while it waited for them (the "steal" schedule's, `CpuExperts.finish`), and
their `cpu_s` splits into `cpu_hand_over_s` (from the start to that thread beginning a call),
`cpu_run_s` (the call's run on its team; of it `cpu_team_up_s`, until the team's last thread
was up, and `cpu_pass1_s`, until its first pass was done: gate and up, two thirds of the bytes)
and `cpu_noticed_s` (from a call's end to the engine's thread seeing it: long where
that thread was still queueing the call's uploads), the rest of it the engine's thread's own
steps in starting and finishing it (`CpuExperts.last_call`).
Rounds replayed from a CUDA graph (every expert resident) count their calls, lookups and hits,
but no times.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PHASES = ("prompt", "decode")


@dataclass
class PhaseStats:
    """Counters of one phase of one request."""

    passes: int = 0
    layer_calls: int = 0
    hits: int = 0
    lookups: int = 0
    cpu_experts: int = 0
    cpu_tokens: int = 0
    cpu_tasks: int = 0
    cpu_waiter_tasks: int = 0
    loan_experts: int = 0
    streamed_experts: int = 0
    uploaded_bytes: int = 0
    admitted: int = 0
    evicted: int = 0
    device_s: float = 0.0
    upload_s: float = 0.0
    cpu_s: float = 0.0
    cpu_hand_over_s: float = 0.0
    cpu_team_up_s: float = 0.0
    cpu_pass1_s: float = 0.0
    cpu_run_s: float = 0.0
    cpu_noticed_s: float = 0.0
    wait_s: float = 0.0
    forward_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def cpu_experts_per_layer(self) -> float:
        return self.cpu_experts / self.layer_calls if self.layer_calls else 0.0

    @property
    def cpu_tokens_per_layer(self) -> float:
        return self.cpu_tokens / self.layer_calls if self.layer_calls else 0.0

    def count_upload(self, n_bytes: int, seconds: float) -> None:
        """One upload of the cache (`CacheExecutor.upload`, `upload_queued`): its bytes and
        the host's seconds (waiting for it, or queueing it)."""
        self.uploaded_bytes += n_bytes
        self.upload_s += seconds

    def add(self, other: PhaseStats) -> PhaseStats:
        """The sum of two phases' counters."""
        return PhaseStats(**{
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in dataclasses.fields(self)
        })

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self)
        out["hit_rate"] = self.hit_rate
        out["cpu_experts_per_layer"] = self.cpu_experts_per_layer
        out["cpu_tokens_per_layer"] = self.cpu_tokens_per_layer
        return out


@dataclass
class CacheStats:
    """One request's figures: the slots, the most slots lent at once, and each phase's counters.

    The totals (`hits`, `hit_rate`, ...) sum both phases.
    """

    slots: int
    policy: str = ""
    lent_slots: int = 0
    prompt: PhaseStats = field(default_factory=PhaseStats)
    decode: PhaseStats = field(default_factory=PhaseStats)

    def phase(self, name: str) -> PhaseStats:
        if name not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {name!r}")
        return self.prompt if name == "prompt" else self.decode

    def note_lent(self, n_slots: int) -> None:
        """Record that `n_slots` slots are lent now; `lent_slots` keeps the most."""
        if n_slots < 0:
            raise ValueError(f"n_slots must be >= 0, got {n_slots}")
        self.lent_slots = max(self.lent_slots, int(n_slots))

    @property
    def total(self) -> PhaseStats:
        return self.prompt.add(self.decode)

    # The totals of both phases, by the names.
    @property
    def hits(self) -> int:
        return self.prompt.hits + self.decode.hits

    @property
    def lookups(self) -> int:
        return self.prompt.lookups + self.decode.lookups

    @property
    def hit_rate(self) -> float:
        return self.total.hit_rate

    @property
    def cpu_experts_per_layer(self) -> float:
        return self.total.cpu_experts_per_layer

    @property
    def cpu_tokens_per_layer(self) -> float:
        return self.total.cpu_tokens_per_layer

    @property
    def uploaded_bytes(self) -> int:
        return self.prompt.uploaded_bytes + self.decode.uploaded_bytes

    @property
    def device_s(self) -> float:
        return self.prompt.device_s + self.decode.device_s

    @property
    def cpu_s(self) -> float:
        return self.prompt.cpu_s + self.decode.cpu_s

    @property
    def wait_s(self) -> float:
        return self.prompt.wait_s + self.decode.wait_s

    def as_dict(self) -> dict[str, Any]:
        """JSON values: the totals flat, then `prompt` and `decode` with the same keys."""
        return {
            "slots": self.slots,
            "policy": self.policy,
            "lent_slots": self.lent_slots,
            **self.total.as_dict(),
            "prompt": self.prompt.as_dict(),
            "decode": self.decode.as_dict(),
        }

    def summary_lines(self) -> list[str]:
        """Lines for the stats block: the cache, then each phase that ran."""
        total = self.total
        lines = [
            f"cache          {self.slots} slots ({self.policy}), hit rate "
            f"{100 * total.hit_rate:.1f}% ({total.hits} of {total.lookups}), uploaded "
            f"{total.uploaded_bytes / (1 << 20):.1f} MiB, lent {self.lent_slots} slots"
        ]
        for name in PHASES:
            p = self.phase(name)
            if not p.layer_calls:
                continue
            unit = "pass" if name == "prompt" else "round"
            units = unit + ("es" if unit == "pass" else "s") if p.passes != 1 else unit
            n = max(p.passes, 1)
            streamed = (f", streamed {p.streamed_experts / p.layer_calls:.2f} experts a layer"
                        if p.streamed_experts else "")
            lines.append(
                f"cache {name:<8} hit rate {100 * p.hit_rate:.1f}%; CPU "
                f"{p.cpu_experts_per_layer:.2f} experts, {p.cpu_tokens_per_layer:.2f} tokens a "
                f"layer{streamed}; a {unit}: device {1000 * p.device_s / n:.2f} ms, CPU "
                f"{1000 * p.cpu_s / n:.2f} ms, waiting {1000 * p.wait_s / n:.2f} ms, in the "
                f"cache {1000 * p.forward_s / n:.2f} ms ({p.passes} {units})"
            )
        return lines


def upload_counter(cache: Any) -> Callable[[int, float], None]:
    """A cache executor's `on_upload` for `cache` (a `CachedExperts`): each upload's bytes and
    seconds counted into `cache.stats` under `cache.phase`, both read at the upload (a request
    makes new stats). It holds the cache weakly: held strongly it would be a cycle (the cache
    holds its executor) that kept a dropped cache, its arena and its store's page-locked pages
    until a collection, wherever that ran. An upload after the cache went (by an elastic K/V
    that still holds the executor) counts nowhere."""
    cache_ref = weakref.ref(cache)

    def count(n_bytes: int, seconds: float) -> None:
        owner = cache_ref()
        if owner is not None:
            owner.stats.phase(owner.phase).count_upload(n_bytes, seconds)

    return count
