"""File formats read and written by the engine and the simulator alike.

- `npz`: the safe `.npz` reader and writer every format here stands on;
- `trace`: routing traces (`Trace`, `TraceWriter`, `load_trace`, `save_trace`);
- `profile`: expert profiles, per-expert routing counts ranked hottest first (`Profile`).

Nothing here imports the engine or the simulator: both import these.
"""
