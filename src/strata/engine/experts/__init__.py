"""The experts: where their weights live and how a routed batch is computed.

- `store`: `ExpertStore`, every expert's blob in host RAM;
- `resident`: the `Experts` interface the model calls, and `ResidentExperts` (all on the device);
- `grouped`: the decode kernels reading experts in place by index (`_grouped_triton` on CUDA);
- `routed`: a layer's routed (token, k) rows grouped by expert;
- `cpu`: experts computed on the CPU from the store; `streamed`: misses streamed to the device.
"""

from strata.engine.experts.resident import Experts, ResidentExperts
from strata.engine.experts.store import ExpertStore

__all__ = ["ExpertStore", "Experts", "ResidentExperts"]
