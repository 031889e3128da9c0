"""The decode rounds of one request, the next one launched before the host reads this one's token.

A round is one forward of the last token and the pick of the next (`Sampler.pick`). Read
plainly, the host waits for each round's token before it can launch the next round, and the
device idles for that wait: the copy back, the host's own turn (the stop check, the text, the
next launch). Where a step takes its token from the device (`round` reads `step.token`, which
the pick writes there), the loop launches round n+1 right after round n and only then waits
for round n's token (`ahead` rounds in flight): the device goes from one round to the next.

The tokens are those of the plain loop, in the same order, with the same draws: a round's
random number is drawn when it is launched, and draws never depend on the logits. What
differs is work thrown away: when a token ends the request (a stop id, or `should_stop` asked
after it), the round already launched after it is dropped, unread. It wrote the K/V cell past
the request's last token, which no later forward reads before writing it again (attention is
causal, and a later request writes its own cells first). A round is launched ahead only into
cells the K/V has mapped: a round that needs the elastic K/V grown waits for the rounds in
flight first, so that the growth (which may give up expert slots and change the step) happens
between rounds, as in the plain loop.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from strata.engine.runtime.sampling import Sampler

__all__ = ["AHEAD_PATHS", "Rounds", "decode_rounds"]

# The decode steps' paths that launch a round ahead: a CUDA graph's replay, whose launch
# costs the host a few microseconds and whose round then runs on the device alone. Eager and
# piecewise rounds read the routing or launch every kernel from the host, which the host's
# wait for a token does not delay.
AHEAD_PATHS = frozenset({"cuda-graph", "compiled-cuda-graph"})


class Rounds(NamedTuple):
    """What `decode_rounds` ends with: the step last used, whether `should_stop` ended the
    rounds, and the seconds the host waited for the rounds' tokens (the device's work queued
    before each read: for a round read right after its launch, its tail, the logits and the
    pick; off CUDA, where a token is read as it is computed, only the read's own time)."""

    step: Any
    stopped: bool
    token_wait_s: float


class _Pending:
    """A launched round's token on its way to the host: a pinned copy and an event on CUDA,
    a copy of the tensor elsewhere."""

    def __init__(self, token: torch.Tensor) -> None:  # token [1] int64, on the device
        self.event = None
        if token.is_cuda:
            self.host = torch.empty(1, dtype=torch.int64, pin_memory=True)
            self.host.copy_(token, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:  # a copy: a step that picks in its round writes the next pick into `token`
            self.host = token.clone()

    def read(self) -> int:
        if self.event is not None:
            self.event.synchronize()
        return int(self.host[0])


def _launch(step: Any, sampler: Sampler, position: int) -> torch.Tensor:
    """Launch the round at `position` and its pick: the token [1], on the device, also left in
    `step.token` as the next round's input. A step that `picks` makes the greedy pick inside
    its round (`decode_steps.GREEDY_PICK_IN_GRAPH`)."""
    picks = getattr(step, "picks", False)
    if picks and not sampler.greedy:
        raise ValueError(f"a {step.path} step that picks greedily inside its rounds was given "
                         "a sampled pick: make the step with greedy=False")
    u = sampler.draw()  # before the logits: the draws never depend on them
    logits = step.round(position)  # [V]
    if picks:
        return step.token
    # The next round's input, written on the device straight into the step's token.
    return sampler.pick(logits, u, out=step.token)  # [1]


def decode_rounds(step: Any, sampler: Sampler, token: int, position: int, n_rounds: int, *,
                  stop_ids: frozenset[int], on_token: Callable[[int], None],
                  should_stop: Callable[[], bool] | None,
                  grow: Callable[[int], Any] | None) -> Rounds:
    """Run up to `n_rounds` rounds from `token` at cell `position` through `step` (a
    `decode_steps` step), each new token to `on_token`, until a token in `stop_ids` or
    `should_stop()` returns True (asked before each round counts: before the first, and after
    each token that another round would follow).

    `grow(position)`: called before a round at a cell the K/V has not mapped (None: never
    needed); it makes the cell available (the elastic K/V's `require`: KvFullError when it
    cannot) and returns the step to continue with (a new one when the old one went stale)."""
    if n_rounds and should_stop is not None and should_stop():
        return Rounds(step, True, 0.0)
    ahead = 1 if step.path in AHEAD_PATHS else 0
    in_flight: deque[_Pending] = deque()
    launched = read = 0
    token_wait_s = 0.0
    step.token.fill_(token)
    while True:
        while launched < n_rounds and len(in_flight) <= ahead:
            if grow is not None and position + 1 > step.kv.mapped_cells:
                if in_flight:
                    break  # the growth waits for the rounds in flight (see the module)
                grown = grow(position)
                if grown is not step:  # a new step reads its token from its own tensor
                    grown.token.copy_(step.token)
                    step = grown
                ahead = 1 if step.path in AHEAD_PATHS else 0
            in_flight.append(_Pending(_launch(step, sampler, position)))
            launched += 1
            position += 1
        if not in_flight:
            return Rounds(step, False, token_wait_s)
        waited = time.perf_counter()
        token = in_flight.popleft().read()
        token_wait_s += time.perf_counter() - waited
        read += 1
        on_token(token)
        if token in stop_ids or read == n_rounds:
            return Rounds(step, False, token_wait_s)
        # Asked before the next round, as the plain loop asks it.
        if should_stop is not None and should_stop():
            return Rounds(step, True, token_wait_s)
