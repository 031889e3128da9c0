"""The prompt loan: a long prompt borrows the top slots and streams its missing experts through
them, computed on the device, instead of sending them to the CPU.

Dimension letters: T tokens, D hidden size, E experts per layer, S slots, M missed experts of
one layer, R their routed (token, k) rows, N lent slots.

Why: a prompt chunk of hundreds of tokens routes to most experts of every layer, each over many
tokens. Uploading a missing expert once and running it on the device beats running it on the
CPU over all those tokens; a decode token (one token, K experts) is the other way round.

The cycle, driven by `CachedExperts` through its `loan` hooks:
1. `begin_pass`: a prompt pass of more than `short_read` tokens opens the loan (once per prompt)
   if none is open: N = min(floor(max_fraction * S), S - keep_slots, E, S - floor) slots at the
   top of the arena (E: a layer never needs more; the floor stays below). Their residents leave
   the books (they are the coldest of the fill, since the fill goes hottest first from slot 0),
   `top` drops to the first lent slot, so that no admission lands in a lent slot, and the
   device mirror is re-uploaded before any kernel reads it. While the loan is open every long
   prompt pass sends its misses here; a short pass (<= `short_read` tokens) still goes to the CPU.
2. `compute_misses`: per layer, the missed experts uploaded into the lent slots and computed from
   them on the device, in batches (`upload_plan`): with M <= N misses, `upload_batches` batches
   in distinct slots, all queued on the copy stream at once, each computed as soon as it is
   there while the next ones upload; with more, batches alternating between the two halves of
   the lent slots, a batch's upload waiting for the compute of the batch before it in the same
   slots; quantized slots take more batches where one would hold more experts than a
   dequantization batch (`BlobStack.batch_blobs`). The host waits for none of it: the compute
   stream waits for each batch's upload (an event), and the copy stream for the kernels that
   last read the slots. The layer call queues the first batch's blobs as soon as it knows
   which experts it misses (`queue_first`), before it groups the rows: the copy engine idles
   from the routing's read until then. Every batch's index (rows, slots, runs) then goes up
   in one copy, behind the first batch only: a small copy behind all the blobs would wait for
   all of them in the copy engine, and every compute with it. Then the other batches' blobs
   (`queue_misses`), the layer's hits, and the batches' computes (`compute_queued`). With
   `upload_batches` 1, each batch (all M, or N at a time) is uploaded complete, the host
   waiting, and then computed: the path before the pipelining, kept to measure against.
3. `end_prompt` (the phase turns to decode, or the request ends): the policy's `refill` fills the
   lent slots (checked; default: the hottest missing experts), their blobs are uploaded, the books
   take them, `top` is restored and the mirror re-uploaded.

The books never name a lent slot while the loan is open (checked at every layer: nothing else
may fill one, e.g. the elastic K/V must not grow mid-prompt), and the loan computes exactly the
`Experts` math (the same SwiGLU per expert), so its rows differ from the CPU's only by rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from strata.books import CheckedPolicy
from strata.engine.cache.arena import record_event, wait_for
from strata.engine.cache.defaults import (
    DEFAULT_KEEP_SLOTS,
    DEFAULT_MAX_FRACTION,
    DEFAULT_SHORT_READ,
    DEFAULT_UPLOAD_BATCHES,
)
from strata.engine.cache.executor import CacheExecutor
from strata.engine.cache.from_slots import SlotsIndex, compute_from_slots
from strata.engine.experts.routed import Routed

__all__ = [
    "DEFAULT_KEEP_SLOTS",
    "DEFAULT_MAX_FRACTION",
    "DEFAULT_UPLOAD_BATCHES",
    "KEEP_SLOTS_ENV",
    "MIN_BATCH_EXPERTS",
    "LoanLayer",
    "LoanOptions",
    "PromptLoan",
    "loan_slots",
    "upload_plan",
]

KEEP_SLOTS_ENV = "STRATA_LOAN_KEEP_SLOTS"  # overrides DEFAULT_KEEP_SLOTS (tiny test caches: 0)
# A pipelined batch holds at least this many experts (all of them, when fewer are missed): a
# grouped product over a handful of experts would cost more in launches than it overlaps.
MIN_BATCH_EXPERTS = 8


def _keep_slots_from_env() -> int:
    """`STRATA_LOAN_KEEP_SLOTS`, read and checked by `strata.settings` (SettingError, a
    ValueError, for a bad value), else DEFAULT_KEEP_SLOTS."""
    from strata import settings

    keep = settings.read().loan_keep_slots
    return DEFAULT_KEEP_SLOTS if keep is None else keep


def _upload_batches_from_env() -> int:
    """`STRATA_LOAN_UPLOAD_BATCHES`, read and checked by `strata.settings`, else
    DEFAULT_UPLOAD_BATCHES."""
    from strata import settings

    batches = settings.read().loan_upload_batches
    return DEFAULT_UPLOAD_BATCHES if batches is None else batches


def upload_plan(n_experts: int, n_slots: int, batches: int) -> list[tuple[int, int, int]]:
    """How a layer's M = `n_experts` misses go through N = `n_slots` lent slots: (b0, b1,
    first) for each batch in order, the experts [b0, b1) (in the misses' order) uploaded into
    lent slots [first, first + b1 - b0).

    M <= N: up to `batches` batches of about equal size, at least MIN_BATCH_EXPERTS each, in
    distinct slots (expert i in slot i). M > N: batches of N // 2 alternating between the two
    halves of the slots, or of N (every batch in the same slots) for `batches` 1 or N 1.
    ValueError for M > 0 with N < 1, or `batches` < 1."""
    if batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    if n_experts == 0:
        return []
    if n_slots < 1:
        raise ValueError(f"{n_experts} experts need a lent slot, there are none")
    if n_experts <= n_slots:
        size = max(-(-n_experts // batches), min(n_experts, MIN_BATCH_EXPERTS))
        return [(b0, min(n_experts, b0 + size), b0) for b0 in range(0, n_experts, size)]
    size = n_slots // 2 if batches > 1 and n_slots > 1 else n_slots
    return [(b0, min(n_experts, b0 + size), (i % (n_slots // size)) * size)
            for i, b0 in enumerate(range(0, n_experts, size))]


def _reuses(plan: list[tuple[int, int, int]], b: int) -> int:
    """The last batch before b whose slots overlap batch b's (-1: none): its compute must be
    done before batch b's upload overwrites them."""
    b0, b1, first = plan[b]
    for earlier in range(b - 1, -1, -1):
        e0, e1, other = plan[earlier]
        if first < other + (e1 - e0) and other < first + (b1 - b0):
            return earlier
    return -1


def loan_slots(
    n_slots: int, n_experts: int, keep_slots: int, max_fraction: float, floor: int = 0
) -> int:
    """N, the slots a loan takes: min(floor(max_fraction * S), S - keep_slots, E, S - floor),
    and 0 when that is below 1."""
    n = min(math.floor(max_fraction * n_slots), n_slots - keep_slots, n_experts, n_slots - floor)
    return max(0, n)


@dataclass(frozen=True)
class LoanOptions:
    """How the prompt loan lends: prompt passes longer than `short_read` tokens borrow;
    `keep_slots` is the fewest slots left to the cache during a loan (None: the environment's
    `STRATA_LOAN_KEEP_SLOTS`, else 128); `max_fraction` the most of the arena lent (0.85);
    `upload_batches` the batches a layer's misses upload in, each computed while the next
    upload (`upload_plan`; None: `STRATA_LOAN_UPLOAD_BATCHES`, else 4). ValueError for a bad
    option."""

    short_read: int = DEFAULT_SHORT_READ
    keep_slots: int | None = None
    max_fraction: float = DEFAULT_MAX_FRACTION
    upload_batches: int | None = None

    def __post_init__(self) -> None:
        if self.keep_slots is None:
            object.__setattr__(self, "keep_slots", _keep_slots_from_env())
        if self.upload_batches is None:
            object.__setattr__(self, "upload_batches", _upload_batches_from_env())
        for name, low in (("short_read", 1), ("keep_slots", 0), ("upload_batches", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not 0.0 <= self.max_fraction <= 1.0:
            raise ValueError(f"max_fraction must be in [0, 1], got {self.max_fraction!r}")

    def lends(self, n_slots: int, n_experts: int, floor: int = 0) -> int:
        """N, the slots a loan of a cache of `n_slots` takes (`loan_slots`)."""
        return loan_slots(n_slots, n_experts, self.keep_slots, self.max_fraction, floor)


@dataclass
class LoanLayer:
    """One layer's misses from `PromptLoan.queue_first` to `compute_queued`: its input x
    [T, D], the missed `experts` [M] (ascending), the `plan` (`upload_plan`) and each batch's
    `reuses` (`_reuses`), each expert's lent slot `slots` [M], `start` (what the first
    uploads wait for), the events so far: each batch's upload (`loaded`) and compute
    (`computed`); and, once `queue_misses` has them, the `misses`' rows and their `index` on
    the device."""

    layer: int
    x: torch.Tensor
    experts: np.ndarray
    plan: list[tuple[int, int, int]]
    reuses: list[int]
    slots: np.ndarray
    start: torch.cuda.Event | None
    loaded: list[torch.cuda.Event | None] = field(default_factory=list)
    computed: list[torch.cuda.Event | None] = field(default_factory=list)
    misses: Routed | None = None
    index: SlotsIndex | None = None


class PromptLoan:
    """Lends the top slots of the cache whose decisions `executor` carries out to prompt
    passes longer than `options.short_read` tokens; `policy` (bound to the same books) decides
    the refill. Built by `CachedExperts`, which calls the hooks below."""

    def __init__(self, executor: CacheExecutor, policy: CheckedPolicy,
                 options: LoanOptions) -> None:
        if policy.table is not executor.table:
            raise ValueError("the policy is bound to other books than the executor's")
        self.executor, self.policy, self.options = executor, policy, options
        self.table = executor.table
        self.lent = np.empty(0, np.int32)  # [N] ascending: the slots lent now (empty: none)
        self._top_before = -1
        self.loans = 0  # loans opened so far
        self.streamed_experts = 0  # experts uploaded into lent slots and computed there
        # The event after the last kernel queued to read a lent slot: the loan's previous
        # compute (nothing else reads a lent slot while the loan is open). None: no such
        # compute yet in this loan.
        self._last_read: torch.cuda.Event | None = None

    @property
    def active(self) -> bool:
        return self.lent.size > 0

    def top(self) -> int:
        """The first slot of the loan region: the open loan's `top`, else the first slot a loan
        would lend now (the elastic K/V gives up only below it, so a loan always finds its
        slots)."""
        table = self.table
        if self.active:
            return table.top
        n = self.options.lends(table.n_slots, table.n_experts, table.floor)
        return min(table.top, table.n_slots - n)

    # --- the hooks CachedExperts calls ---
    def begin_pass(self, n_tokens: int, phase: str) -> bool:
        """Before layer 0 of a pass: True when this pass's misses come here."""
        if phase != "prompt" or n_tokens <= self.options.short_read:
            return False
        if not self.active:
            self._lend()
        return self.active

    def compute_misses(self, layer: int, x: torch.Tensor, misses: Routed) -> torch.Tensor:
        """[R, D] on the device, rows in `misses.rows` order: the missed experts streamed
        through the lent slots in the batches of `upload_plan` (step 2 of the module's
        docstring). On CUDA the rows are queued, not computed, when it returns. The same as
        `compute_queued(queue_misses(...))`, which a caller splits to queue other work (the
        layer's hits) between the uploads and the computes."""
        return self.compute_queued(self.queue_misses(layer, x, misses))

    def queue_first(self, layer: int, x: torch.Tensor, experts: np.ndarray) -> LoanLayer:
        """Step 2's start, as soon as the routing is read: plan `layer`'s missed `experts`
        [M] (ascending, distinct, M >= 1) through the lent slots and queue the first batch's
        upload. Needs only which experts are missed, not their rows, so the copy engine starts
        while the host groups them. Returns what `queue_misses` takes on; nothing else may use
        the loan in between."""
        self._check_open()
        return self._queue_first(layer, x, experts)

    def _queue_first(self, layer: int, x: torch.Tensor, experts: np.ndarray) -> LoanLayer:
        """`queue_first` once the loan is checked open."""
        experts = np.asarray(experts, dtype=np.int64).reshape(-1)
        batches = self.options.upload_batches
        if batches > 1 and self.executor.arena.quant is not None:
            # No batch larger than one dequantization batch: each is computed in one set of
            # launches (a batch of 25 where 21 fit would take two).
            batches = max(batches, -(-experts.size // self.executor.arena.stack.batch_blobs()))
        plan = upload_plan(experts.size, self.lent.size, batches)
        # The first uploads wait for the last kernel that read the lent slots: the previous
        # layer's loan compute, not this layer's hits queued since (the copies overlap them);
        # on a loan's first call, everything queued so far.
        start = self._last_read if self._last_read is not None else record_event(x.device)
        slots = np.empty(experts.size, dtype=np.int64)  # [M]: each expert's lent slot
        for b0, b1, first in plan:
            slots[b0:b1] = self.lent[first:first + b1 - b0]
        job = LoanLayer(layer, x, experts, plan,
                        [_reuses(plan, b) for b in range(len(plan))], slots, start)
        self._queue_uploads(job, 0, limit=1)
        return job

    def queue_misses(self, layer: int, x: torch.Tensor, misses: Routed,
                     job: LoanLayer | None = None) -> LoanLayer:
        """Step 2's first half: `job` (from `queue_first` for `misses.experts`; None: made
        here) given the `misses`' rows: every batch's index uploaded in one copy, then every
        upload queued that waits for no compute of this layer (all of them when the misses
        fit the lent slots, else the first batches). Returns what `compute_queued` takes;
        nothing else may use the loan in between. ValueError for a `job` of other experts."""
        self._check_open()
        if job is None:
            job = self._queue_first(layer, x, misses.experts)
        elif job.misses is not None:
            raise ValueError(f"layer {job.layer}'s loaned misses were given their rows "
                             "already: each layer's queue_first takes one queue_misses")
        elif job.layer != layer or not np.array_equal(job.experts, misses.experts):
            raise ValueError(f"layer {layer}'s misses (experts {misses.experts.tolist()}) are "
                             f"not the ones queued first (layer {job.layer}, experts "
                             f"{job.experts.tolist()})")
        # Behind the first batch's blobs only (`SlotsIndex`: behind all of them it would hold
        # each batch's compute back until the last blob is in).
        job.misses, job.index = misses, SlotsIndex.upload(misses, job.slots, x.device)
        self._queue_uploads(job, 0)
        return job

    def compute_queued(self, job: LoanLayer) -> torch.Tensor:
        """Step 2's second half: each batch of `job` computed from its slots once its upload is
        in, the uploads that waited for a compute queued as soon as it is; [R, D] as
        `compute_misses` returns."""
        x, misses = job.x, job.misses
        if misses is None or job.index is None:
            raise ValueError(f"layer {job.layer}'s loaned misses were queued first but never "
                             "given their rows (queue_misses)")
        out = x.new_empty((misses.n_rows, x.shape[1]))  # [R, D]
        for b, (b0, b1, _) in enumerate(job.plan):
            self._queue_uploads(job, b)
            wait_for(job.loaded[b], x.device)  # the compute reads the slots once they are there
            r0, r1 = int(misses.starts[b0]), int(misses.starts[b1])
            out[r0:r1] = compute_from_slots(self.executor.arena, x, misses.group(b0, b1),
                                            job.slots[b0:b1], index=job.index.part(b0, b1))
            job.computed.append(record_event(x.device))
            self._last_read = job.computed[-1]  # the stream runs in order: after every batch
        self.streamed_experts += misses.n_experts
        return out

    def _check_open(self) -> None:
        """ValueError without an open loan; RuntimeError where the books name a lent slot."""
        if not self.active:
            raise ValueError("the prompt loan's misses: no loan is open (begin_pass opens one)")
        taken = self.lent[self.table.owner[self.lent] >= 0]
        if taken.size:
            # Someone put an expert into a lent slot (a move into the loan region while the
            # K/V grew mid-prompt, say): streaming would overwrite it behind the books' back.
            raise RuntimeError(
                f"lent slots {taken.tolist()} hold experts in the books; nothing may fill a "
                "lent slot while the loan is open"
            )

    def _queue_uploads(self, job: LoanLayer, b: int, limit: int | None = None) -> None:
        """Queue every upload of `job` whose slots are free once the computes of its batches
        before `b` have run: all of them at once in distinct slots, else one batch ahead; no
        more than `limit` batches queued in all (None: no limit)."""
        n_plan = len(job.plan) if limit is None else min(limit, len(job.plan))
        while len(job.loaded) < n_plan and job.reuses[len(job.loaded)] < b:
            q0, q1, q_first = job.plan[len(job.loaded)]
            reused = job.reuses[len(job.loaded)]
            job.loaded.append(self._upload(job.layer, job.experts[q0:q1],
                                           self.lent[q_first:q_first + q1 - q0],
                                           job.start if reused < 0 else job.computed[reused]))

    def _upload(self, layer: int, experts: np.ndarray, slots: np.ndarray,
                after: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """`layer`'s `experts` [n] into lent `slots` [n], queued after `after`; the event a
        reader waits for. Bytes only, not a change of the books: lent slots are empty in
        them. With `upload_batches` 1 the host waits instead (the path before; no event)."""
        pairs = np.stack([np.full(experts.size, layer, np.int64), experts], axis=1)  # [n, 2]
        if self.options.upload_batches == 1:
            self.executor.upload(slots, pairs)
            return None
        return self.executor.upload_queued(slots, pairs, after)

    def end_prompt(self) -> None:
        """Refill the lent slots through the policy, then give `top` back."""
        if not self.active:
            return
        lent, self.lent = self.lent, np.empty(0, np.int32)
        self._last_read = None  # the refill's upload waits for the whole stream
        try:
            with self.executor.change() as change:
                free = lent[self.table.owner[lent] < 0]
                change.refill(self.policy.refill(free))  # checked int64 [n, 3]
                change.set_top(self._top_before)
        finally:
            if self.table.top != self._top_before:
                # The refill failed and was rolled back; the loan closes all the same: `top`
                # comes back and the lent slots stay empty in the books.
                with self.executor.change() as change:
                    change.set_top(self._top_before)

    # --- opening a loan ---
    def _lend(self) -> None:
        table = self.table
        n = self.options.lends(table.n_slots, table.n_experts, table.floor)
        lent = np.arange(table.n_slots - n, table.n_slots, dtype=np.int32)
        lent = lent[table.backed[lent]]  # a slot whose chunks went to the K/V holds nothing
        if lent.size == 0:
            return
        top_before = table.top
        with self.executor.change() as change:
            change.evict(lent)
            change.set_top(min(table.top, int(lent[0])))
        self._top_before = top_before
        self.lent = lent
        self.loans += 1
