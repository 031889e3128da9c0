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
2. `compute_misses`: per layer, the missed experts in batches of N: uploaded into the lent slots
   (complete before the compute reads them; on CUDA the copy stream waits for the kernels that
   still read the previous batch), then computed from the slots on the device.
3. `end_prompt` (the phase turns to decode, or the request ends): the policy's `refill` fills the
   lent slots (checked; default: the hottest missing experts), their blobs are uploaded, the books
   take them, `top` is restored and the mirror re-uploaded.

The books never name a lent slot while the loan is open (checked at every layer: nothing else
may fill one, e.g. the elastic K/V must not grow mid-prompt), and the loan computes exactly the
`Experts` math (the same SwiGLU per expert), so its rows differ from the CPU's only by rounding.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from strata.books import apply_refill
from strata.engine.experts.routed import Routed
from strata.policies import emit
from strata.policies.events import Evicted, Refilled

__all__ = [
    "DEFAULT_KEEP_SLOTS",
    "DEFAULT_MAX_FRACTION",
    "KEEP_SLOTS_ENV",
    "PromptLoan",
    "loan_slots",
]

DEFAULT_KEEP_SLOTS = 128  # slots a loan never takes: the hottest experts stay for the prompt
DEFAULT_MAX_FRACTION = 0.85  # the most of the arena a loan takes
KEEP_SLOTS_ENV = "STRATA_LOAN_KEEP_SLOTS"  # overrides DEFAULT_KEEP_SLOTS (tiny test caches: 0)


def _keep_slots_from_env() -> int:
    text = os.environ.get(KEEP_SLOTS_ENV)
    if text is None or text == "":
        return DEFAULT_KEEP_SLOTS
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{KEEP_SLOTS_ENV}={text!r}: want an integer >= 0 (slots a loan leaves)")
    return value


def loan_slots(
    n_slots: int, n_experts: int, keep_slots: int, max_fraction: float, floor: int = 0
) -> int:
    """N, the slots a loan takes: min(floor(max_fraction * S), S - keep_slots, E, S - floor),
    and 0 when that is below 1."""
    n = min(math.floor(max_fraction * n_slots), n_slots - keep_slots, n_experts, n_slots - floor)
    return max(0, n)


class PromptLoan:
    """Lends the top slots of `cached` (a `CachedExperts`) to prompt passes longer than
    `short_read` tokens.

    `keep_slots`: the fewest slots left to the cache during a loan (None: the environment's
    `STRATA_LOAN_KEEP_SLOTS`, else 128); `max_fraction`: the most of the arena lent (0.85).
    Raises ValueError for a bad option.
    """

    def __init__(
        self,
        cached,
        short_read: int = 64,
        keep_slots: int | None = None,
        max_fraction: float = DEFAULT_MAX_FRACTION,
    ) -> None:
        if keep_slots is None:
            keep_slots = _keep_slots_from_env()
        for name, value, low in (("short_read", short_read, 1), ("keep_slots", keep_slots, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not 0.0 <= max_fraction <= 1.0:
            raise ValueError(f"max_fraction must be in [0, 1], got {max_fraction!r}")
        self.short_read = short_read
        self.keep_slots = keep_slots
        self.max_fraction = float(max_fraction)
        self.lent = np.empty(0, np.int32)  # [N] ascending: the slots lent now (empty: none)
        self._top_before = -1
        self.loans = 0  # loans opened so far
        self.streamed_experts = 0  # experts uploaded into lent slots and computed there

    @property
    def active(self) -> bool:
        return self.lent.size > 0

    # --- the hooks CachedExperts calls ---
    def begin_pass(self, cached, n_tokens: int, phase: str) -> bool:
        """Before layer 0 of a pass: True when this pass's misses come here."""
        if phase != "prompt" or n_tokens <= self.short_read:
            return False
        if not self.active:
            self._lend(cached)
        return self.active

    def compute_misses(self, cached, layer: int, x: torch.Tensor, misses: Routed
                       ) -> torch.Tensor:
        """[R, D] on the device, rows in `misses.rows` order: the missed experts streamed
        through the lent slots, N at a time."""
        if not self.active:
            raise ValueError("compute_misses: no loan is open (begin_pass opens one)")
        taken = self.lent[cached.table.owner[self.lent] >= 0]
        if taken.size:
            # Someone put an expert into a lent slot (a move into the loan region while the
            # K/V grew mid-prompt, say): streaming would overwrite it behind the books' back.
            raise RuntimeError(
                f"lent slots {taken.tolist()} hold experts in the books; nothing may fill a "
                "lent slot while the loan is open"
            )
        out = x.new_empty((misses.n_rows, x.shape[1]))  # [R, D]
        for b0 in range(0, misses.n_experts, self.lent.size):
            b1 = min(misses.n_experts, b0 + self.lent.size)
            r0, r1 = int(misses.starts[b0]), int(misses.starts[b1])
            batch = misses.group(b0, b1)
            slots = self.lent[: b1 - b0]
            pairs = np.stack([np.full(b1 - b0, layer, np.int64), batch.experts], axis=1)
            cached.upload(slots, pairs)  # complete before the compute below reads the slots
            out[r0:r1] = cached.compute_from_slots(x, batch, slots)
        self.streamed_experts += misses.n_experts
        return out

    def end_pass(self, cached) -> None:
        """After the last layer of a pass that borrowed: the loan stays open until the prompt
        ends, for the prompt's next pass."""

    def end_prompt(self, cached) -> None:
        """Refill the lent slots through the policy, then give `top` back."""
        if not self.active:
            return
        table = cached.table
        lent, self.lent = self.lent, np.empty(0, np.int32)
        try:
            free = lent[table.owner[lent] < 0]
            placements = cached.checked.refill(free)  # checked int64 [n, 3]
            if placements.size:
                # Bytes first: the books never name a slot whose blob is not there.
                cached.upload(placements[:, 0], placements[:, 1:])
                apply_refill(table, placements)
        finally:
            table.set_regions(top=self._top_before)
            cached.sync_mirror()
        if cached.events is not None and placements.size:
            emit(cached.events, Refilled(placements=tuple(
                (int(s), int(layer), int(e)) for s, layer, e in placements)))

    # --- opening a loan ---
    def _lend(self, cached) -> None:
        table = cached.table
        n = loan_slots(table.n_slots, cached.n_experts, self.keep_slots, self.max_fraction,
                       table.floor)
        lent = np.arange(table.n_slots - n, table.n_slots, dtype=np.int32)
        lent = lent[table.backed[lent]]  # a slot whose chunks went to the K/V holds nothing
        if lent.size == 0:
            return
        occupied = lent[table.owner[lent] >= 0]
        evicted = table.evict_many(occupied) if occupied.size else np.empty((0, 2), np.int32)
        self._top_before = table.top
        table.set_regions(top=min(table.top, int(lent[0])))
        cached.sync_mirror()  # complete before any kernel reads the books' new state
        self.lent = lent
        self.loans += 1
        cached.stats.note_lent(int(lent.size))
        if cached.events is not None and evicted.size:
            emit(cached.events, Evicted(experts=tuple((int(a), int(b)) for a, b in evicted)))
