"""The K/V: fixed or elastic.

- `kv_cache`: `KVCache`, one virtual-memory range with a segment per layer's K and V (and
  int8's scale segments: `strata.engine.model.kv_cells`, what attention reads and writes);
- `elastic`: `ElasticKV`, growing into free budget and the expert cache's slots, trimming back;
- `plan`: whether `--kv-grow` applies and its figures, sized beside the cache;
- `stats`: `KvStats`, the elastic K/V's figures.
"""

from strata.engine.kv.kv_cache import KVCache, new_kv

__all__ = ["KVCache", "new_kv"]
