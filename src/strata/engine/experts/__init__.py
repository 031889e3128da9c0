"""The experts: where their weights live and how a routed batch is computed.

- `store`: `ExpertStore`, every expert's blob in host RAM;
- `resident`: the `Experts` interface the model calls, and `ResidentExperts` (all on the device);
- `grouped`: the decode kernels reading experts in place by index (`_grouped_triton` on CUDA);
- `sorted_grouped`: a prompt chunk's experts as grouped products over rows sorted by expert;
- `combine`: `weighted_sum`, each token's K rows weighted and summed (`_combine_triton`);
- `routed`: a layer's routed (token, k) rows grouped by expert;
- `cpu`: experts computed on the CPU from the store; `streamed`: misses streamed to the device.
"""

from strata.engine.experts.combine import weighted_sum
from strata.engine.experts.resident import Experts, ResidentExperts
from strata.engine.experts.store import ExpertStore

__all__ = ["ExpertStore", "Experts", "ResidentExperts", "weighted_sum"]
