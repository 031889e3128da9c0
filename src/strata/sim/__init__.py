"""The policy lab: replay routing traces through policies against the books alone.

`strata.formats.trace` is the trace format (`Trace`, `load_trace`, `save_trace`, and
`TraceWriter`, which the engine calls to record one); `synth` makes synthetic traces; `replay`
runs a policy over a trace with the same policy code and checks as the engine; `belady` gives
the upper bounds; `cost` turns counts into an estimated tok/s. `strata simulate` and
`strata trace` are the command line.
"""

from strata.formats.trace import Trace, TraceError, TraceWriter, load_trace, save_trace
from strata.sim.belady import belady, oracle_static
from strata.sim.cost import Bandwidths, CostModel
from strata.sim.kv_sim import KvConfig
from strata.sim.replay import Replay, ReplayConfig, choose_path, replay
from strata.sim.result import ReplayResult
from strata.sim.sweep import sweep
from strata.sim.synth import SynthSpec, synth_trace

__all__ = [
    "Bandwidths",
    "CostModel",
    "KvConfig",
    "Replay",
    "ReplayConfig",
    "ReplayResult",
    "SynthSpec",
    "Trace",
    "TraceError",
    "TraceWriter",
    "belady",
    "choose_path",
    "load_trace",
    "oracle_static",
    "replay",
    "save_trace",
    "sweep",
    "synth_trace",
]
