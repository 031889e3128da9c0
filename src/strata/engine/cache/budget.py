"""Sizing the expert cache: what of the device memory budget is left for slots.

    budget = dense weights + mapped K/V + workspace + reserve + arena (+ spare < one slot)

`--vram-budget-mib` is the device memory strata may use (on a large GPU it emulates a smaller
card); by default, the device's free memory at start on CUDA, and on the CPU (the host backend)
exactly what holds every expert. `--vram-reserve-mib` is what stays free of it (default 256 MiB
on CUDA, 0 on the CPU). `--expert-cache auto` gives the arena whatever is left, in whole slots
(and whole chunks of the memory backend), at most one slot per expert; `--expert-cache N` asks
for N MiB, capped by what is left. Every figure is computed from the model's config, before
anything is loaded, so a budget that is too small is refused at once; and so is what could never
fit the machine (`check_machine`): a K/V window larger than the device's memory (the host's RAM
on the CPU), or a budget or reserve larger than the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata.engine.experts.blobs import dequant_batch
from strata.engine.experts.grouped import copies_weights
from strata.engine.experts.quant import expert_blob_bytes
from strata.engine.memory import memory_limit
from strata.engine.model import families
from strata.engine.model.config import ModelConfig
from strata.engine.model.kv_cells import KvLayout, kv_dtype_name, read_copy_bytes
from strata.engine.model.layers import ATTENTION_PIECE_TOKENS
from strata.machine import bytes_text

__all__ = ["DEFAULT_RESERVE_MIB", "MIB", "CacheBudget", "check_machine", "dense_bytes",
           "device_free_bytes", "gathered_bytes", "kv_bytes", "plan_budget", "size_text",
           "workspace_bytes"]

MIB = 1 << 20
DEFAULT_RESERVE_MIB = {"cuda": 256.0, "cpu": 0.0}  # by device type
HOST_DEFAULT_SOURCE = "host default: every expert"  # a budget no flag or device gave


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dense_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of every non-expert weight on the device in `dtype` (embedding, attention, norms,
    routers, shared experts, lm_head unless tied)."""
    numel = sum(math.prod(s) for s in families.global_shapes(cfg).values())
    numel += cfg.n_layers * sum(math.prod(s) for s in families.layer_shapes(cfg).values())
    return numel * _itemsize(dtype)


def kv_bytes(cfg: ModelConfig, max_cells: int, dtype: torch.dtype, chunk_bytes: int) -> int:
    """Bytes the K/V maps for `max_cells` cells of `dtype` (the cells': bf16, fp32 or int8):
    as `KVCache` lays it out (`KvLayout`), 2 * L segments (and int8's scale segments) of whole
    chunks."""
    return KvLayout.of(cfg, dtype).mapped_bytes(max_cells, chunk_bytes)


def gathered_bytes(cfg: ModelConfig, dtype: torch.dtype, experts_quant: str | None = None
                   ) -> int:
    """The weights the decode path (T == 1) gathers in one layer call: K blobs, and for
    quantized blobs their K dequantized copies in `dtype` too."""
    f, d = cfg.expert_width, cfg.hidden_size
    gathered = cfg.top_k * expert_blob_bytes(f, d, dtype)
    if experts_quant is not None:
        gathered += cfg.top_k * expert_blob_bytes(f, d, dtype, experts_quant)
    return gathered


def workspace_bytes(
    cfg: ModelConfig, prefill_chunk: int, max_cells: int, dtype: torch.dtype,
    stream_blobs: int = 0, gathers: bool = True, experts_quant: str | None = None,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """An upper estimate of the transient tensors of one forward, rounded up to whole MiB.

    C = min(prefill_chunk, max_cells) tokens attending over N = max_cells cells
    (`MoEModel.forward`), R = H/G query heads a kv head:
    - attention, C <= ATTENTION_PIECE_TOKENS (or past a sliding window, in pieces of P = 512):
      a later chunk attends the window through masks [C, N] in `dtype` (made together), a
      piece's copied per query head of a kv head ([R*P, N], when R > 1):
      C*N*itemsize + P*N*R*itemsize bytes (the fused kernel materializes no scores); a longer
      chunk, in one causal call with no mask, over K and V repeated to the H query heads when
      R > 1: 2*N*H*Dh*itemsize bytes (none when R = 1);
    - the decode path's gathered weights (T == 1 only, when `gathers`: where
      `strata.engine.experts.grouped.copies_weights`, i.e. off CUDA or without Triton): the K
      routed experts' blobs (`experts_quant`: and their dequantized copies); a prompt chunk of
      any length reads its experts in place (quantized: `dequant_batch` experts dequantized at
      a time, DEQUANT_BATCH_BYTES at most: through float32 on torch's path, the compute dtype
      only through the CUDA kernels, whose batches are that many times larger);
    - the routed rows [C*K, 2F + D] in fp32, twice; the activations, 16 x [C, width];
    - the logits [V] in fp32, twice;
    - the staging buffer of `--stream-misses` (`stream_blobs` blobs), when there is one;
    - K/V cells of `kv_dtype` other than `dtype` (None: `dtype`): one layer's attended cells
      read into `dtype` (`strata.engine.model.kv_cells.read_copy_bytes`: K and V),
      2*N*G*Dh*itemsize bytes.

    Only the attention term (and the K/V's read) grows with the window: 1 KiB a cell for
    olmoe-1b-7b (R = 1) and 9 KiB for qwen3-30b-a3b (R = 8) in bf16 at C = 512 (longer
    chunks: none and 16 KiB). Measured on the H200 with bench/workspace.py
    (bench/results/workspace-h200-2026-11-29.md, chunks of 512, boolean masks then): a chunk at
    the end of a 65,536-cell window peaked at 118 MiB (olmoe) and 822 MiB (qwen3, 12.5 KiB a
    cell of slope) above what was allocated, under this estimate's 449 and 1,066 MiB; the
    `cuda`-marked test in tests/engine/cache/test_budget_cuda.py keeps it an upper bound.
    """
    c, n = min(prefill_chunk, max_cells), max_cells
    k, f, d = cfg.top_k, cfg.expert_width, cfg.hidden_size
    itemsize = _itemsize(dtype)
    heads_per_kv = cfg.n_heads // cfg.n_kv_heads
    copies = heads_per_kv if heads_per_kv > 1 else 0  # of a piece's mask, per query head
    window = cfg.sliding_window
    if c <= ATTENTION_PIECE_TOKENS or (window is not None and window < n):
        attention = (c + min(c, ATTENTION_PIECE_TOKENS) * copies) * n * itemsize
    else:  # K and V repeated to the H query heads, when a kv head serves several
        attention = 2 * n * cfg.n_heads * cfg.head_dim * itemsize if copies else 0
    gathered = gathered_bytes(cfg, dtype, experts_quant) if gathers else 0
    if experts_quant is not None:  # a prompt chunk's experts, dequantized a batch at a time
        # a layer call's experts at most; the larger of the two paths' batches (torch's
        # through float32, the kernels' in the compute dtype only)
        gathered = max(gathered, *(min(dequant_batch(f, d, w), cfg.n_experts) * 3 * f * d * w
                                   for w in (4 + itemsize, itemsize)))
    rows = 2 * c * k * (2 * f + d) * 4
    width = max(d, cfg.q_width + 2 * cfg.kv_width, cfg.shared_expert_width or 0)
    activations = 16 * c * width * itemsize
    logits = 2 * cfg.vocab_size * 4
    staging = stream_blobs * expert_blob_bytes(f, d, dtype, experts_quant)
    kv_read = 0 if kv_dtype is None else read_copy_bytes(KvLayout.of(cfg, kv_dtype), n, dtype)
    total = attention + gathered + rows + activations + logits + staging + kv_read
    return -(-total // MIB) * MIB


def device_free_bytes(device: torch.device) -> int | None:
    """The device's free memory now (CUDA), or None (the CPU: no device memory to measure)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def size_text(n_bytes: int) -> str:
    """MiB, or KiB below one MiB (tiny test models)."""
    if 0 < n_bytes < MIB:
        return f"{n_bytes / 1024:.1f} KiB"
    return f"{n_bytes / MIB:.1f} MiB"


@dataclass(frozen=True)
class CacheBudget:
    """The parts of the device budget, in bytes, and the slots they leave.

    `expert_cache_mib` None is `--expert-cache auto`. `total_experts` is L * E, the most slots
    a cache needs. `budget_source` says where `budget_bytes` came from (for the startup line),
    `slot_format` what a slot's blob holds: None, the model dtype; else the experts' quantized
    format (`--experts-dtype`); `kv_format` what the K/V's cells hold: None, the model dtype;
    else their dtype's name (`--kv-dtype`: "int8", or "bfloat16" under an fp32 model);
    `prefill_chunk` the prompt chunk the workspace is sized for (a request through the cache
    reads its prompt in chunks of it unless it asks for others). Raises ValueError for a
    negative or non-integer part, and for a budget too small for the fixed parts and the
    minimum cache (one slot; none with `--expert-cache 0`), naming how much is missing.
    """

    budget_bytes: int
    reserve_bytes: int
    dense_bytes: int
    kv_bytes: int
    workspace_bytes: int
    slot_bytes: int
    chunk_bytes: int
    total_experts: int
    expert_cache_mib: float | None = None
    budget_source: str = "--vram-budget-mib"
    slot_format: str | None = None
    kv_format: str | None = None
    prefill_chunk: int = 512

    def __post_init__(self) -> None:
        for name in ("budget_bytes", "reserve_bytes", "dense_bytes", "kv_bytes",
                     "workspace_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("slot_bytes", "chunk_bytes", "total_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        mib = self.expert_cache_mib
        if mib is not None and not (isinstance(mib, int | float) and math.isfinite(mib)
                                    and mib >= 0):
            raise ValueError(f"expert_cache_mib must be None (auto) or >= 0 MiB, got {mib!r}")
        min_slots = 0 if mib == 0 else 1
        need = self.fixed_bytes + self._arena_bytes(min_slots)
        if need > self.budget_bytes:
            raise ValueError(
                f"the device budget of {size_text(self.budget_bytes)} ({self.budget_source}) is "
                f"{size_text(need - self.budget_bytes)} short: dense weights "
                f"{size_text(self.dense_bytes)} + K/V {size_text(self.kv_bytes)} + workspace "
                f"{size_text(self.workspace_bytes)} + reserve {size_text(self.reserve_bytes)} "
                f"+ the minimum cache ({min_slots} slot of {size_text(self.slot_bytes)}) need "
                f"{size_text(need)}; raise --vram-budget-mib, or lower --vram-reserve-mib or "
                "--max-context"
            )

    # --- derived ---
    @property
    def fixed_bytes(self) -> int:
        """Everything but the arena: dense weights, K/V, workspace and reserve."""
        return self.dense_bytes + self.kv_bytes + self.workspace_bytes + self.reserve_bytes

    @property
    def available_bytes(self) -> int:
        """What the budget leaves for the arena."""
        return self.budget_bytes - self.fixed_bytes

    def _arena_bytes(self, n_slots: int) -> int:
        """The memory an arena of `n_slots` maps: whole chunks."""
        return -(-n_slots * self.slot_bytes // self.chunk_bytes) * self.chunk_bytes

    @property
    def auto_slots(self) -> int:
        """The most slots whose chunks fit in `available_bytes`, at most `total_experts`."""
        whole_chunks = self.available_bytes // self.chunk_bytes * self.chunk_bytes
        return min(whole_chunks // self.slot_bytes, self.total_experts)

    @property
    def asked_slots(self) -> int | None:
        """The slots `--expert-cache N` asks for, at most one per expert (None: auto). Compared
        as a float first: N may be far beyond any machine (1e308 MiB is capped, not an
        overflow)."""
        if self.expert_cache_mib is None:
            return None
        asked_bytes = self.expert_cache_mib * MIB
        if asked_bytes >= self.total_experts * self.slot_bytes:
            return self.total_experts
        return int(asked_bytes) // self.slot_bytes

    @property
    def n_slots(self) -> int:
        """The slots of the arena: `auto_slots`, or the asked-for MiB capped by it."""
        asked = self.asked_slots
        return self.auto_slots if asked is None else min(asked, self.auto_slots)

    @property
    def capped(self) -> bool:
        """True when `--expert-cache N` asked for more slots than the budget leaves."""
        asked = self.asked_slots
        return asked is not None and asked > self.auto_slots

    @property
    def arena_bytes(self) -> int:
        return self._arena_bytes(self.n_slots)

    @property
    def holds_every_expert(self) -> bool:
        return self.n_slots == self.total_experts

    def startup_line(self) -> str:
        """One line: the budget, each part, and the slots.

        The cache's figure is the memory its arena maps, in whole chunks of the memory
        backend; where that is a slot or more beyond what the slots need (a small cache, or
        large chunks), the line says what the slots need too, so that `cache 2.0 MiB` beside
        `--expert-cache 0.2 MiB` does not read as a contradiction."""
        n = self.n_slots
        share = 100.0 * n / self.total_experts
        mode = "auto" if self.expert_cache_mib is None else \
            f"--expert-cache {self.expert_cache_mib:g} MiB"
        if self.capped:
            mode += ", capped by the budget"
        slots_bytes = n * self.slot_bytes
        rounding = ""
        if self.arena_bytes - slots_bytes >= self.slot_bytes:
            rounding = (f"; the slots need {size_text(slots_bytes)}, the arena maps whole chunks "
                        f"of {size_text(self.chunk_bytes)}")
        return (
            f"expert cache: budget {size_text(self.budget_bytes)} ({self.budget_source}) = dense "
            f"{size_text(self.dense_bytes)} + K/V {size_text(self.kv_bytes)}"
            f"{f' ({self.kv_format})' if self.kv_format else ''} + workspace "
            f"{size_text(self.workspace_bytes)} (prompt chunks of {self.prefill_chunk}) + reserve "
            f"{size_text(self.reserve_bytes)} + cache "
            f"{size_text(self.arena_bytes)} ({mode}): {n} slots of {size_text(self.slot_bytes)}"
            f"{f' ({self.slot_format})' if self.slot_format else ''}, "
            f"{share:.1f}% of {self.total_experts} experts{rounding}"
        )

    def as_dict(self) -> dict[str, int | float | str | None]:
        """The figures as JSON values."""
        return {
            "budget_bytes": self.budget_bytes,
            "budget_source": self.budget_source,
            "reserve_bytes": self.reserve_bytes,
            "dense_bytes": self.dense_bytes,
            "kv_bytes": self.kv_bytes,
            "kv_format": self.kv_format,
            "workspace_bytes": self.workspace_bytes,
            "arena_bytes": self.arena_bytes,
            "slot_bytes": self.slot_bytes,
            "slot_format": self.slot_format,
            "n_slots": self.n_slots,
            "total_experts": self.total_experts,
            "expert_cache_mib": self.expert_cache_mib,
            "prefill_chunk": self.prefill_chunk,
        }


def plan_budget(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    slot_bytes: int,
    chunk_bytes: int,
    max_context: int,
    prefill_chunk: int,
    budget_mib: float | None = None,
    reserve_mib: float | None = None,
    expert_cache_mib: float | None = None,
    kv_cells: int | None = None,
    stream_blobs: int = 0,
    experts_quant: str | None = None,
    kv_dtype: torch.dtype | None = None,
) -> CacheBudget:
    """The budget for `cfg` in `dtype` on `device`, from the flags' values (None: default).

    `kv_cells` is the K/V cells mapped at start (None: the whole window, `max_context`; the
    elastic K/V maps fewer and the cache gets the rest). Raises ValueError for a negative or
    non-finite MiB value (naming its flag) and for a budget too small (see `CacheBudget`).
    `stream_blobs` is the staging buffer of `--stream-misses`, counted in the workspace;
    `experts_quant` the experts' quantized format (None: `dtype`), which sizes the staging
    blobs and the decode path's gathered weights (`slot_bytes` is the caller's); `kv_dtype`
    the K/V cells' dtype (None: `dtype`; `--kv-dtype`), which sizes the K/V and its reads.
    """
    for flag, value in (("--vram-budget-mib", budget_mib), ("--vram-reserve-mib", reserve_mib),
                        ("--expert-cache", expert_cache_mib)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} must be a number of MiB >= 0, got {value!r}")
    check_machine(cfg, dtype, device, chunk_bytes=chunk_bytes, max_context=max_context,
                  budget_mib=budget_mib, reserve_mib=reserve_mib, kv_dtype=kv_dtype)
    cells = dtype if kv_dtype is None else kv_dtype
    if reserve_mib is None:
        reserve_mib = DEFAULT_RESERVE_MIB.get(device.type, 0.0)
    parts = {
        "reserve_bytes": int(reserve_mib * MIB),
        "dense_bytes": dense_bytes(cfg, dtype),
        "kv_bytes": kv_bytes(cfg, max_context if kv_cells is None else kv_cells, cells,
                             chunk_bytes),
        "workspace_bytes": workspace_bytes(cfg, prefill_chunk, max_context, dtype,
                                           stream_blobs, gathers=copies_weights(device),
                                           experts_quant=experts_quant, kv_dtype=cells),
    }
    total_experts = cfg.n_layers * cfg.n_experts
    if budget_mib is not None:
        budget, source = int(budget_mib * MIB), "--vram-budget-mib"
    elif (free := device_free_bytes(device)) is not None:
        budget, source = free, "free device memory"
    else:
        every = -(-total_experts * slot_bytes // chunk_bytes) * chunk_bytes
        budget, source = sum(parts.values()) + every, HOST_DEFAULT_SOURCE
    return CacheBudget(
        budget_bytes=budget, slot_bytes=slot_bytes, chunk_bytes=chunk_bytes,
        total_experts=total_experts, expert_cache_mib=expert_cache_mib, budget_source=source,
        slot_format=experts_quant, kv_format=None if cells == dtype else kv_dtype_name(cells),
        prefill_chunk=prefill_chunk, **parts,
    )


def check_machine(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    chunk_bytes: int,
    max_context: int,
    budget_mib: float | None = None,
    reserve_mib: float | None = None,
    kv_dtype: torch.dtype | None = None,
) -> None:
    """ValueError, with the figure and the machine's limit, for what could never fit `device`
    (`memory_limit`: the GPU's memory, or the host's RAM on the CPU): a K/V window (of cells
    of `kv_dtype`, None: `dtype`) whose every cell could not be mapped, or a budget or reserve
    larger than the device. Checked before anything is sized from them."""
    limit = memory_limit(device)
    layout = KvLayout.of(cfg, dtype if kv_dtype is None else kv_dtype)
    cell_bytes = layout.cell_bytes
    window = kv_bytes(cfg, max_context, layout.cell_dtype, chunk_bytes)
    if window > limit.nbytes:
        fit = limit.nbytes // layout.n_segments // chunk_bytes * chunk_bytes // cell_bytes
        scales = f" + {layout.scale_segments} of int8 scales" if layout.quantized else ""
        raise ValueError(
            f"the K/V window of {max_context:,} cells needs {bytes_text(window)} "
            f"({cfg.n_layers} layers x K and V{scales} x {cell_bytes} bytes a cell), more than "
            f"{limit}; at most {fit:,} cells fit"
        )
    for flag, mib in (("--vram-budget-mib", budget_mib), ("--vram-reserve-mib", reserve_mib)):
        if mib is not None and mib * MIB > limit.nbytes:
            raise ValueError(f"{flag} {mib:g} is more than {limit.what} "
                             f"({limit.nbytes / MIB:,.0f} MiB); give at most that")
