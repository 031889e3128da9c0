"""Calibration: run prompts through a model and count which experts they route to.

`strata profile` turns the counts into an expert profile (`strata.formats.profile`); the
benchmarks use them to fill their caches as a profile would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import numpy as np

from strata.engine.kv.elastic import ElasticKV
from strata.engine.kv.kv_cache import KVCache
from strata.engine.model import MoEModel
from strata.engine.runtime.generate import GenerateOptions, generate
from strata.engine.runtime.recording import RoutingCounter, RoutingRecorder, installed
from strata.formats.trace import TraceWriter

__all__ = ["collect_counts"]


def collect_counts(
    model: MoEModel,
    prompts: Sequence[Sequence[int]],
    *,
    decode_tokens: int = 0,
    prefill_chunk: int = 512,
    on_prompt: Callable[[], None] | None = None,
    writer: TraceWriter | None = None,
    kv: ElasticKV | None = None,
    cells: KVCache | None = None,
) -> tuple[np.ndarray, dict[str, int]]:
    """Run each prompt (token ids) through `model`, then `decode_tokens` greedy tokens, and
    count the routing. Returns (counts int64 [L, E], figures: prompts, prompt_tokens,
    decode_tokens). With a `writer`, each prompt is also recorded as a request of a trace.
    `kv`: the elastic K/V the requests run in, else `cells`, a fixed one (an engine's: `Engine.
    elastic`, `Engine.fixed`), else one per prompt. Every prompt is read whole (nothing reused
    from the one before). The model's experts are put back as they were."""

    cfg = model.config
    counter = RoutingCounter(model.experts, cfg.n_layers, cfg.n_experts, model.device)
    recorder = None if writer is None else RoutingRecorder(counter, writer)
    prompt_tokens = 0
    with contextlib.ExitStack() as stack:
        stack.enter_context(installed(model, counter))
        if recorder is not None:
            stack.enter_context(installed(model, recorder))
        for ids in prompts:
            options = GenerateOptions(
                # max_new counts the token sampled from the prompt, which is not fed back.
                max_new=decode_tokens + 1,
                max_context=len(ids) + decode_tokens + 1,
                temperature=0.0,
                prefill_chunk=prefill_chunk,
                ignore_stop=True,
                cuda_graphs=False,  # a graph replay would bypass the counter
            )
            with recorder.request(len(ids)) if recorder else contextlib.nullcontext():
                generate(model, None, ids, options, kv=kv, cells=cells)
            prompt_tokens += len(ids)
            if on_prompt is not None:
                on_prompt()
    figures = {
        "prompts": len(prompts),
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens * len(prompts),
    }
    return counter.counts(), figures
