"""`compile_decode_step`: at most two compilations however many decode windows a run reaches
(the window a dynamic size from the second on), each window's logits those of the plain step.
Counted with dynamo's counting backend on the CPU; inductor's own compile on CUDA is
tests/engine/test_generate.py's."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from strata.engine.kv.kv_cache import new_kv
from strata.engine.model.moe import load_model
from strata.engine.runtime.compile import compile_decode_step
from strata.engine.runtime.decode_steps import GRAPH_WINDOW_CELLS
from support.checkpoints import cached_checkpoint


def test_every_window_after_the_first_shares_one_compilation():
    torch._dynamo.reset()
    model = load_model(cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32))
    counter = CompileCounter()
    step = compile_decode_step(model.forward_at, backend=counter)
    token = torch.tensor([5])
    with new_kv(model, 6 * GRAPH_WINDOW_CELLS) as kv:
        for window in range(1, 7):
            n_ctx = window * GRAPH_WINDOW_CELLS
            position = torch.tensor([n_ctx - 3])
            logits = step(token, position, kv, n_ctx)
            assert torch.equal(logits, model.forward_at(token, position, kv, n_ctx))
            assert counter.frame_count == min(window, 2)
    torch._dynamo.reset()
