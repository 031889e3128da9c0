"""The budget's workspace estimate against what a forward really allocates on CUDA (run with
`pytest -m cuda` on the GPU machine), through bench/workspace.py's measurement."""

import pytest
import torch

from strata.engine.model.moe import load_model
from support.checkpoints import cached_checkpoint
from workspace import measure

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_workspace_estimate_bounds_a_forward_at_any_window(family, dtype):
    model = load_model(cached_checkpoint(family, "small", dtype=dtype), device="cuda")
    for n_cells in (64, 4096, 32768):
        row = measure(model, n_cells, 512, torch.device("cuda"))
        assert row["last"] > 0 and row["decode"] > 0
        for case in ("first", "last", "decode"):
            assert row[case] <= row["estimate"], (n_cells, case, row)
