"""`ExpertStore`: every expert of every layer in host RAM, as blobs.

Dimension letters: D hidden size, E experts per layer, F expert width.

A *blob* is one expert's bytes laid out contiguously: gate [F, D] | up [F, D] | down [D, F], in
the model dtype. It is the unit a VRAM expert cache copies into a slot. Because gate and up are
adjacent, the first 2*F*D elements of a blob are the fused gate_up matrix [2F, D].
`strata.engine.model.checkpoint.expert_store` reads one from a checkpoint.

The blobs live in host memory that `host_blobs` maps for the whole store at once (one
`strata._vmm.HostPages`: the exact bytes, page-locked for CUDA by the loader where a cache
uploads from it), not in torch's allocations (see `host_blobs`).

A store may instead hold quantized blobs (`quant`: one of `strata.engine.experts.quant`'s
WEIGHT_FORMATS, its layout there); `dtype` is then the dtype the experts compute in. Every reader
takes them as they are: the resident experts and the cache's slots keep them quantized on the
device (`strata.engine.experts.blobs.BlobStack`), the CPU reads them in place (`CpuExperts`).
"""

from __future__ import annotations

import torch

from strata import _vmm, settings
from strata.engine.experts.quant import dequantize_blobs, expert_blob_bytes
from strata.machine import bytes_text, host_limit

__all__ = ["ExpertStore", "host_blobs"]


def host_blobs(n_layers: int, n_experts: int, blob_bytes: int, what: str,
               huge: bool | None = None) -> tuple[_vmm.HostPages, torch.Tensor]:
    """(the pages, uint8 [L, E, blob_bytes] over them, zeros): host memory for a store of
    n_layers x n_experts blobs, `what` naming them for the error (e.g. "the experts of
    model/ as int8"). ValueError, before anything is mapped, if they need more than the host
    has (`strata.machine.host_limit`).

    Why not `torch.empty(..., pin_memory=True)` per layer: torch's caching host allocator
    rounds each block up to a power of two, so a layer of 1.2 GB takes 2 GiB (1.66x). One
    mapping costs what it holds. Page-lock it for CUDA with `pages.register`. The pages are
    advised to be huge ones where `huge` says so, by default where the `STRATA_HOST_HUGE_PAGES`
    setting does (off unless set: see `strata.settings`)."""
    n_bytes = n_layers * n_experts * blob_bytes
    limit = host_limit()
    if n_bytes > limit.nbytes:
        raise ValueError(f"{what} need {bytes_text(n_bytes)} of host memory, more than {limit}: "
                         f"quantized experts (--experts-dtype int8 or int4) need about a half "
                         f"or a quarter of the bf16 bytes")
    huge = settings.read().host_huge_pages if huge is None else huge
    pages = _vmm.HostPages(n_bytes, huge=huge)
    blobs = torch.frombuffer(pages, dtype=torch.uint8).view(n_layers, n_experts, blob_bytes)
    return pages, blobs


class ExpertStore:
    """All experts of all layers in host RAM, as blobs: per layer one uint8 tensor [E, blob_bytes].

    Row `e` of layer `l` is the blob of expert (l, e). Uploads to a CUDA device are
    asynchronous where the buffers are page-locked (`host_blobs`). `pages`: the host pages the
    layers view, if any, unlocked by `close`.
    """

    def __init__(
        self, layers: list[torch.Tensor], hidden_size: int, expert_width: int, dtype: torch.dtype,
        quant: str | None = None, pages: _vmm.HostPages | None = None,
    ) -> None:
        self.hidden_size = hidden_size
        self.expert_width = expert_width
        self.dtype = dtype
        self.quant = quant
        self.blob_bytes = expert_blob_bytes(expert_width, hidden_size, dtype, quant)  # ValueError
        if not layers:
            raise ValueError("an ExpertStore needs at least one layer")
        for i, buf in enumerate(layers):
            if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != self.blob_bytes:
                raise ValueError(
                    f"layer {i}: expected a uint8 tensor [E, {self.blob_bytes}], got "
                    f"{buf.dtype} {list(buf.shape)}"
                )
            if buf.shape[0] != layers[0].shape[0]:
                raise ValueError(
                    f"layer {i} has {buf.shape[0]} experts, layer 0 has {layers[0].shape[0]}"
                )
        self._layers = layers
        self.pages = pages
        self.n_layers = len(layers)
        self.n_experts = layers[0].shape[0]

    def check_uploads_to(self, device: torch.device) -> None:
        """ValueError where `device` is a CUDA device and the blobs' host memory is not
        page-locked: copies from it would run synchronously, at a fraction of the pinned rate,
        and a cache over it would wait on every upload (a store loaded without `pin_memory`,
        or one that was closed and is used again)."""
        if device.type != "cuda":
            return
        locked = (self.pages.registered_device is not None if self.pages is not None
                  else all(layer.is_pinned() for layer in self._layers))
        if not locked:
            raise ValueError(f"the expert store's host memory is not page-locked for CUDA (a "
                             f"store loaded without pin_memory, or closed: ExpertStore.close "
                             f"unlocks it): a cache on {device} would upload from it "
                             f"synchronously, at a fraction of the pinned rate; load it with "
                             f"pin_memory=True and close it after its last cache")

    def close(self) -> None:
        """Unlock the pages for CUDA now, where the owner closes, not when the last view goes:
        that comes at the garbage collector's time, and the device synchronisation it needs
        would break a CUDA graph being captured then. The blobs stay readable (the memory is
        freed with its last view). Idempotent."""
        if self.pages is not None:
            self.pages.unregister()

    def _check(self, layer: int, expert: int | None = None) -> None:
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} is out of range [0, {self.n_layers})")
        if expert is not None and not 0 <= expert < self.n_experts:
            raise IndexError(f"expert {expert} is out of range [0, {self.n_experts})")

    def layer_blobs(self, layer: int) -> torch.Tensor:
        """uint8 [E, blob_bytes]: the blobs of one layer, row e is expert e."""
        self._check(layer)
        return self._layers[layer]

    def blob(self, layer: int, expert: int) -> torch.Tensor:
        """uint8 [blob_bytes]: a view of the blob of expert (layer, expert)."""
        self._check(layer, expert)
        return self._layers[layer][expert]

    def weights(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [F, D], up [F, D], down [D, F]) of expert (layer, expert): views into its blob,
        or, for a quantized store, the weights it stands for (float32 copies)."""
        f, d = self.expert_width, self.hidden_size
        if self.quant is not None:
            gate_up, down = dequantize_blobs(self.blob(layer, expert)[None], self.quant, f, d,
                                             torch.float32)
            return gate_up[0, :f], gate_up[0, f:], down[0]
        typed = self.blob(layer, expert).view(self.dtype)
        return (
            typed[: f * d].view(f, d),
            typed[f * d : 2 * f * d].view(f, d),
            typed[2 * f * d :].view(d, f),
        )
