"""`BlobStack`: blobs of one format side by side, and the math that reads them in place.

Legend: S blobs in the stack, R routed rows, D hidden size, F expert width.

Three holders keep experts on the device as blobs in a uint8 [S, >= blob_bytes] tensor: the
resident experts (a layer's E blobs), the expert cache's arena (S slots, `slot_bytes` apart)
and the staging buffer of streamed misses. A `BlobStack` over such a tensor is how each of them
computes, whatever the blobs' format (`ExpertStore.quant`):
- `expert_rows(index, x_rows)`, the decode path (one routed expert a row, blobs picked by an
  index on the device, no host read): over the dtype's views by
  `strata.engine.experts.grouped.expert_rows`, over quantized blobs by
  `strata.engine.experts.quantized.quantized_rows`; on CUDA with Triton both read the blobs in
  place, so a routed expert costs its stored bytes;
- `weights(i)`, one blob's (gate_up [2F, D], down [D, F]) in the compute dtype for the prompt
  paths (T tokens over one expert): views for unquantized blobs, a dequantized copy otherwise,
  which the chunk's tokens share; `each_weights(indices)` the same for many, quantized blobs
  dequantized `dequant_batch` at a time (one set of launches a batch, not an expert);
- `grouped_rows(indices, x_sorted, counts)`, a prompt chunk's rows sorted by expert through
  their blobs in two grouped products a batch (`strata.engine.experts.sorted_grouped`):
  quantized blobs dequantized a batch at a time, as `each_weights` does, and computed together;
- `gate_up_all()` / `down_all()`: [S, 2F, D] / [S, D, F] views, unquantized stacks only (the
  grouped prefill products read them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from strata.engine.experts.grouped import expert_rows
from strata.engine.experts.quant import dequant_kernels_run, dequantize_blobs
from strata.engine.experts.quantized import quantized_rows
from strata.engine.experts.sorted_grouped import grouped_products

__all__ = ["DEQUANT_BATCH_BYTES", "BlobStack", "dequant_batch", "to_device_async"]

# A batch of `each_weights` / `grouped_rows` takes at most this many bytes of device memory:
# its weights in the compute dtype (dequantized, or gathered from blobs that are not adjacent)
# and, on torch's dequantization path, a float32 copy of each. In bf16 that is 7 of
# qwen3-30b-a3b's experts through float32, 21 through the kernels: a third of the launches.
DEQUANT_BATCH_BYTES = 192 << 20


def dequant_batch(expert_width: int, hidden_size: int, weight_bytes: int) -> int:
    """Experts a batch takes at once when each weight costs `weight_bytes` of device memory
    (the compute dtype's itemsize, plus 4 on torch's dequantization path):
    DEQUANT_BATCH_BYTES of them, at least 1."""
    return max(1, DEQUANT_BATCH_BYTES // (3 * expert_width * hidden_size * weight_bytes))


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (an index, a prompt chunk's runs) on `device`; on CUDA through
    pinned memory, so that the copy does not wait for the stream: a pageable one would, and
    with it for the uploads (the prompt loan's) queued before it."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" \
        else host.to(device)


class BlobStack:
    """The blobs in `blobs` uint8 [S, >= blob_bytes] (bytes contiguous, any stride between
    blobs) of experts of width F = `expert_width` and hidden size D = `hidden_size`, computing
    in `dtype`: blobs of `dtype` when `quant` is None, else of that quantized format
    (`strata.engine.experts.quant.WEIGHT_FORMATS`). It holds views, not copies: the stack is
    as valid as the tensor under it."""

    def __init__(self, blobs: torch.Tensor, dtype: torch.dtype, quant: str | None,
                 expert_width: int, hidden_size: int) -> None:
        if blobs.dtype != torch.uint8 or blobs.dim() != 2 or \
                (blobs.numel() and blobs.stride(1) != 1):
            raise ValueError(f"blobs must be uint8 [S, bytes] with each blob's bytes contiguous, "
                             f"got {blobs.dtype} {list(blobs.shape)}")
        self.blobs, self.dtype, self.quant = blobs, dtype, quant
        self.expert_width, self.hidden_size = expert_width, hidden_size
        f, d = expert_width, hidden_size
        self._gate_up = self._down = None
        if quant is None:
            typed = blobs.view(dtype)  # [S, bytes / itemsize]
            if typed.shape[1] < 3 * f * d:
                raise ValueError(f"blobs of {blobs.shape[1]} bytes do not hold an expert of "
                                 f"F = {f}, D = {d} in {dtype}")
            # Strided views: blob s's gate_up [2F, D] and down [D, F] at their offsets.
            self._gate_up = typed[:, : 2 * f * d].unflatten(1, (2 * f, d))  # [S, 2F, D]
            self._down = typed[:, 2 * f * d : 3 * f * d].unflatten(1, (d, f))  # [S, D, F]

    @property
    def n_blobs(self) -> int:
        return self.blobs.shape[0]

    def expert_rows(self, index: torch.Tensor, x_rows: torch.Tensor) -> torch.Tensor:
        """[R, D] in x_rows' dtype: row r is the expert in blob index[r] applied to x_rows[r]
        (index [R] int64 on the blobs' device, x_rows [R, D])."""
        if self.quant is None:
            return expert_rows(self._gate_up, self._down, index, x_rows)
        return quantized_rows(self.blobs, self.quant, index, x_rows, self.expert_width)

    def weights(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2F, D], down [D, F]) of blob `i` in the compute dtype: views of its bytes,
        or for quantized blobs the weights they stand for (a copy)."""
        if self.quant is None:
            return self._gate_up[i], self._down[i]
        gate_up, down = dequantize_blobs(self.blobs[i : i + 1], self.quant, self.expert_width,
                                         self.hidden_size, self.dtype)  # [1, 2F, D], [1, D, F]
        return gate_up[0], down[0]

    def each_weights(self, indices: Sequence[int]
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """`weights(i)` for each i of `indices`, in order; quantized blobs dequantized
        `dequant_batch` at a time (the same values as one by one)."""
        if self.quant is None:
            for i in indices:
                yield self._gate_up[i], self._down[i]
            return
        for _, gate_up, down in self._batches(list(indices)):
            yield from zip(gate_up, down, strict=True)  # [2F, D], [D, F] each

    def grouped_rows(self, indices: Sequence[int], x_sorted: torch.Tensor,
                     counts: Sequence[int], ends: torch.Tensor | None = None) -> torch.Tensor:
        """[R, D]: rows x_sorted [R, D] sorted by expert, the first counts[0] through blob
        indices[0], the next counts[1] through indices[1], and so on (sum(counts) == R), as
        `sorted_grouped.grouped_products` computes them: two grouped products a batch of
        `dequant_batch` blobs, quantized blobs dequantized once for the batch's rows
        (the loop over `each_weights` makes five launches an expert). Where `_grouped_mm`
        runs (`sorted_grouped`). `ends`: the runs' ends [n + 1] from 0, on the device already
        (a caller that uploaded them earlier: one upload queued behind a prompt loan's blobs
        would hold the computes back until every blob is in); None: uploaded here."""
        indices, counts = list(indices), [int(n) for n in counts]
        if len(counts) != len(indices) or sum(counts) != x_sorted.shape[0] or min(
                counts, default=0) < 0:
            raise ValueError(f"counts must be one count >= 0 per index summing to the "
                             f"{x_sorted.shape[0]} rows, got {len(counts)} counts summing to "
                             f"{sum(counts)} for {len(indices)} indices")
        if not indices:
            return x_sorted.new_empty(x_sorted.shape)
        # Every batch's ends from one upload: the runs' ends within the batch, on the device.
        host_ends = np.cumsum([0, *counts]).tolist()  # [n + 1]
        if ends is None:
            ends = to_device_async(torch.tensor(host_ends, dtype=torch.int32), x_sorted.device)
        elif ends.shape != (len(indices) + 1,):
            raise ValueError(f"ends must be [{len(indices) + 1}] (the runs' ends from 0), got "
                             f"{list(ends.shape)}")
        ends = ends.to(torch.int32)  # one conversion, not one a batch
        for lo, gate_up, down in self._batches(indices):
            hi = lo + gate_up.shape[0]
            first, last = host_ends[lo], host_ends[hi]
            batch_ends = ends[lo + 1 : hi + 1]  # [n]
            rows = grouped_products(gate_up, down, x_sorted[first:last],
                                    batch_ends - first if first else batch_ends)  # [n, D]
            if hi == len(indices) and lo == 0:
                return rows  # one batch: its rows are the whole
            if lo == 0:
                y = x_sorted.new_empty(x_sorted.shape)  # [R, D]
            y[first:last] = rows
        return y

    def batch_blobs(self) -> int:
        """The most blobs a batch of `each_weights` / `grouped_rows` holds: `dequant_batch` at
        the compute dtype's itemsize a weight, plus 4 where torch's path dequantizes them
        (float32 copies; not where the kernels do, `quant.dequant_kernels_run`)."""
        f, d = self.expert_width, self.hidden_size
        float_copies = self.quant is not None and not dequant_kernels_run(self.blobs, self.quant,
                                                                          f, d)
        return dequant_batch(f, d, self.dtype.itemsize + 4 * float_copies)

    def _batches(self, indices: list[int]
                 ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(lo, gate_up [B, 2F, D], down [B, D, F]) of indices[lo:lo + B], for consecutive
        batches of at most `dequant_batch` (the last shorter): the weights dequantized, or
        for unquantized blobs their views where the batch's blobs are adjacent, else
        gathered (a copy)."""
        batch = self.batch_blobs()
        # As many batches as that takes, of even sizes (25 blobs in 13 and 12, not 21 and 4).
        batch = -(-len(indices) // -(-len(indices) // batch)) if indices else batch
        for lo in range(0, len(indices), batch):
            chosen = indices[lo : lo + batch]
            # Adjacent blobs (every expert of a long prompt's layer, a loan's lent slots) are
            # one strided view, read in place; others are stacked from views, not gathered by
            # an index tensor: an index made on the host and copied to the device would wait
            # for the work queued before it.
            adjacent = chosen == list(range(chosen[0], chosen[0] + len(chosen)))
            run = slice(chosen[0], chosen[0] + len(chosen))
            if self.quant is None:
                yield (lo, self._gate_up[run], self._down[run]) if adjacent else \
                    (lo, torch.stack([self._gate_up[i] for i in chosen]),
                     torch.stack([self._down[i] for i in chosen]))
                continue
            blobs = self.blobs[run] if adjacent else torch.stack([self.blobs[i] for i in chosen])
            gate_up, down = dequantize_blobs(blobs, self.quant, self.expert_width,
                                             self.hidden_size, self.dtype)
            yield lo, gate_up, down

    def _unquantized(self, what: str) -> None:
        if self.quant is not None:
            raise ValueError(f"{what}: the blobs are quantized ({self.quant}); they have no "
                             f"{self.dtype} views (use expert_rows or weights)")

    def gate_up_all(self) -> torch.Tensor:
        """[S, 2F, D]: every blob's gate rows then up rows (unquantized blobs only)."""
        self._unquantized("gate_up_all")
        return self._gate_up

    def down_all(self) -> torch.Tensor:
        """[S, D, F]: every blob's down matrix (unquantized blobs only)."""
        self._unquantized("down_all")
        return self._down
