"""Hypothesis strategies for the simulator's tests: tiny traces and replay set-ups."""

import numpy as np
from hypothesis import strategies as st

from strata.formats.trace import DECODE, PROMPT, Trace


@st.composite
def tiny_traces(draw, max_tokens_per_step=2, max_experts=4, max_layers=2, max_steps=6):
    """Small traces: steps of 1 (decode) or more (prompt) tokens, cut into requests."""
    n_layers = draw(st.integers(1, max_layers))
    n_experts = draw(st.integers(1, max_experts))
    top_k = draw(st.integers(1, min(2, n_experts)))
    n_steps = draw(st.integers(1, max_steps))
    tokens = draw(st.lists(st.integers(1, max_tokens_per_step), min_size=n_steps,
                           max_size=n_steps))
    rows = [[draw(st.permutations(range(n_experts)))[:top_k] for _ in range(n_layers)]
            for _ in range(sum(tokens))]
    phase = [PROMPT if t > 1 else DECODE for t in tokens]
    # A request ends where a prompt step follows a decode step, and elsewhere at random.
    cuts = [s for s in range(1, n_steps)
            if (phase[s] == PROMPT and phase[s - 1] == DECODE) or draw(st.booleans())]
    return Trace(
        n_experts=n_experts,
        expert_ids=np.array(rows, np.int32),
        step_offsets=np.concatenate([[0], np.cumsum(tokens)]),
        step_phase=np.array(phase, np.uint8),
        request_offsets=np.array([0, *cuts, n_steps]),
    )


def policy_options(draw, name):
    """Random options for the built-ins that take some."""
    options = {}
    if name in ("lru", "lfu", "sieve"):
        options["max_admits"] = draw(st.integers(0, 3))
    if name == "lfu":
        options["decay"] = draw(st.sampled_from([1.0, 0.9, 0.5, 0.37]))
    return options


def profile_for(draw, trace):
    """None (an empty start) or random counts [L, E]."""
    n_items = trace.n_layers * trace.n_experts
    counts = draw(st.one_of(st.none(), st.lists(st.integers(0, 9), min_size=n_items,
                                                max_size=n_items)))
    return None if counts is None else np.array(counts).reshape(trace.n_layers, trace.n_experts)
