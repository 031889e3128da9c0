"""Replaying a trace through a policy against the books (`strata._residency`) alone.

Legend: N tokens, L layers, K experts per token, E experts per layer, S steps.

The cache starts as the engine's does: `slots` slots, the top `loan_slots` of them the loan
region, filled hottest first from a profile. Then, request by request: the simulated K/V grows
or trims (`strata.sim.kv_sim`, with `--kv-grow`), and every step runs layer by layer as the engine
runs it, through the same `CheckedPolicy` and apply functions:

    slots, hit = table.lookup(layer, ids)       # ids [T, K]: hits and misses
    table.record(layer, ids)                    # the books' heat
    policy.observe(view, layer, ids, hit)
    placements = checked.admit(layer, misses)   # distinct missed experts, ascending
    apply_admit(table, placements)

That is the `generic` path, for any policy: the sequence runs in C over a span of steps
(`strata._residency.drive_policy_span`), calling the policy's `observe` and `admit` once per
layer step; `strata.sim.reference` is the same sequence in plain Python, which the tests hold
every path to. Two faster paths give the same counts:
- `kernel`, for a policy whose class declares a simulator kernel (`Policy.replay_kernel`: the
  built-ins `lru`, `lfu` and `sieve` do, and an outside plugin may): its rule in a Cython loop
  (`strata.sim.kernel_path`) on the state the policy hands out and takes back, so that the K/V
  events between spans still ask the policy object itself; and for a plugin's compiled rule
  (`strata.policies.RulePolicy`), whose cdef methods the C step loop calls directly
  (`strata._residency.drive_rule_span`);
- `batched`, for a policy that overrides neither `observe` nor `admit` (`static`,
  `coldest-in-loan`): nothing it decides changes residency between two K/V events, so a span of
  steps is one `lookup`, one `record` and one `observe` per layer.
tests/sim prove both fast paths equal to the generic path, step for step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from strata._residency import ResidencyTable, drive_policy_span, drive_rule_span
from strata.books import CheckedPolicy, apply_refill
from strata.books.apply import Listener
from strata.books.checked import POLICY_FAULTS
from strata.formats.trace import Trace
from strata.policies import Policy, compiled_rule
from strata.sim import _kernels
from strata.sim.kernel_path import declared_kernel, kernel_span
from strata.sim.kv_sim import KvConfig, KvSim
from strata.sim.result import ReplayResult

PATH_CHOICES = ("auto", "generic")
# Steps per kernel or batched span when no K/V event splits the trace: bounds the progress
# bar's jumps, not the result.
SPAN_STEPS = 4096


@dataclass(frozen=True)
class ReplayConfig:
    """The cache a replay simulates.

    `slots` is the arena's size; its top `loan_slots` are the loan region (never admitted into,
    never given up). `kv` simulates the elastic K/V; without it the cache size is fixed.
    `path="generic"` forces the generic path.
    """

    slots: int
    loan_slots: int = 0
    kv: KvConfig | None = None
    path: str = "auto"

    def __post_init__(self) -> None:
        for name in ("slots", "loan_slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.loan_slots > self.slots:
            raise ValueError(f"loan_slots {self.loan_slots} exceeds slots {self.slots}")
        if self.path not in PATH_CHOICES:
            raise ValueError(f"path must be one of {', '.join(PATH_CHOICES)}, got {self.path!r}")


def new_books(trace: Trace, config: ReplayConfig, profile: np.ndarray | None) -> ResidencyTable:
    """The books before the fill: regions set, and (given a profile, counts [L, E]) ranked by
    it. ValueError for a profile of another shape."""
    kv = config.kv
    table = ResidencyTable(trace.n_layers, trace.n_experts, config.slots,
                           kv.slot_bytes if kv else 1, kv.chunk_bytes if kv else 1)
    table.set_regions(top=config.slots - config.loan_slots)
    if profile is not None:
        profile = np.asarray(profile)
        if profile.shape != (trace.n_layers, trace.n_experts):
            raise ValueError(f"the profile is {profile.shape}; the trace needs "
                             f"[L, E] = [{trace.n_layers}, {trace.n_experts}]")
        table.set_rank_from_counts(profile)
    return table


def fill_books(table: ResidencyTable, listener: Listener | None = None) -> None:
    """Fill slots [0, n) with the n = min(S, L*E) hottest experts by rank, as the engine's
    start does, telling `listener` (`entered`, `fill`)."""
    n_fill = min(table.n_slots, table.n_layers * table.n_experts)
    hottest = np.argsort(table.rank.reshape(-1))[:n_fill].astype(np.int32)
    placements = np.column_stack([np.arange(n_fill, dtype=np.int32),
                                  hottest // table.n_experts, hottest % table.n_experts])
    apply_refill(table, placements, listener, why="fill")


def start_books(trace: Trace, config: ReplayConfig, profile: np.ndarray | None) -> ResidencyTable:
    """The books at start: regions set, and (given a profile, counts [L, E]) ranked by it and
    filled hottest first from slot 0 up."""
    table = new_books(trace, config, profile)
    if profile is not None:
        fill_books(table)
    return table


def choose_path(policy: Policy, requested: str = "auto") -> str:
    """`kernel`, `batched` or `generic`: the fastest path that runs `policy` exactly.

    `kernel` for a policy whose own class declares `replay_kernel` (and listens to no
    notification: the kernels catch the books up by difference) or whose `observe` and
    `admit` are a compiled rule (`compiled_rule`); PolicyError for a kernel the simulator does
    not have.
    """
    if requested == "generic":
        return "generic"
    name = policy.name or type(policy).__name__
    cls = type(policy)
    if declared_kernel(policy, name) is not None and not cls.listens():
        return "kernel"
    if compiled_rule(policy) is not None:
        return "kernel"
    if cls.observe is Policy.observe and cls.admit is Policy.admit:
        return "batched"
    return "generic"


def policy_label(policy: Policy) -> tuple[str, dict[str, Any]]:
    """(label, options): the name, with the options that differ from the defaults."""
    options = dataclasses.asdict(policy.options)
    defaults = dataclasses.asdict(type(policy.options)())
    changed = [f"{k}={v}" for k, v in options.items() if v != defaults.get(k)]
    name = policy.name or type(policy).__name__
    return (f"{name}({','.join(changed)})" if changed else name), options


class Replay:
    """One replay: the books (`table`), the policy asked through `checked`, the simulated K/V
    (`kv`, or None) and the counts so far (`result`). `run` plays the trace once.

    `policy` must be a fresh instance: it keeps state. Raises ValueError for a bad profile or
    a budget below the start's.
    """

    def __init__(self, trace: Trace, policy: Policy, config: ReplayConfig,
                 profile: np.ndarray | None = None) -> None:
        path = choose_path(policy, config.path)
        self.trace = trace
        self.table = new_books(trace, config, profile)
        self.checked = CheckedPolicy(policy, self.table)
        if profile is not None:
            fill_books(self.table, self.checked)
        self.kv = KvSim(config.kv, self.checked) if config.kv else None
        label, options = policy_label(policy)
        self.result = ReplayResult.empty(trace, policy=label, name=policy.name or label,
                                         options=options, path=path, slots=config.slots)
        self.ids_by_layer = np.ascontiguousarray(trace.expert_ids.transpose(1, 0, 2))  # [L,N,K]
        self.path = path
        self.rule = compiled_rule(policy) if path == "kernel" else None
        self.kernel = declared_kernel(policy, self.checked.name) \
            if path == "kernel" and self.rule is None else None
        self._done = False

    def run(self, progress: Callable[[int], None] | None = None) -> ReplayResult:
        """Play the whole trace; `progress(n)` is told as steps are done. Raises ValueError
        for a request past `max_context` and `PolicyError` for a bad decision."""
        if self._done:
            raise ValueError("this replay has run; make a new Replay (with a fresh policy)")
        self._done = True
        trace = self.trace
        requests = trace.request_offsets
        if self.kv is None:
            spans = list(pairwise([*range(0, trace.n_steps, SPAN_STEPS), trace.n_steps]))
        else:
            spans = list(pairwise(requests.tolist()))
        need = dict(zip(requests[:-1].tolist(), trace.request_tokens.tolist(), strict=True))
        for s0, s1 in spans:
            if self.kv is not None:
                self.kv.request(int(need[s0]), s0, self.result)
            self.run_span(s0, s1)
            if progress is not None:
                progress(s1 - s0)
        return self.result

    def run_span(self, s0: int, s1: int) -> None:
        if self.path == "generic":
            self._generic_span(s0, s1)
        elif self.path == "batched":
            self._batched_span(s0, s1)
        elif self.rule is not None:
            self._rule_span(s0, s1)
        else:
            self._kernel_span(s0, s1)

    def _outs(self, s0: int, s1: int) -> tuple[np.ndarray, ...]:
        """The counts the C step loops write, for steps [s0, s1): per step and layer, hits,
        distinct hits, distinct misses and admissions; per layer, admissions and evictions."""
        steps = self.result.steps
        self._admits = np.zeros((s1 - s0, self.trace.n_layers), np.int32)
        return (steps.hits[s0:s1], steps.distinct_hits[s0:s1], steps.distinct_misses[s0:s1],
                self._admits, self.result.layer_admissions, self.result.layer_evictions)

    # --- generic: the engine's sequence, step by step, in C around the policy's Python ---
    def _generic_span(self, s0: int, s1: int) -> None:
        checked = self.checked
        drive_policy_span(checked.policy, checked, checked.view, self.ids_by_layer,
                          self.trace.step_offsets, s0, s1, checked.observes,
                          bool(checked.listening), *self._outs(s0, s1))
        self.result.steps.uploads[s0:s1] += self._admits.sum(axis=1, dtype=np.int32)

    # --- kernel, a compiled rule: its cdef methods called from the C step loop ---
    def _rule_span(self, s0: int, s1: int) -> None:
        checked = self.checked

        def reject(layer: int, missed: np.ndarray, answer: np.ndarray) -> None:
            checked.admit_slow(layer, missed, answer)  # raises the PolicyError

        try:
            drive_rule_span(self.rule, checked.view, self.ids_by_layer, self.trace.step_offsets,
                            s0, s1, *self._outs(s0, s1), reject)
        except POLICY_FAULTS as exc:
            err = checked.fault("rule", exc)
            if err is exc:
                raise
            raise err from exc
        self.result.steps.uploads[s0:s1] += self._admits.sum(axis=1, dtype=np.int32)

    # --- batched: residency is fixed between K/V events ---
    def _batched_span(self, s0: int, s1: int) -> None:
        offsets = self.trace.step_offsets
        t0, t1 = offsets[s0], offsets[s1]
        starts = (offsets[s0:s1 + 1] - t0) * self.trace.top_k
        table, checked, steps = self.table, self.checked, self.result.steps
        scratch = np.empty(s1 - s0, np.int32)
        for layer in range(self.trace.n_layers):
            ids = self.ids_by_layer[layer, t0:t1]
            _, hit = table.lookup(layer, ids)
            table.record(layer, ids)
            checked.observe(checked.view, layer, ids, hit)
            _kernels.block_stats(ids.reshape(-1), hit.view(np.uint8).reshape(-1), starts,
                                 self.trace.n_experts, steps.hits[s0:s1, layer],
                                 steps.distinct_hits[s0:s1, layer],
                                 steps.distinct_misses[s0:s1, layer], scratch)

    # --- kernel: the policy's declared rule in Cython, on the state it hands out ---
    def _kernel_span(self, s0: int, s1: int) -> None:
        table, trace = self.table, self.trace
        res, owner, heat = table.res.copy(), table.owner.copy(), table.heat.copy()
        steps = self.result.steps
        admits = np.zeros((s1 - s0, trace.n_layers), np.int32)
        books = (res, owner, heat, table.rank, table.backed.view(np.uint8), table.top)
        outs = (steps.hits[s0:s1], steps.distinct_hits[s0:s1], steps.distinct_misses[s0:s1],
                admits, self.result.layer_admissions, self.result.layer_evictions)
        span = (trace.expert_ids, trace.step_offsets, s0, s1)
        kernel_span(self.checked, self.kernel, span, books, outs,
                    (trace.n_layers, trace.n_experts))
        steps.uploads[s0:s1] += admits.sum(axis=1, dtype=np.int32)
        # The books catch up: residency by difference, heat by recording the span's routing.
        changed = np.flatnonzero(owner != table.owner).astype(np.int32)
        leaving = changed[table.owner[changed] >= 0]
        if leaving.size:
            table.evict_many(leaving)
        arriving = changed[owner[changed] >= 0]
        if arriving.size:
            flat = owner[arriving]
            table.assign_many(arriving, flat // trace.n_experts, flat % trace.n_experts)
        t0, t1 = trace.step_offsets[s0], trace.step_offsets[s1]
        for layer in range(trace.n_layers):
            table.record(layer, self.ids_by_layer[layer, t0:t1])


def replay(
    trace: Trace,
    policy: Policy,
    config: ReplayConfig,
    profile: np.ndarray | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay `trace` through `policy` (a fresh instance) on the cache `config` describes,
    starting from `profile` (counts [L, E]; None: an empty cache). See `Replay`."""
    return Replay(trace, policy, config, profile).run(progress)
