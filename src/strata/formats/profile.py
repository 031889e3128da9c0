"""Expert profiles: per-expert routing counts from a calibration run, and the cache's fill order.

Legend: L MoE layers, E routed experts per layer. A flat expert id is `layer * E + expert`.

A profile is what `strata profile` writes: how often the router picked each expert while the
model read some prompts, the ranking those counts give (0 = hottest; ties by flat id, the rule
of `ResidencyTable.set_rank_from_counts`, so the engine, the simulator and this file rank alike),
and the model it was made for (its layer and expert counts, `ModelConfig.config_hash()` and the
config's fields, so that a profile for another model is refused with what differs).

Stored as an uncompressed `.npz` of format `strata-expert-profile`, version 1 (docs/profiles.md),
with a `counts` [L, E] field: `strata simulate --profile` reads it as it reads any `.npz` with
`counts`. The same profile always gives the same bytes.

The cache is filled in `fill_order`: hottest first by the profile; without one, round-robin
over the layers (every layer gets an equal share of the slots, since nothing says which layer
needs more) with a warning.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from strata.formats.npz import Member, npz_scalar, read_npz, write_npz

__all__ = [
    "FORMAT",
    "NO_PROFILE_WARNING",
    "VERSION",
    "Profile",
    "ProfileError",
    "fill_order",
    "fill_rank",
    "load_profile",
    "rank_from_counts",
    "save_profile",
    "uniform_rank",
]

FORMAT = "strata-expert-profile"
VERSION = 1
NO_PROFILE_WARNING = (
    "no --expert-profile: the cache is filled in a uniform order (the same share of every "
    "layer), not hottest first; `strata profile` makes a profile"
)
_FIELDS = ("format", "version", "n_layers", "n_experts", "counts", "rank", "config_hash",
           "config", "meta")
_HASH = re.compile(r"[0-9a-f]{64}")


class ModelIdentity(Protocol):
    """What a profile records of the model it was made for (`strata.engine.model.config.
    ModelConfig` is one; formats sit below the engine and do not import it)."""

    n_layers: int
    n_experts: int

    def config_hash(self) -> str: ...
    def to_json_dict(self) -> dict[str, Any]: ...


class ProfileError(ValueError):
    """A profile that cannot be used: unreadable, another format or version, inconsistent, or
    made for another model. The message names the file (if any) and what is wrong."""


def rank_from_counts(counts: np.ndarray) -> np.ndarray:
    """int32 [L, E]: 0 for the most routed expert, ties broken by the lower flat id."""
    counts = np.asarray(counts)
    flat = counts.reshape(-1)
    order = np.argsort(-flat.astype(np.float64), kind="stable")  # [L*E] hottest first
    rank = np.empty(flat.size, np.int32)
    rank[order] = np.arange(flat.size, dtype=np.int32)
    return rank.reshape(counts.shape)


def uniform_rank(n_layers: int, n_experts: int) -> np.ndarray:
    """int32 [L, E]: round-robin over the layers, expert 0 of every layer first, then expert 1.

    Any prefix of this order holds the same number of experts of every layer, give or take one.
    """
    for name, value in (("n_layers", n_layers), ("n_experts", n_experts)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    expert = np.arange(n_experts, dtype=np.int32)[None, :]  # [1, E]
    layer = np.arange(n_layers, dtype=np.int32)[:, None]  # [L, 1]
    return expert * n_layers + layer  # [L, E]


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


def _json_object(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ProfileError(f"{name} must be a mapping, got {type(value).__name__}")
    try:
        return json.loads(json.dumps(dict(value), sort_keys=True))
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{name} must be JSON-ready: {exc}") from None


@dataclass(frozen=True, eq=False)
class Profile:
    """Per-expert routing counts of one model; arrays are read-only.

    Attributes:
        counts: int64 [L, E], >= 0: how often each expert was routed to (summed over tokens).
        config_hash: `ModelConfig.config_hash()` of the model the counts come from.
        config: that model's `ModelConfig.to_json_dict()`, to name what differs on a mismatch.
        meta: JSON-ready notes: the source (`model`), `prompts`, `tokens` counted.

    Raises:
        ProfileError: counts that are not non-negative integers [L, E], a hash that is not 64
            hex digits, or config / meta that are not JSON objects.
    """

    counts: np.ndarray
    config_hash: str
    config: Mapping[str, Any] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts)
        if counts.dtype.kind not in "iu" or counts.ndim != 2 or 0 in counts.shape:
            raise ProfileError(
                f"counts must be integers [L, E] with L, E >= 1, got {counts.dtype} {counts.shape}"
            )
        if (counts < 0).any():
            layer, expert = (int(v) for v in np.argwhere(counts < 0)[0])
            raise ProfileError(
                f"counts[{layer}, {expert}] = {int(counts[layer, expert])}; counts are >= 0"
            )
        object.__setattr__(self, "counts", _frozen(counts.astype(np.int64, copy=False)))
        if not isinstance(self.config_hash, str) or not _HASH.fullmatch(self.config_hash):
            raise ProfileError(
                f"config_hash must be 64 lowercase hex digits (a sha256), got {self.config_hash!r}"
            )
        object.__setattr__(self, "config", _json_object("config", self.config))
        object.__setattr__(self, "meta", _json_object("meta", self.meta))
        object.__setattr__(self, "_rank", _frozen(rank_from_counts(self.counts)))

    @classmethod
    def for_model(
        cls, counts: np.ndarray, config: ModelIdentity, meta: Mapping[str, Any] | None = None
    ) -> Profile:
        """A profile of `counts` [L, E] for the model `config` describes (shapes checked)."""
        profile = cls(counts, config.config_hash(), config.to_json_dict(), meta or {})
        profile.check(config)
        return profile

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """`load_profile(path)`."""
        return load_profile(path)

    def save(self, path: str | os.PathLike[str]) -> None:
        """`save_profile(self, path)`."""
        save_profile(self, path)

    @property
    def n_layers(self) -> int:
        return int(self.counts.shape[0])

    @property
    def n_experts(self) -> int:
        return int(self.counts.shape[1])

    @property
    def version(self) -> int:
        return VERSION

    @property
    def rank(self) -> np.ndarray:
        """int32 [L, E]: 0 = hottest; ties by the lower flat id."""
        return self._rank  # type: ignore[attr-defined]

    def order(self) -> np.ndarray:
        """int32 [L*E]: flat expert ids, hottest first."""
        order = np.argsort(self.rank.reshape(-1), kind="stable").astype(np.int32)
        return _frozen(order)

    def check(self, config: ModelIdentity) -> None:
        """ProfileError unless this profile was made for the model `config` describes; the
        message says what differs (layers and experts first, then each config field)."""
        want = (config.n_layers, config.n_experts)
        have = (self.n_layers, self.n_experts)
        differs = _config_differences(self.config, config.to_json_dict())
        if have != want:
            raise ProfileError(
                f"the profile is for a model of {have[0]} layers x {have[1]} experts, this model "
                f"has {want[0]} x {want[1]}" + (f" ({differs})" if differs else "")
            )
        if self.config_hash != config.config_hash():
            detail = differs or "the profile stores no config to compare field by field"
            raise ProfileError(f"the profile was made for another model: {detail}")

    def summary(self) -> dict[str, Any]:
        """The profile's figures, JSON-ready."""
        per_layer = self.counts.sum(axis=1)  # [L]
        return {
            "format": FORMAT,
            "version": VERSION,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "routed": int(self.counts.sum()),
            "routed_per_layer": per_layer.tolist(),
            "unused_experts": int((self.counts == 0).sum()),
            "config_hash": self.config_hash,
            "meta": dict(self.meta),
        }


def _config_differences(stored: Mapping[str, Any], model: Mapping[str, Any]) -> str:
    """'field: P (profile) vs M (model), ...' for every field that differs; '' if none do."""
    if not stored:
        return ""
    parts = []
    for key in sorted(set(stored) | set(model)):
        a, b = stored.get(key, "<absent>"), model.get(key, "<absent>")
        if a != b:
            parts.append(f"{key} {a!r} (profile) vs {b!r} (model)")
    return "; ".join(parts)


def fill_rank(
    profile: Profile | None, n_layers: int, n_experts: int
) -> tuple[np.ndarray, str | None]:
    """(rank int32 [L, E], warning or None): the order the cache is filled in and refilled by.

    With a profile: its rank (its shape must be [n_layers, n_experts]; `Profile.check` is the
    full check). Without: `uniform_rank` and `NO_PROFILE_WARNING` for the caller to print.
    """
    if profile is None:
        return uniform_rank(n_layers, n_experts), NO_PROFILE_WARNING
    if (profile.n_layers, profile.n_experts) != (n_layers, n_experts):
        raise ProfileError(
            f"the profile is [L, E] = [{profile.n_layers}, {profile.n_experts}], the cache "
            f"holds [{n_layers}, {n_experts}]"
        )
    return profile.rank, None


def fill_order(
    profile: Profile | None, n_layers: int, n_experts: int
) -> tuple[np.ndarray, str | None]:
    """(flat ids int32 [L*E], warning or None): experts in the order they fill the cache, from
    slot 0 up: hottest first by the profile, else round-robin over the layers (`fill_rank`)."""
    rank, warning = fill_rank(profile, n_layers, n_experts)
    return np.argsort(rank.reshape(-1), kind="stable").astype(np.int32), warning


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Write `profile` to an `.npz` at `path` (exactly that name, replaced atomically).

    The same profile always gives the same bytes: a stored zip with fixed timestamps.
    """
    arrays = {
        "format": np.array(FORMAT),
        "version": np.array(VERSION, dtype=np.int64),
        "n_layers": np.array(profile.n_layers, dtype=np.int64),
        "n_experts": np.array(profile.n_experts, dtype=np.int64),
        "counts": profile.counts,
        "rank": profile.rank,
        "config_hash": np.array(profile.config_hash),
        "config": np.array(json.dumps(profile.config, sort_keys=True)),
        "meta": np.array(json.dumps(profile.meta, sort_keys=True)),
    }
    write_npz(path, arrays)


def _scalar(path: str, data: Mapping[str, np.ndarray], name: str, kind: str) -> Any:
    return npz_scalar(path, data, name, kind, ProfileError)


def _json_field(path: str, data: Mapping[str, np.ndarray], name: str) -> dict[str, Any]:
    try:
        value = json.loads(_scalar(path, data, name, "U"))
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: {name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ProfileError(f"{path}: {name} must be a JSON object, got {type(value).__name__}")
    return value


def _shape_check(path: str, expect: tuple[int, int] | None) -> Callable[[Mapping[str, Member]],
                                                                          None]:
    """The check of a profile's headers, before any array is read: counts and rank [L, E]
    (`expect`'s, when given), every other field a scalar."""

    def check(members: Mapping[str, Member]) -> None:
        for name, member in members.items():
            want = 2 if name in ("counts", "rank") else 0
            if len(member.shape) != want:
                raise ProfileError(f"{path}: {name} must be {'[L, E]' if want else 'a scalar'}, "
                                   f"got shape {list(member.shape)}")
        shapes = {members[name].shape for name in ("counts", "rank") if name in members}
        if expect is not None and shapes and shapes != {expect}:
            raise ProfileError(
                f"{path}: the profile is for a model of {' / '.join(map(str, shapes))} (layers, "
                f"experts), this model has {expect}")
        if len(shapes) > 1:
            raise ProfileError(f"{path}: counts and rank must have one shape, got {shapes}")

    return check


def load_profile(path: str | os.PathLike[str], *, expect: tuple[int, int] | None = None
                 ) -> Profile:
    """Read and check a profile written by `save_profile`; with `expect` (the model's
    (n_layers, n_experts)), a profile of another shape is refused before its arrays are read.

    Raises:
        FileNotFoundError: no file at `path`.
        ProfileError: not a readable `.npz`, another format or version, a missing field, or
            fields that disagree (shape, counts and rank, the stored sizes); the message names
            the path and the problem.
    """
    path = os.fspath(path)
    data = read_npz(path, fmt=FORMAT, short="profile", long="expert profile", error=ProfileError,
                    fields=_FIELDS, check=_shape_check(path, expect))
    version = _scalar(path, data, "version", "iu") if "version" in data else None
    if version != VERSION:
        raise ProfileError(
            f"{path} has profile format version {version}; this strata reads version {VERSION} "
            "(make the profile again with `strata profile`)"
        )
    missing = [name for name in _FIELDS if name not in data]
    if missing:
        raise ProfileError(f"{path}: the fields {missing} are missing")
    counts = data["counts"]
    if counts.dtype != np.int64:
        raise ProfileError(f"{path}: counts must be int64, got {counts.dtype}")
    try:
        profile = Profile(
            counts,
            _scalar(path, data, "config_hash", "U"),
            _json_field(path, data, "config"),
            _json_field(path, data, "meta"),
        )
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None
    sizes = (_scalar(path, data, "n_layers", "iu"), _scalar(path, data, "n_experts", "iu"))
    if sizes != (profile.n_layers, profile.n_experts):
        raise ProfileError(
            f"{path}: n_layers, n_experts = {sizes} disagree with counts' shape "
            f"{tuple(profile.counts.shape)}"
        )
    rank = data["rank"]
    if rank.shape != profile.counts.shape or not np.array_equal(rank, profile.rank):
        raise ProfileError(
            f"{path}: rank does not agree with counts (rank must order counts highest first, "
            "ties by flat id)"
        )
    return profile
