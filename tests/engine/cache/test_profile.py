"""Expert profiles: ranking, the fill order, the file format and every way a file is refused."""

import dataclasses
import json
import os
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata._residency import ResidencyTable
from strata.engine.model.config import ModelConfig
from strata.formats.profile import (
    FORMAT,
    NO_PROFILE_WARNING,
    Profile,
    ProfileError,
    fill_order,
    fill_rank,
    load_profile,
    rank_from_counts,
    save_profile,
    uniform_rank,
)
from strata.formats.trace import save_trace
from strata.sim import synth_trace
from strata.sim.synth import SynthSpec

CONFIG = ModelConfig(
    family="qwen3_moe", vocab_size=260, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
    head_dim=16, n_experts=8, top_k=2, expert_width=128,
)
COUNTS = np.array([[5, 0, 9, 9, 1, 0, 2, 3], [0, 7, 7, 1, 12, 0, 0, 4]], np.int64)


def _profile(counts=COUNTS, config=CONFIG, meta=None):
    return Profile.for_model(counts, config, meta or {"prompts": 3})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.data())
def test_rank_is_the_books_rank(n_layers, n_experts, data):
    counts = np.array(
        data.draw(st.lists(st.integers(0, 3), min_size=n_layers * n_experts,
                           max_size=n_layers * n_experts)),
        np.int64,
    ).reshape(n_layers, n_experts)  # small values: many ties
    table = ResidencyTable(n_layers, n_experts, 1, 1, 1)
    table.set_rank_from_counts(counts)
    assert np.array_equal(rank_from_counts(counts), table.rank)


def test_order_is_hottest_first_ties_by_flat_id():
    order = _profile().order()
    flat = COUNTS.reshape(-1)
    assert order.tolist()[:5] == [12, 2, 3, 9, 10]  # 12, then the 9s, then the 7s by flat id
    assert (np.diff(flat[order]) <= 0).all()
    assert sorted(order.tolist()) == list(range(16))
    assert not order.flags.writeable


def test_fill_order_with_a_profile_and_without():
    profile = _profile()
    order, warning = fill_order(profile, 2, 8)
    assert warning is None and np.array_equal(order, profile.order())
    rank, _ = fill_rank(profile, 2, 8)
    assert np.array_equal(rank, profile.rank)
    order, warning = fill_order(None, 3, 4)
    assert warning == NO_PROFILE_WARNING and "--expert-profile" in warning
    # Round robin over the layers: expert 0 of each layer, then expert 1, ...
    assert order.tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    with pytest.raises(ProfileError, match=r"\[2, 8\].*\[3, 8\]"):
        fill_order(profile, 3, 8)


@pytest.mark.parametrize("n_layers,n_experts", [(1, 1), (3, 7), (16, 64)])
def test_uniform_rank_gives_every_layer_an_equal_share_of_any_prefix(n_layers, n_experts):
    rank = uniform_rank(n_layers, n_experts)
    assert sorted(rank.reshape(-1).tolist()) == list(range(n_layers * n_experts))
    order = np.argsort(rank.reshape(-1))
    for n in range(n_layers * n_experts + 1):
        per_layer = np.bincount(order[:n] // n_experts, minlength=n_layers)
        assert per_layer.max() - per_layer.min() <= 1


def test_uniform_rank_refuses_bad_sizes():
    with pytest.raises(ValueError, match="n_layers must be an int >= 1, got 0"):
        uniform_rank(0, 4)
    with pytest.raises(ValueError, match="n_experts"):
        uniform_rank(2, True)


def test_save_load_round_trip_and_same_bytes(tmp_path):
    profile = _profile()
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    save_profile(profile, a)
    save_profile(load_profile(a), b)
    assert a.read_bytes() == b.read_bytes()
    Profile.load(a).save(b)  # the same through the methods
    assert a.read_bytes() == b.read_bytes()
    loaded = load_profile(a)
    assert np.array_equal(loaded.counts, COUNTS) and loaded.counts.dtype == np.int64
    assert np.array_equal(loaded.rank, profile.rank)
    assert loaded.config_hash == CONFIG.config_hash() and loaded.config == CONFIG.to_json_dict()
    assert loaded.meta == {"prompts": 3} and loaded.version == 1
    assert (loaded.n_layers, loaded.n_experts) == (2, 8)
    with np.load(a) as z:  # readable without strata: plain arrays
        assert str(z["format"]) == FORMAT and z["counts"].shape == (2, 8)
        assert int(z["n_layers"]) == 2 and str(z["config_hash"]) == CONFIG.config_hash()
    umask = os.umask(0)
    os.umask(umask)
    assert (a.stat().st_mode & 0o777) == 0o666 & ~umask


def test_check_accepts_its_model_and_names_what_differs_for_another():
    profile = _profile()
    profile.check(CONFIG)
    other = dataclasses.replace(CONFIG, rope_theta=5e5)
    with pytest.raises(ProfileError, match=r"another model: rope_theta 10000.0 \(profile\) vs "
                                           r"500000.0 \(model\)"):
        profile.check(other)
    bigger = dataclasses.replace(CONFIG, n_experts=16, n_layers=4)
    with pytest.raises(ProfileError, match=r"2 layers x 8 experts, this model has 4 x 16 .*"
                                           r"n_experts 8 \(profile\) vs 16 \(model\)"):
        profile.check(bigger)
    bare = Profile(COUNTS, CONFIG.config_hash())  # no stored config: the hash alone
    with pytest.raises(ProfileError, match="stores no config"):
        bare.check(other)


@pytest.mark.parametrize(
    "counts,message",
    [
        (np.zeros((2, 8), np.float64), "integers"),
        (np.zeros(8, np.int64), "integers"),
        (np.zeros((0, 8), np.int64), "L, E >= 1"),
        (np.array([[1, -2]]), r"counts\[0, 1\] = -2"),
    ],
)
def test_bad_counts_are_refused(counts, message):
    with pytest.raises(ProfileError, match=message):
        Profile(counts, CONFIG.config_hash())


def test_bad_hash_and_meta_are_refused():
    with pytest.raises(ProfileError, match="64 lowercase hex"):
        Profile(COUNTS, "abc")
    with pytest.raises(ProfileError, match="meta must be JSON-ready"):
        Profile(COUNTS, CONFIG.config_hash(), meta={"x": object()})


def _rewrite(path, **fields):
    """The profile at `path` with some arrays replaced (None: removed)."""
    with np.load(path) as z:
        arrays = {name: z[name] for name in z.files}
    for name, value in fields.items():
        if value is None:
            del arrays[name]
        else:
            arrays[name] = value
    np.savez(path, **arrays)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"version": np.array(2)}, "version 2; this strata reads version 1"),
        ({"format": np.array("something-else")}, "'something-else' file"),
        ({"format": None}, "no 'format' field"),
        ({"rank": None}, r"\['rank'\] are missing"),
        ({"counts": COUNTS.astype(np.int32)}, "counts must be int64, got int32"),
        ({"rank": np.zeros((2, 8), np.int32)}, "rank does not agree with counts"),
        ({"n_layers": np.array(3)}, r"n_layers, n_experts = \(3, 8\) disagree"),
        ({"meta": np.array("[1]")}, "meta must be a JSON object"),
        ({"config": np.array("{")}, "config is not JSON"),
        ({"config_hash": np.array("zz")}, "64 lowercase hex"),
    ],
)
def test_load_refuses_a_broken_file_naming_it(tmp_path, fields, message):
    path = tmp_path / "p.npz"
    save_profile(_profile(), path)
    _rewrite(path, **fields)
    with pytest.raises(ProfileError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value)


def test_load_refuses_missing_unreadable_and_trace_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no profile file at"):
        load_profile(tmp_path / "absent.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(ProfileError, match=r"not a readable \.npz profile"):
        load_profile(junk)
    trace = tmp_path / "trace.npz"
    save_trace(synth_trace(SynthSpec(n_layers=2, n_experts=8, top_k=2, n_requests=1,
                                     prompt_tokens=4, decode_tokens=2)), trace)
    with pytest.raises(ProfileError, match="'strata-routing-trace' file, not a "
                                           "'strata-expert-profile'"):
        load_profile(trace)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, format=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ProfileError, match="not a readable"):
        load_profile(pickled)


def test_saving_into_a_missing_directory_leaves_nothing(tmp_path):
    with pytest.raises(OSError):
        save_profile(_profile(), tmp_path / "no" / "p.npz")
    assert not (tmp_path / "no").exists()


def test_summary_figures():
    summary = _profile().summary()
    assert summary["routed"] == int(COUNTS.sum())
    assert summary["routed_per_layer"] == COUNTS.sum(axis=1).tolist()
    assert summary["unused_experts"] == 5
    json.dumps(summary)


def test_a_saved_profile_is_a_plain_stored_zip(tmp_path):
    path = tmp_path / "p.npz"
    save_profile(_profile(), path)
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
    assert [i.filename for i in infos][:2] == ["format.npy", "version.npy"]
