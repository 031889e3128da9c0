"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling.

A sampled step is an exponential race (the Gumbel-max trick, as vLLM's sampler and FlashInfer's
sort-free top-p do it): with s = logits / temperature and g_i a Gumbel variate for each token,
the pick is the candidate with the largest s_i + g_i. Token i wins with probability
softmax(s)_i over the candidates: the distribution the filters describe. The candidates are the
tokens in order of s (descending, the lower id first on ties): the first top_k (all with top_k
0), then, of those, the smallest prefix whose probability mass (softmax over the top_k) reaches
top_p.

Why a race: its pick needs no sort. The race's winner over all tokens is a candidate unless
more than top_p of the mass comes before it (at most 1 - top_p of the draws); a reduction says
which, and only then is the winner among the tokens before it drawn. On CUDA the pick is three
Triton kernels (`_sampling_triton`; with top_k, torch's topk first); the sort of the vocabulary
that inverse CDF needed cost more than the rest of the pick together. Elsewhere it is
`race_pick_torch`'s torch ops, no sort either.

A greedy step is `argmax_pick`: torch.argmax's token (the lowest id among the largest logits,
NaN counted as the largest). On CUDA it comes from one Triton launch where `ARGMAX_KERNEL` (on
since 2026-12-07): `_sampling_triton.argmax_blocks`, a dependent of the logits' product where
the GPU has programmatic dependent launch, instead of torch's reduction, which took 12.7 us of
device time a pick at a 50,304-token vocabulary on the H200 (bench/results/
sampling-race-h200-2026-12-03.md). On two H100 machines the whole olmoe-1b-7b's greedy decode
ran 1.010x and 1.013x as fast with the kernel, the same 64 tokens (bench/results/
h100-figures-2026-12-07b.md); bench/decode.py `--argmax-kernel` is the A/B (now torch's side),
bench/sampling.py's row "pick greedy kernel graph" its time.

Seeded and deterministic: a step's one random number is drawn from a torch.Generator on the CPU
(`draw`), whatever device the logits are on, and g is a hash of it and the token id
(`gumbel_noise`) computed with the same integer steps on every device. The CPU and the GPU pick
the same token for the same logits, except where two race values, or a candidate's mass against
top_p, agree within float rounding.
"""

from __future__ import annotations

import functools
import math

import torch

from strata.engine import dependent_launch
from strata.engine.model.routing_ops import arrival_counts

__all__ = ["ARGMAX_KERNEL", "HASH_MULTIPLIER", "Sampler", "argmax_pick", "gumbel_noise",
           "hash32", "race_keys", "race_pick_torch"]

ARGMAX_KERNEL = True

HASH_MULTIPLIER = 0x45D9F3B  # of the 32-bit integer hash `hash32`
_MASK32 = 0xFFFFFFFF


def hash32(x):
    """A 32-bit integer hash (two multiply-xorshift rounds; Thomas Mueller's constants) of a
    Python int or an int64 tensor of values in [0, 2**32). The products stay below 2**59: no
    int64 overflow."""
    x = (((x >> 16) ^ x) * HASH_MULTIPLIER) & _MASK32
    x = (((x >> 16) ^ x) * HASH_MULTIPLIER) & _MASK32
    return (x >> 16) ^ x


def race_keys(u: float) -> tuple[int, int]:
    """A step's two 32-bit noise keys from its draw u in [0, 1) (53 random bits)."""
    bits = int(u * 2.0**53)
    key1 = hash32(bits & _MASK32)
    return key1, hash32((bits >> 32) ^ hash32(key1 ^ 0x9E3779B9))


def gumbel_noise(keys: tuple[int, int], n: int, device: torch.device | str) -> torch.Tensor:
    """The race's noise for tokens 0..n-1, float32 [n]: g_i = -log(-log(U_i)), U_i from 23 bits
    of hash32(hash32(i ^ key1) ^ key2), centred in its 2**-23 step (never 0 or 1); the logs in
    float64."""
    key1, key2 = keys
    ids = torch.arange(n, dtype=torch.int64, device=device)
    h = hash32(hash32(ids ^ key1) ^ key2)  # [n]
    uniform = ((h >> 9).double() + 0.5) * 2.0**-23
    return (-torch.log(-torch.log(uniform))).float()


def race_pick_torch(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                    keys: tuple[int, int]) -> torch.Tensor:
    """The race's pick in torch ops over logits [V], as a [1] int64 tensor on their device:
    the host's path (and CUDA's without Triton). No sort: the winner among the tokens in
    play, checked as `_sampling_triton` checks it; when it is not a candidate, the tokens
    before it stay in play. Each check is read on the host."""
    scaled = logits.float() / temperature  # [V]
    race = scaled + gumbel_noise(keys, scaled.shape[0], scaled.device)  # [V]
    ids = torch.arange(scaled.shape[0], device=scaled.device)  # [V]
    mass = torch.exp(scaled - scaled.max())  # [V], softmax's numerators
    whole = mass.sum()  # the candidates' mass before top_p
    in_play = torch.ones_like(scaled, dtype=torch.bool)  # [V]
    if top_k:
        # The top_k largest values (which ties do not change): tokens below the last are
        # never candidates, and the first top_k's mass is theirs.
        top_values = torch.topk(logits.float(), top_k).values / temperature  # [k]
        in_play = scaled >= top_values[-1]
        whole = torch.exp(top_values - scaled.max()).sum()
    while True:
        winner = torch.argmax(torch.where(in_play, race, -torch.inf))  # the first of ties
        s_winner = scaled[winner]
        before = (scaled > s_winner) | ((scaled == s_winner) & (ids < winner))  # [V]
        # No token before it (only with NaN logits, which order nothing): the winner stands;
        # otherwise each check leaves fewer tokens in play, so the loop ends.
        if not bool(before.any()) or ((not top_k or int(before.sum()) < top_k) and (
            top_p >= 1.0 or bool(mass[before].sum() < top_p * whole)
        )):
            return winner.reshape(1)  # [1]
        in_play = before


@functools.cache
def _kernels():
    """The Triton kernel module (`_sampling_triton`), or None without Triton."""
    try:
        from strata.engine.runtime import _sampling_triton
    except ImportError:
        return None
    return _sampling_triton


def _pick_out(out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Where a pick goes: `out`, checked (one int64 [1] on `device`: ValueError otherwise,
    before anything is launched), or a new tensor."""
    if out is None:
        return torch.empty(1, dtype=torch.int64, device=device)
    if out.shape != (1,) or out.dtype != torch.int64 or out.device != device:
        raise ValueError(f"out must be one int64 [1] on {device}, got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    return out


def _race_pick_cuda(kernels, logits: torch.Tensor, temperature: float, top_p: float,
                    top_k: int, keys: tuple[int, int], out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """`race_pick_torch`'s pick from `_sampling_triton`'s three kernels: [1] int64, `out`
    where given (`_pick_out`)."""
    n_tokens = logits.shape[0]
    n_blocks = -(-n_tokens // kernels.BLOCK)
    nb = 1 << max(n_blocks - 1, 0).bit_length()
    # The blocks' parts: largest s, sum, winner; mass before the winner and the next winner.
    floats = torch.empty((5, n_blocks), dtype=torch.float32, device=logits.device)
    ints = torch.empty((3, n_blocks), dtype=torch.int32, device=logits.device)
    out = _pick_out(out, logits.device)
    race = torch.empty(n_tokens, dtype=torch.float32, device=logits.device)  # s + g [V]
    top, total, best, mass, next_best = floats
    best_id, count, next_id = ints
    # With top_k, its largest logits (their values only: ties do not change them).
    top_values = torch.topk(logits.float(), top_k).values if top_k else floats
    # Keys as signed 32-bit: one argument type whatever their value (no recompiles).
    key1, key2 = (k - (1 << 32) if k >= 1 << 31 else k for k in keys)
    grid = (n_blocks,)
    options = dependent_launch.compile_options(logits.device)
    kernels.race_blocks[grid](logits, n_tokens, temperature, key1, key2, top_k, top_values, race,
                              top, total, best, best_id, HAS_TOP_K=top_k > 0,
                              BLOCK=kernels.BLOCK, **options)
    kernels.race_before_blocks[grid](logits, race, n_tokens, temperature, top, best, best_id,
                                     n_blocks, mass, count, next_best, next_id,
                                     BLOCK=kernels.BLOCK, NB=nb, **options)
    kernels.race_pick[(1,)](logits, race, n_tokens, temperature, top_p, top_k, top_values, top,
                            total, best, best_id, n_blocks, mass, count, next_best, next_id, out,
                            HAS_TOP_K=top_k > 0, CHECK_MASS=top_p < 1.0, BLOCK=kernels.BLOCK,
                            ROW_BLOCK=kernels.ROW_BLOCK, NB=nb, num_warps=kernels.ROW_WARPS,
                            **options)
    return out


def argmax_pick(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy pick of logits [V]: torch.argmax's token as a [1] int64 tensor on the logits'
    device (written into `out` where given: a decode step's next token, no copy), from
    `_sampling_triton.argmax_blocks` on CUDA where ARGMAX_KERNEL and Triton are there (nothing
    read on the host: a CUDA graph can hold it)."""
    kernels = _kernels()
    if ARGMAX_KERNEL and logits.is_cuda and kernels is not None:
        return _argmax_cuda(kernels, logits.contiguous(), out)
    return torch.argmax(logits, dim=0, keepdim=True, out=_pick_out(out, logits.device))  # [1]


def _argmax_cuda(kernels, logits: torch.Tensor, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """`argmax_pick` by `kernels.argmax_blocks` (under Triton's interpreter on the CPU in
    tests): [1] int64, `out` where given."""
    n_tokens = logits.shape[0]
    n_blocks = -(-n_tokens // kernels.BLOCK)
    best = torch.empty(n_blocks, dtype=torch.float32, device=logits.device)
    ids = torch.empty((2, n_blocks), dtype=torch.int32, device=logits.device)  # best, first NaN
    out = _pick_out(out, logits.device)
    kernels.argmax_blocks[(n_blocks,)](logits, n_tokens, best, ids[0], ids[1],
                                       arrival_counts(logits.device), out, n_blocks,
                                       BLOCK=kernels.BLOCK,
                                       NB=1 << max(n_blocks - 1, 0).bit_length(),
                                       **dependent_launch.kernel_options(logits.device))
    return out


class Sampler:
    """Picks one token per step. `temperature` 0 means greedy (argmax, lowest id on ties); the
    draws then consume no random numbers. `top_k` 0 and `top_p` 1 switch those filters off."""

    def __init__(
        self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0
    ) -> None:
        if not (isinstance(temperature, int | float) and math.isfinite(temperature)) or (
            temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not (isinstance(top_p, int | float) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {top_k!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = top_k
        self.seed = seed
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sample(self, logits: torch.Tensor) -> int:
        """The next token id from logits [V] (any float dtype, any device): `pick` with this
        step's `draw`, read on the host."""
        return int(self.pick(logits, self.draw()).item())

    def draw(self) -> float | None:
        """This step's random number in [0, 1) (None when greedy: no draw). Drawn first, once
        per step, so the stream of draws never depends on the logits: a caller may draw a
        step's number before its logits exist."""
        if self.greedy:
            return None
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def uses_kernels(self, logits: torch.Tensor) -> bool:
        """Whether `pick` runs `_sampling_triton`'s kernels for these logits: sampled, on CUDA
        with Triton."""
        return not self.greedy and logits.is_cuda and _kernels() is not None

    def pick(self, logits: torch.Tensor, u: float | None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The next token id from logits [V] and the step's draw `u` (`draw`), as a [1] int64
        tensor on the logits' device, written into `out` where given (a decode step's next
        token: no copy after the pick). On CUDA with Triton nothing is read on the host, so a
        decode loop can feed it to the next round before it knows its value (without Triton,
        `race_pick_torch` reads each check)."""
        if logits.dim() != 1 or logits.shape[0] < 1:
            raise ValueError(f"logits must be 1-D and non-empty, got shape {list(logits.shape)}")
        if self.greedy:
            return argmax_pick(logits, out)  # [1]
        if not (isinstance(u, float) and 0.0 <= u < 1.0):
            raise ValueError(f"a sampled pick needs the step's draw u, a float in [0, 1) "
                             f"(Sampler.draw), got {u!r}")
        keys = race_keys(u)
        top_k = self.top_k if self.top_k < logits.shape[0] else 0
        if self.uses_kernels(logits):
            return _race_pick_cuda(_kernels(), logits.contiguous(), self.temperature,
                                   self.top_p, top_k, keys, out)
        if out is not None:  # checked before the pick runs, as the kernels' paths check it
            out = _pick_out(out, logits.device)
        picked = race_pick_torch(logits, self.temperature, self.top_p, top_k, keys)
        return picked if out is None else out.copy_(picked)
