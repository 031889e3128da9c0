"""The VRAM expert cache: arena, sizing, the cached MoE experts, profiles, the prompt loan and
routing traces (see docs/expert-cache.md and docs/architecture.md, "The expert cache").

- `arena`: the slots, one virtual-memory range; `budget`: how many slots the device budget
  leaves; `routed`: routed rows grouped by expert; `cpu_experts`: the CPU miss path;
  `cached_experts`: the MoE layer's `Experts` through the cache; `stats`: per-request figures;
  `build`: from a `CacheConfig` to a filled cache; `profile`, `loan`, `routing`: profiles, the
  prompt loan, routing counters and recorders; `rates`, `kept_rates`: the split of decode
  misses between the CPU and the bus (`--stream-misses auto`); `host_rows`: decode's host
  copies.
"""
