"""`--stream-misses auto`: the split arithmetic, the rates measured on the host twin and kept in
the rates file, reading them back, a bad file, and the split's determinism through the cache."""

import dataclasses
import itertools
import json
import math
import re
import time
from pathlib import Path

import hypothesis
import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from strata import _cpu_experts
from strata.engine.cache import rates as rates_module
from strata.engine.cache.build import default_stream_misses, staging_blobs
from strata.engine.cache.kept_rates import (
    FORMAT,
    RatesError,
    auto_split,
    kept_rates,
    rates_path,
    resolve_stream_misses,
)
from strata.engine.cache.rate_calls import TimedCalls, samples, synthetic_store
from strata.engine.cache.rates import MissRates, RatesKey, balanced_split, measure_rates
from strata.engine.experts.cpu import CpuExperts
from strata.engine.experts.quant import dequantize_blobs, expert_blob_bytes, int8_blob_bytes
from strata.engine.experts.routed import Routed
from strata.engine.experts.streamed import StreamedMisses, StreamSplit
from strata.engine.model.config import ModelConfig
from strata.engine.runtime.generate import GenerateOptions, generate
from support.bench_scripts import load_bench
from support.cache_models import cached_model
from support.checkpoints import cached_checkpoint

CPU = torch.device("cpu")
SMALL_BYTES = 1 << 20  # the synthetic store of a measurement here: a MiB, a few layers
PROMPT = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
OPTIONS = GenerateOptions(max_new=8, max_context=128, temperature=0.0, ignore_stop=True,
                          prefill_chunk=48)


@pytest.fixture(scope="module")
def small():
    """(checkpoint, config): qwen3_moe small, fp32: L=4, E=16, K=4."""
    ckpt = cached_checkpoint("qwen3_moe", "small", dtype=torch.float32)
    return ckpt, ModelConfig.from_dir(ckpt)


def _rates(stream, cpu, blob=1000):
    return MissRates(tuple(float(t) for t in stream), tuple(float(t) for t in cpu), blob)


# --- the split's arithmetic ---
def test_proportional_times_split_by_the_rates():
    # Streaming an expert takes 2 units, computing one on the CPU 3: the stream's rate is 1.5x
    # the CPU's, so of M misses about M * 3/5 stream: s = round(M * c / (c + p)).
    rates = _rates([2 * k for k in range(9)], [3 * k for k in range(9)])
    split = rates.split()
    assert split.counts == (0, 1, 1, 2, 2, 3, 4, 4, 5)
    for m, s in enumerate(split.counts):
        assert abs(s - m * 3 / 5) <= 0.5 + 1e-9
    assert split.n_blobs == 5 and split.top_k == 8
    assert rates.stream_bytes_per_s == pytest.approx(1000 / 2)
    assert rates.cpu_bytes_per_s == pytest.approx(1000 / 3)


def test_a_tie_streams_fewer_and_fixed_costs_count():
    # Equal rates: one miss could go either way; the CPU keeps it (no upload).
    assert balanced_split((0.0, 1.0, 2.0), (0.0, 1.0, 2.0)) == (0, 0, 1)
    # A stream with a large fixed cost per call: one miss stays on the CPU, many share.
    stream = (0.0, *(10.0 + k for k in range(1, 9)))
    cpu = tuple(3.0 * k for k in range(9))
    counts = balanced_split(stream, cpu)
    assert counts[:4] == (0, 0, 0, 0) and counts[8] > 0
    for m, s in enumerate(counts):  # nothing better exists
        assert max(stream[s], cpu[m - s]) == min(max(stream[t], cpu[m - t])
                                                 for t in range(m + 1))
    # The CPU never finishes (a kernel far slower than the bus): everything streams.
    assert balanced_split((0.0, 1.0, 2.0), (0.0, 100.0, 200.0)) == (0, 1, 2)


def test_a_joint_table_splits_by_the_fastest_call_over_the_sides_rates():
    """Timed together, a call's fastest s wins, whatever the sides alone say (here they say
    half; the calls say: stream everything but one miss, never one alone); a tie streams
    fewer."""
    alone = ([float(k) for k in range(5)], [float(k) for k in range(5)])
    joint = ((0.0,), (1.0, 1.0), (2.0, 1.5, 1.8), (3.0, 2.5, 2.0, 2.2), (4.0, 3.5, 3.0, 2.6, 2.9))
    rates = MissRates(*map(tuple, alone), 1000, joint_s=joint)
    assert rates.split("calls").counts == (0, 0, 1, 2, 3)
    assert _rates(*alone).split().counts == balanced_split(*map(tuple, alone))
    entry = rates.as_entry()
    assert entry["joint_s"] == [list(row) for row in joint]
    assert MissRates.from_entry(entry, "here").joint_s == joint
    assert MissRates.from_entry({k: v for k, v in entry.items() if k != "joint_s"},
                                "an earlier strata's").joint_s == ()
    assert "both sides timed together in whole calls" in rates.note(rates.split(), 4)
    for name in ("joint_s", "staged_s"):
        for bad in (((0.0,), (1.0,)), ((1.0,), (1.0, 1.0), (2.0, 1.5, 1.8)),
                    ((0.0,), (1.0, math.nan), (2.0, 1.5, 1.8)), ((0.0,), (1.0, 1.0))):
            with pytest.raises(ValueError, match=f"{name} must be"):
                MissRates((0.0, 1.0, 2.0), (0.0, 1.0, 2.0), 1000, **{name: bad})


def test_split_calls_timed_come_first_and_an_older_entry_splits_as_it_did():
    """A decode round on CUDA splits its calls around the graphs: their times (`staged_s`)
    choose the split over the whole calls' (`joint_s`); an entry kept without them (an
    earlier strata's) keeps the whole calls' split, and one without either the sides'."""
    alone = (tuple(float(k) for k in range(4)), tuple(float(k) for k in range(4)))
    joint = ((0.0,), (1.0, 1.0), (2.0, 1.5, 1.8), (3.0, 2.5, 2.0, 2.2))  # whole: 0, 1, 2
    staged = ((0.0,), (1.0, 0.5), (2.0, 1.2, 0.9), (3.0, 2.0, 1.9, 1.0))  # split: 1, 2, 3
    rates = MissRates(*alone, 1000, joint_s=joint, staged_s=staged)
    assert rates.timed_calls == "split" and rates.split("calls").counts == (0, 1, 2, 3)
    assert "timed together in calls split around the graphs" in rates.note(rates.split(), 4)
    entry = rates.as_entry()
    assert entry["staged_s"] == [list(row) for row in staged]
    assert MissRates.from_entry(entry, "here") == dataclasses.replace(rates, source="here")
    older = MissRates.from_entry({k: v for k, v in entry.items() if k != "staged_s"}, "older")
    assert older.timed_calls == "whole" and older.split("calls").counts == (0, 0, 1, 2)
    oldest = MissRates.from_entry({k: v for k, v in entry.items()
                                   if k not in ("staged_s", "joint_s")}, "oldest")
    assert oldest.timed_calls == "" and oldest.split().counts == balanced_split(*alone)


def _grid(k: int, stream_fixed: float, stream_each: float, cpu_fixed: float,
          cpu_each: float) -> tuple[tuple[float, ...], ...]:
    """A grid of split calls timed as max(the stream's, the CPU's) with fixed costs a side."""
    def side(fixed: float, each: float, n: int) -> float:
        return fixed + each * n if n else 0.0

    return ((0.0,), *(tuple(max(side(stream_fixed, stream_each, s),
                                side(cpu_fixed, cpu_each, m - s)) for s in range(m + 1))
                      for m in range(1, k + 1)))


def test_the_slopes_rule_balances_the_per_expert_times_without_the_calls_fixed_costs(
        monkeypatch):
    """Calls that carry a large fixed cost on the CPU's side (a team waking after the timing's
    gap) make each M's fastest call stream more than the two sides' per-expert times balance:
    the "slopes" rule (the default before "slopes-upload") fits those times to the calls that
    use one side alone and balances them; "calls" keeps the fastest call."""
    grid = _grid(8, stream_fixed=0.25, stream_each=0.086, cpu_fixed=0.6, cpu_each=0.083)
    alone = (tuple(0.086 * k for k in range(9)), tuple(0.083 * k for k in range(9)))
    rates = MissRates(*alone, 1000, staged_s=grid)
    stream_t, cpu_t = rates_module.per_expert_s(grid)
    assert stream_t == pytest.approx(0.086) and cpu_t == pytest.approx(0.083)
    slopes = rates.split("slopes").counts
    assert slopes == balanced_split(tuple(0.086 * k for k in range(9)),
                                    tuple(0.083 * k for k in range(9)))
    assert slopes == (0, 0, 1, 1, 2, 2, 3, 3, 4)
    monkeypatch.setattr(rates_module, "SPLIT_RULE", "slopes")
    assert rates.split().counts == slopes
    assert "calls split around the graphs, their per-expert times balanced, " in \
        rates.note(rates.split(), 4)
    calls = rates.split("calls").counts
    assert calls == tuple(row.index(min(row)) for row in grid)
    assert sum(calls) > sum(slopes)  # the CPU's fixed cost pushes the fastest calls to stream
    assert MissRates(*alone, 1000, joint_s=grid).split("slopes").counts == slopes  # whole calls
    monkeypatch.setattr(rates_module, "SPLIT_RULE", "calls")  # the rule before, for the A/B
    assert rates.split().counts == calls
    assert "calls split around the graphs, each M's fastest call, " in rates.note(rates.split(), 4)
    assert MissRates(*alone, 1000).split("slopes").counts == balanced_split(*alone)  # no grid
    with pytest.raises(ValueError, match="a split rule is one of"):
        rates.split("fastest")


def test_the_slopes_upload_rule_adds_the_uploads_fixed_cost_to_the_device_s_side():
    """ "slopes-upload" balances the per-expert times as "slopes" does, with the intercept of
    the calls that stream every miss added to the device's side of any s > 0 (the CPU's
    intercept still left out): it streams no more than "slopes" for any M, and fewer where
    that fixed cost outweighs an expert's difference. It is the default (`SPLIT_RULE`)."""
    assert rates_module.SPLIT_RULE == "slopes-upload"
    grid = _grid(8, stream_fixed=0.1, stream_each=0.086, cpu_fixed=0.6, cpu_each=0.072)
    alone = (tuple(0.086 * k for k in range(9)), tuple(0.072 * k for k in range(9)))
    rates = MissRates(*alone, 1000, staged_s=grid)
    assert rates_module.upload_fixed_s(grid) == pytest.approx(0.1)
    upload = rates.split("slopes-upload").counts
    assert upload == balanced_split(tuple(0.1 * (k > 0) + 0.086 * k for k in range(9)),
                                    tuple(0.072 * k for k in range(9)))
    slopes = rates.split("slopes").counts
    assert all(u <= s for u, s in zip(upload, slopes, strict=True)) and upload != slopes
    assert rates_module.upload_fixed_s(_grid(8, 0.0, 0.086, 0.6, 0.072)) == pytest.approx(0.0)
    assert MissRates(*alone, 1000, staged_s=_grid(8, 0.0, 0.086, 0.6, 0.072)).split(
        "slopes-upload").counts == MissRates(*alone, 1000, staged_s=grid).split("slopes").counts
    assert rates.split().counts == upload
    assert "their per-expert times and the uploads' fixed cost balanced, " in \
        rates.note(rates.split(), 4)


def _kept_rates(name: str, machine: str | None = None) -> MissRates:
    """The one entry of a rates file recorded under bench/results (`machine`: the key of a
    file that holds several machines' rates files)."""
    recorded = json.loads((Path(__file__).parents[3] / "bench" / "results" / name).read_text())
    (entry,) = (recorded[machine] if machine else recorded)["entries"].values()
    return MissRates.from_entry(entry, name)


def test_the_documented_splits_of_each_rule_are_the_recorded_rates():
    """docs/expert-cache.md quotes what "slopes" and "slopes-upload" give from the kept rates
    of three H100 machines, the uploads' fixed costs and the third machine's rounds: they are
    what the rules and bench/rounds.py give from the files recorded in bench/results."""
    page = " ".join((Path(__file__).parents[3] / "docs" / "expert-cache.md").read_text().split())
    machines = [_kept_rates("split-rule-slow-host-rates-h100-2026-12-07.json"),
                _kept_rates("split-rule-rates-h100-2026-12-07.json"),
                _kept_rates("split-tables-rates-h100-2026-12-07.json",
                            "slow-host machine (calls 4-5)")]
    slopes = [rates.split("slopes").text() for rates in machines]
    upload = [rates.split("slopes-upload").text() for rates in machines]
    assert slopes == ["0,0,1,1,2,2,3,3,4", "0,0,1,1,2,2,2,3,3", "0,0,1,1,2,2,3,3,4"]
    assert f"by the slopes, {slopes[1]} on the machine of the table above" in page
    assert upload == ["0,0,1,1,1,2,2,3,3", "0,0,0,1,1,1,2,2,3", "0,0,0,1,1,2,2,3,3"]
    assert f"gives {upload[0]}, {upload[1]} and {upload[2]} from the three machines" in page
    assert f"the rule split {slopes[0]}, and" in page
    fixed_us = [round(rates_module.upload_fixed_s(rates.staged_s) * 1e6) for rates in machines]
    assert fixed_us == [55, 106, 91]
    assert f"every miss ({min(fixed_us)}-{max(fixed_us)} µs on three machines)" in page
    rounds = load_bench("rounds.py")  # and the table's rounds over the rule's, as rounds.py
    results = Path(__file__).parents[3] / "bench" / "results"
    ratios = {ratio["where"]: ratio for ratio in rounds.interleaved_ratios(rounds.read_lines(
        [results / "split-rule-slow-host-h100-2026-12-07.jsonl"]))
        if ratio["run"] == "decode-stream-auto-table000112233"}
    uniform, skewed = (ratios[f"split-rule-slow-host-h100-2026-12-07.jsonl:{n}"]["median"]
                       for n in (1, 2))
    assert f"took {uniform:.3f}x its rounds uniform and {skewed:.3f}x skewed" in page


def test_the_documented_rounds_of_the_upload_rule_are_the_recorded_ones():
    """docs/expert-cache.md's case for "slopes-upload" as the rule and for the repeated median:
    the splits the rounds took (each run's `split` in the recorded lines), the rounds' medians
    (bench/rounds.py), and what least squares' fallback and the fit now read from the kept
    calls recorded on 2026-12-08."""
    page = " ".join((Path(__file__).parents[3] / "docs" / "expert-cache.md").read_text().split())
    name = "split-rule-upload-h100-2026-12-08"
    first, second = (_kept_rates("split-rule-upload-rates-h100-2026-12-08.json", machine)
                     for machine in ("first machine (calls 1-2)", "second machine (call 3)"))
    rounds = load_bench("rounds.py")
    documents = rounds.read_lines([Path(__file__).parents[3] / "bench" / "results" /
                                   f"{name}-call{n}.jsonl" for n in (1, 2, 3)])
    medians = {(ratio["where"], ratio["run"].removeprefix("decode-stream-auto-")):
               ratio["median"] for ratio in rounds.interleaved_ratios(documents)}
    split = {(document["file"], document["line"], run): document["runs"][run]["split"]
             for document in documents for run in document["runs"]}
    for call in (1, 3):
        where = [f"{name}-call{call}.jsonl:{line}" for line in (1, 2)]
        assert (f"| {split[f'{name}-call{call}.jsonl', 1, 'decode-stream-auto']} | "
                f"{split[f'{name}-call{call}.jsonl', 1, 'decode-stream-auto-ruleslopes-upload']}"
                f" | {medians[where[0], 'ruleslopes-upload']:.3f} | "
                f"{medians[where[1], 'ruleslopes-upload']:.3f} |") in page
    tables = [medians[f"{name}-call1.jsonl:{line}", table]
              for line in (1, 2) for table in ("table001122233", "table000112233")]
    assert ("the two tables {:.3f}x and {:.3f}x uniform, {:.3f}x and {:.3f}x skewed"
            .format(*tables)) in page
    after = [medians[f"{name}-call2.jsonl:{line}", "table001122233"] for line in (1, 2)]
    assert f"took {after[0]:.3f}x and {after[1]:.3f}x its rounds" in page
    cpu_calls = [second.staged_s[m][0] * 1e6 for m in (4, 5, 8)]
    assert f"put an expert on the CPU at {cpu_calls[2] / 8:.0f} µs," in page  # the fallback
    assert f"took {cpu_calls[0]:,.0f} µs where the next took {cpu_calls[1]:,.0f}" in page
    assert f"reads {rates_module.per_expert_s(second.staged_s)[1] * 1e6:.0f} µs an expert on " \
        f"the CPU and splits {second.split().text()} by the rule" in page
    assert f"{first.split().text()} on the first ({tables[1]:.3f}x and {tables[3]:.3f}x" in page


def test_the_documented_note_has_the_form_strata_prints():
    """docs/expert-cache.md shows the startup note of a kept split (its figures illustrate):
    its words are those `MissRates.note` prints (`strata: ` first, as the CLI says a note) for
    rates timed in split calls, under the default rule."""
    page = Path(__file__).parents[3] / "docs" / "expert-cache.md"
    documented = [line for line in page.read_text().splitlines()
                  if line.startswith("strata: --stream-misses auto:")]
    assert len(documented) == 1
    each = (0.086, 0.083)
    rates = MissRates(*(tuple(t * k for k in range(9)) for t in each), 1000,
                      source="read from ~/.cache/strata/rates.json (measured 2026-12-07)",
                      staged_s=_grid(8, 0.25, each[0], 0.6, each[1]))
    printed = "strata: " + rates.note(rates.split(), 16)
    figures = re.compile(r"\d[\d.,]*\d|\d")  # a number, a table of counts, a date's parts
    assert figures.sub("#", documented[0]) == figures.sub("#", printed)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(m=st.integers(4, 8), alone=st.sampled_from(["stream", "cpu"]),
                  factor=st.floats(0, 5), stream_fixed=st.floats(0, 1),
                  stream_each=st.floats(0.01, 1), cpu_each=st.floats(0.01, 1))
def test_one_noisy_call_of_five_leaves_each_side_s_line(m, alone, factor, stream_fixed,
                                                        stream_each, cpu_each):
    """The two sides' lines are fitted over M = 4..8 by the repeated median: one of those five
    calls timed at any multiple of its time (a noisy median, as an H100's kept CPU calls had
    on 2026-12-08) leaves both slopes and the uploads' fixed cost as they were."""
    grid = [list(row) for row in _grid(8, stream_fixed, stream_each, 0.6, cpu_each)]
    grid[m][m if alone == "stream" else 0] *= factor
    noisy = tuple(map(tuple, grid))
    assert rates_module.per_expert_s(noisy) == pytest.approx((stream_each, cpu_each))
    assert rates_module.upload_fixed_s(noisy) == pytest.approx(stream_fixed)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(k=st.integers(2, 8), stream_fixed=st.floats(0, 1), cpu_fixed=st.floats(0, 1),
       stream_each=st.floats(0.01, 1), cpu_each=st.floats(0.01, 1))
def test_the_slopes_are_each_side_s_time_an_expert_whatever_its_fixed_cost(
        k, stream_fixed, cpu_fixed, stream_each, cpu_each):
    grid = _grid(k, stream_fixed, stream_each, cpu_fixed, cpu_each)
    stream_t, cpu_t = rates_module.per_expert_s(grid)
    assert stream_t == pytest.approx(stream_each) and cpu_t == pytest.approx(cpu_each)
    counts = MissRates(tuple(stream_each * n for n in range(k + 1)),
                       tuple(cpu_each * n for n in range(k + 1)), 1000,
                       staged_s=grid).split("slopes").counts
    for m, s in enumerate(counts):  # no s finishes both sides sooner, at the slopes
        assert max(s * stream_t, (m - s) * cpu_t) <= min(
            max(t * stream_t, (m - t) * cpu_t) for t in range(m + 1)) + 1e-12


def test_a_slope_that_noise_makes_non_positive_is_the_largest_call_over_its_experts():
    grid = list(_grid(4, stream_fixed=0.0, stream_each=1.0, cpu_fixed=0.0, cpu_each=2.0))
    grid[3] = (*grid[3][:3], 5.0)  # the all-streamed calls at M = 2..4: 2, 5, 4: slope 1.0
    grid[2] = (6.0, *grid[2][1:])  # the all-CPU calls at M = 2..4: 6, 6, 4: falling,
    grid[4] = (4.0, *grid[4][1:])  # so M = 4's call over its 4 experts
    stream_t, cpu_t = rates_module.per_expert_s(tuple(grid))
    assert stream_t == pytest.approx(1.0) and cpu_t == pytest.approx(1.0)


def test_the_split_table_checks_itself():
    assert StreamSplit.fixed(2, 4).counts == (0, 1, 2, 2, 2)
    assert StreamSplit.fixed(0, 2).n_blobs == 0
    split = StreamSplit((0, 1, 1))
    assert split.streamed(2) == 1 and split.streamed(7) == 1  # beyond K: as at K
    for bad in [(), (1, 1), (0, 2), (0, 1, -1), (0, True)]:
        with pytest.raises(ValueError, match="a stream split is"):
            StreamSplit(bad)
    with pytest.raises(ValueError, match="n_blobs must be an int >= 0"):
        StreamSplit.fixed(-1, 4)
    assert staging_blobs(split) == 1 and staging_blobs(3) == 3
    with pytest.raises(ValueError, match="an int >= 0 or a StreamSplit"):
        staging_blobs("auto")


def test_the_rates_check_their_tables():
    for stream, cpu in [((0.0,), (0.0,)), ((0.0, 1.0), (0.0, 1.0, 2.0)),
                        ((1.0, 1.0), (0.0, 1.0)), ((0.0, math.nan), (0.0, 1.0)),
                        ((0.0, -1.0), (0.0, 1.0))]:
        with pytest.raises(ValueError):
            MissRates(stream, cpu, 100)


def test_the_streamer_follows_the_split(small):
    from strata.engine.model.checkpoint import Checkpoint, expert_store
    ckpt = Checkpoint.open(small[0])
    try:
        store = expert_store(ckpt)
    finally:
        ckpt.close()
    streamer = StreamedMisses(store, CPU, 2, StreamSplit((0, 0, 1, 2, 2)))
    one = Routed.of(np.array([[5, 1, 3, 9]]), np.array([[True, False, False, False]]))
    streamed, rest = streamer.split(one)
    assert streamed is None and rest is one  # one miss: the CPU's
    three = Routed.of(np.array([[5, 1, 3, 9]]), np.array([[True, True, False, True]]))
    streamed, rest = streamer.split(three)
    assert streamed.experts.tolist() == [1, 5] and rest.experts.tolist() == [9]
    with pytest.raises(ValueError, match="the split streams up to 2 experts, the staging "
                                         "buffer holds 1"):
        StreamedMisses(store, CPU, 1, StreamSplit((0, 1, 2)))


# --- measuring and keeping ---
def test_the_host_twin_measures_and_the_file_keeps_it(small, tmp_path, monkeypatch):
    _, config = small
    path = tmp_path / "rates.json"
    calls = []
    key = RatesKey.of(config, torch.float32, CPU, cpu_threads=1)

    def measure():
        calls.append(1)
        return measure_rates(key, torch.float32, CPU, cpu_threads=1, repeat=2,
                             target_bytes=SMALL_BYTES)

    first = kept_rates(key, measure, path)
    assert calls == [1] and first.source == f"measured now, kept in {path}"
    assert first.top_k == config.top_k and first.blob_bytes == key.blob_bytes
    for table in (first.stream_s, first.cpu_s):
        assert table[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(table))
        assert table[-1] > 0
    # Each M's calls timed for s = 0..M streamed, whole and split around the graphs; the
    # split balances the split calls' per-expert times, the uploads' fixed cost on the
    # device's side ("calls": their fastest).
    for grid in (first.joint_s, first.staged_s):
        assert [len(row) for row in grid] == list(range(1, config.top_k + 2))
        assert all(t > 0 for row in grid[1:] for t in row)
    assert first.timed_calls == "split"
    stream_t, cpu_t = rates_module.per_expert_s(first.staged_s)
    fixed_s = rates_module.upload_fixed_s(first.staged_s)
    ks = range(config.top_k + 1)
    assert first.split().counts == balanced_split(
        tuple(fixed_s * (k > 0) + k * stream_t for k in ks), tuple(k * cpu_t for k in ks))
    assert first.split("calls").counts == tuple(row.index(min(row)) for row in first.staged_s)
    again = kept_rates(key, measure, path)
    assert calls == [1]  # read, not measured again
    assert again.source.startswith(f"read from {path} (measured ")
    assert (again.stream_s, again.cpu_s, again.joint_s, again.staged_s) == (
        first.stream_s, first.cpu_s, first.joint_s, first.staged_s)
    assert again.split().counts == first.split().counts
    document = json.loads(path.read_text())
    assert document["format"] == FORMAT and list(document["entries"]) == [key.text()]
    assert "cpu" in key.text() and "1 threads, team 1, torch kernel" in key.text() \
        and "float32" in key.text()
    # The team a split call's CPU share runs on is part of the key: rates timed on another
    # team (before `default_team`, one short of the threads) are another entry.
    assert "| 16 threads, team 12, " in RatesKey.of(config, torch.float32, CPU, 16).text()
    # Another key (another thread count) is another entry beside it.
    other = RatesKey.of(config, torch.float32, CPU, cpu_threads=2)
    kept_rates(other, lambda: first, path)
    assert set(json.loads(path.read_text())["entries"]) == {key.text(), other.text()}
    # strata's kernel is named with its revision and prefetch distance: rates kept before a
    # change of either are another key, measured anew.
    bf16 = RatesKey.of(config, torch.bfloat16, CPU, cpu_threads=1)
    assert bf16.kernel == "strata-r3-pf4096" and "strata-r3-pf4096 kernel" in bf16.text()
    monkeypatch.setattr(_cpu_experts, "PREFETCH_BYTES", 0)
    assert RatesKey.of(config, torch.bfloat16, CPU, cpu_threads=1).text() != bf16.text()
    monkeypatch.setattr(_cpu_experts, "PREFETCH_BYTES", 4096)
    monkeypatch.setattr(_cpu_experts, "REVISION", 1)
    assert RatesKey.of(config, torch.bfloat16, CPU, cpu_threads=1).text() != bf16.text()


def test_the_key_names_how_the_calls_were_timed(small, tmp_path):
    """Rates timed otherwise by an earlier strata (back to back; in a round's gaps with the
    caller's OpenMP pool left grown; with its regrowth timed as one expert's CPU time; with its
    shrink timed as the first split call's) are another key than rates timed as a round runs
    its calls now: a file holding only them is measured anew, not read."""
    _, config = small
    key = RatesKey.of(config, torch.bfloat16, CPU, cpu_threads=1)
    assert key.timing == rates_module.TIMING == "round-gap500us-shrunk-grouped-grown-primed"
    assert key.text().endswith("| timed round-gap500us-shrunk-grouped-grown-primed")
    path = tmp_path / "rates.json"
    older = _rates([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], key.blob_bytes)
    for timing in ("back-to-back", "round-gap500us", "round-gap500us-shrunk",
                   "round-gap500us-shrunk-grouped", "round-gap500us-shrunk-grouped-grown"):
        kept_rates(dataclasses.replace(key, timing=timing), lambda: older, path)
    measured = []
    kept = kept_rates(key, lambda: measured.append(1) or _rates(
        [0, 2, 4, 6, 8], [0, 1, 2, 3, 4], key.blob_bytes), path)
    assert measured == [1] and kept.stream_s == (0.0, 2.0, 4.0, 6.0, 8.0)
    assert len(json.loads(path.read_text())["entries"]) == 6  # the older entries stay


def _bf16_calls(gap_s: float, device: torch.device = CPU) -> TimedCalls:
    """Timed calls over a bf16 synthetic store (strata's kernel, which the CPU's thread takes):
    D 64, F 32, K 4, on `device` (pinned on CUDA)."""
    store = synthetic_store(64, 32, 4, torch.bfloat16, device.type == "cuda", 1 << 16)
    return TimedCalls(store, 4, device, 2, gap_s=gap_s)


@pytest.mark.parametrize("device", [CPU, pytest.param(torch.device("cuda"),
                                                      marks=pytest.mark.cuda)])
def test_a_split_call_is_timed_as_a_round_runs_it(device):
    """After an untimed gap, the CPU's share on its own thread while the uploads are queued:
    its rows are `compute`'s, and the gap is not in the time."""
    # One call first on calls of their own: on CUDA its kernels are compiled then (a tenth of
    # a second on a fresh machine, which the timed call below must not pay), and the calls
    # timed here still start at the store's first layer.
    _bf16_calls(gap_s=0.0, device=device).call(3, 1, split=True)
    calls = _bf16_calls(gap_s=0.05, device=device)
    assert calls.splits  # the host twin; on CUDA, the Triton kernels the engine splits with
    started = time.perf_counter()
    taken = calls.call(3, 1, split=True)  # 2 on the CPU, 1 streamed
    assert time.perf_counter() - started >= 0.05 > taken
    assert calls.cpu_started == 1
    layer = 1  # the call's CPU share read the store's second layer (round robin)
    expected = calls.cpu.compute(layer, calls.x_host[:2], calls.routed[2])
    assert torch.equal(calls.out[:2], expected)
    assert calls.call(2, 2, split=True) > 0 and calls.cpu_started == 1  # no CPU share
    assert calls.call(3, 1, split=False) > 0 and calls.cpu_started == 1  # whole: inline


def test_the_engine_threads_calls_and_the_split_calls_are_timed_apart_each_round(monkeypatch):
    """A round of samples grows the caller's OpenMP pool untimed, times the engine thread's
    calls, shrinks the pool again with an untimed split call, then times the split ones: the
    pool is shrunk once a round and by no timed call (the first split call of a round timed the
    shrink before: 1.3-1.5x the next M's on two H100 machines), as no round of decode makes and
    lets go of its threads each layer, and made again before the engine thread's first timed
    call."""
    calls = _bf16_calls(gap_s=0.0)
    order, shrunk, timed = [], [], []
    monkeypatch.setattr(_cpu_experts, "shrink_team", lambda: shrunk.append(len(order)))
    for name in ("grow_caller_team", "shrink_caller_team", "stream", "on_cpu", "call"):
        real = getattr(calls, name)
        monkeypatch.setattr(calls, name, lambda *a, real=real, name=name, **kw: (
            order.append("split" if kw.get("split") else name), real(*a, **kw))[1])
    repeat, top_k = 2, 4
    stream, cpu, joint, staged = samples(calls, top_k, repeat)
    assert all(len(stream[k]) == len(cpu[k]) == repeat for k in range(1, top_k + 1))
    assert all(len(joint[m][s]) == len(staged[m][s]) == repeat
               for m in range(1, top_k + 1) for s in range(m + 1))
    per_round = len(order) // (repeat + 1)
    n_split = sum(m + 1 for m in range(1, top_k + 1))  # (M, s) pairs
    for round_ in range(repeat + 1):
        kinds = order[round_ * per_round:(round_ + 1) * per_round]
        assert kinds[0] == "grow_caller_team" and kinds.count("grow_caller_team") == 1
        # the untimed split call (its own `call` inside) just before the timed ones
        assert kinds[-n_split - 2:-n_split] == ["shrink_caller_team", "split"]
        assert kinds[-n_split:] == ["split"] * n_split and "split" not in kinds[:-n_split - 2]
        timed.append((round_ + 1) * per_round - n_split)  # the round's first timed split call
    # once a round, inside the untimed split call, so before the round's first timed one (a
    # shrink's position is the count of calls begun before it)
    assert shrunk == timed
    assert calls.cpu_started == (repeat + 1) * (n_split - top_k + 1)  # s < M, and the priming


def test_a_failed_upload_still_waits_for_the_cpus_thread(monkeypatch):
    """Fault injection: the uploads raise while the CPU's thread computes into the kept
    buffer; the call waits for that thread before the error leaves it, and the next call
    runs."""
    calls = _bf16_calls(gap_s=0.0)
    finished = []
    real_finish = calls.cpu.finish
    monkeypatch.setattr(calls.cpu, "finish", lambda: (real_finish(), finished.append(1)))
    monkeypatch.setattr(calls.streamer, "stage", lambda *a: (_ for _ in ()).throw(
        RuntimeError("injected: the upload failed")))
    with pytest.raises(RuntimeError, match="injected"):
        calls.call(4, 1, split=True)
    assert finished == [1]
    monkeypatch.undo()
    assert calls.call(4, 1, split=True) > 0 and calls.cpu_started == 1


def test_auto_split_reads_the_cache_dir(small, tmp_path, monkeypatch):
    _, config = small
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))
    assert rates_path() == tmp_path / "cache" / "rates.json"
    split, rates = auto_split(config, torch.float32, CPU, cpu_threads=1,
                              target_bytes=SMALL_BYTES)
    assert (tmp_path / "cache" / "rates.json").is_file() and "measured now" in rates.source
    again, rates2 = auto_split(config, torch.float32, CPU, cpu_threads=1)
    assert again.counts == split.counts and "read from" in rates2.source
    note = rates2.note(again, 1)
    assert note.startswith(f"--stream-misses auto: of M = 0..{config.top_k} missed experts")
    assert "GB/s" in note and "read from" in note


def test_a_quantized_store_has_rates_of_its_own(small, tmp_path):
    """int8 experts are half a bf16 blob's bytes, read by the kernel's int8 code and uploaded
    at their own size: their split is measured over int8 blobs, kept beside the bf16 entry,
    whose key names no format."""
    _, config = small
    path = tmp_path / "rates.json"
    bf16 = RatesKey.of(config, torch.bfloat16, CPU, cpu_threads=1)
    int8 = RatesKey.of(config, torch.bfloat16, CPU, cpu_threads=1, quant="int8")
    assert bf16.quant is None and "experts in" not in bf16.text()
    assert "| bfloat16 experts in int8 |" in int8.text() and int8.text() != bf16.text()
    assert int8.blob_bytes == int8_blob_bytes(config.expert_width, config.hidden_size) \
        < bf16.blob_bytes
    with pytest.raises(ValueError, match=r"fmt must be one of .*, got 'int3'"):
        RatesKey.of(config, torch.bfloat16, CPU, cpu_threads=1, quant="int3")
    split, rates = auto_split(config, torch.bfloat16, CPU, cpu_threads=1, path=path,
                              target_bytes=SMALL_BYTES, quant="int8")
    assert rates.blob_bytes == int8.blob_bytes and "measured now" in rates.source
    assert split.counts == rates.split().counts and rates.timed_calls == "split"
    assert list(json.loads(path.read_text())["entries"]) == [int8.text()]
    auto_split(config, torch.bfloat16, CPU, cpu_threads=1, path=path, target_bytes=SMALL_BYTES)
    assert set(json.loads(path.read_text())["entries"]) == {int8.text(), bf16.text()}
    again, kept = auto_split(config, torch.bfloat16, CPU, cpu_threads=1, path=path,
                             quant="int8")
    assert "read from" in kept.source and (kept.stream_s, kept.staged_s) == (
        rates.stream_s, rates.staged_s) and again.counts == split.counts


@pytest.mark.parametrize("quant", ["int8", "int4-g32"])
def test_the_synthetic_store_holds_blobs_of_the_format(quant):
    """The CPU's kernel computes the synthetic quantized experts as the dequantized weights
    say (what the rates time is that format's real work, on real blobs)."""
    store = synthetic_store(64, 32, 4, torch.bfloat16, False, 1 << 16, quant)
    try:
        assert store.quant == quant and store.blob_bytes == expert_blob_bytes(
            32, 64, torch.bfloat16, quant)
        x = torch.full((1, 64), 0.5, dtype=torch.bfloat16)  # [1, D]
        out = CpuExperts(store, 1).compute(1, x, Routed.of(np.array([[2]])))  # [1, D]
        gate_up, down = dequantize_blobs(store.blob(1, 2)[None], quant, 32, 64, torch.float32)
        gate, up = gate_up[0].float().chunk(2)  # [F, D] each
        act = torch.nn.functional.silu(x.float() @ gate.T) * (x.float() @ up.T)  # [1, F]
        expected = act @ down[0].float().T  # [1, D]
        assert out.abs().max() > 0
        torch.testing.assert_close(out.float(), expected, rtol=0.02, atol=0.002)
    finally:
        store.close()


@pytest.mark.parametrize(("content", "why"), [
    ("{not json", "not JSON"),
    ('["a list"]', 'not an object with "entries"'),
    ('{"format": 99, "entries": {}}', "format 99, this strata reads 1"),
])
def test_a_bad_file_is_an_error_not_measured_over(small, tmp_path, content, why):
    # Measuring again would quietly change the split, and so the output bytes, against the
    # runs that read the file before: the error says so and how to measure again.
    _, config = small
    path = tmp_path / "rates.json"
    path.write_text(content)
    key = RatesKey.of(config, torch.float32, CPU, cpu_threads=1)
    with pytest.raises(RatesError) as err:
        kept_rates(key, lambda: pytest.fail("measured over a bad file"), path)
    message = str(err.value)
    assert str(path) in message and why in message
    assert "delete it to measure the rates again" in message and "--stream-misses N" in message
    assert path.read_text() == content  # left as it was


def test_a_bad_entry_is_an_error(small, tmp_path):
    _, config = small
    path = tmp_path / "rates.json"
    key = RatesKey.of(config, torch.float32, CPU, cpu_threads=1)
    entry = _rates([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], key.blob_bytes).as_entry()
    for broken in [{**entry, "cpu_s": [0.0, -1.0, 2.0, 3.0, 4.0]}, {"stream_s": [0.0]},
                   {**entry, "blob_bytes": key.blob_bytes + 1}, "text"]:
        path.write_text(json.dumps({"format": FORMAT, "entries": {key.text(): broken}}))
        with pytest.raises(RatesError, match=r"the entry .* delete it"):
            kept_rates(key, lambda: pytest.fail("measured over a bad entry"), path)


def test_an_unwritable_cache_dir_is_an_error_unless_it_holds_the_rates(small, tmp_path):
    # Rates measured but not kept would be measured again, and split otherwise, next run.
    _, config = small
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    key = RatesKey.of(config, torch.float32, CPU, cpu_threads=1)
    with pytest.raises(RatesError, match=r"cannot keep the measured miss rates in .*; set "
                                         r"STRATA_CACHE_DIR to a writable directory"):
        kept_rates(key, lambda: pytest.fail("measured"), blocker / "rates.json")
    # A directory that holds them but takes no lock (read-only: an image made on the
    # machine; here the lock's name is a directory, which even root cannot open) is read.
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    rates = _rates([0, 1, 2, 3, 4], [0, 2, 4, 6, 8], key.blob_bytes)
    kept_rates(key, lambda: rates, shipped / "rates.json")
    (shipped / "rates.json.lock").unlink()
    (shipped / "rates.json.lock").mkdir()
    got = kept_rates(key, lambda: pytest.fail("measured"), shipped / "rates.json")
    assert got.split() == rates.split() and "read from" in got.source
    other = RatesKey.of(config, torch.float32, CPU, cpu_threads=2)
    with pytest.raises(RatesError, match="cannot keep the measured miss rates"):
        kept_rates(other, lambda: pytest.fail("measured"), shipped / "rates.json")


# --- the option ---
def test_the_option_resolves(small, tmp_path):
    _, config = small
    path = tmp_path / "rates.json"  # never written: nothing here measures
    k = config.top_k
    assert resolve_stream_misses(None, config, torch.float32, CPU, path=path) == (0, [])
    assert resolve_stream_misses("auto", config, torch.float32, CPU, path=path) == (0, [])
    assert resolve_stream_misses(2, config, torch.float32, CPU, path=path) == (2, [])
    assert resolve_stream_misses(k, config, torch.float32, CPU, path=path) == (k, [])
    for bad in (-1, k + 1, "half", 1.5, True):
        with pytest.raises(ValueError, match=rf"--stream-misses must be auto or in \[0, {k}\]"):
            resolve_stream_misses(bad, config, torch.float32, CPU, path=path)
    assert not path.exists()


def test_the_kept_split_gives_the_same_bytes_run_to_run(small, tmp_path):
    # The host twin's split, through the cache: a split from the same file is the same split,
    # so two runs give the same tokens and logits; and it streams what the table says.
    ckpt, config = small
    path = tmp_path / "rates.json"
    # A stream as fast as the CPU, plus a fixed cost: one miss stays on the CPU, more share.
    key = RatesKey.of(config, torch.float32, CPU)
    k = config.top_k
    fixed = _rates([0.0, *(0.5 + t for t in range(1, k + 1))], list(range(k + 1)),
                   key.blob_bytes)
    kept_rates(key, lambda: fixed, path)
    runs = []
    for _ in range(2):
        split, _ = auto_split(config, torch.float32, CPU, path=path)
        assert split.counts == balanced_split(fixed.stream_s, fixed.cpu_s)
        assert split.counts[1] == 0 and split.n_blobs > 0
        model = cached_model(ckpt, expert_cache_mib=12, stream_misses=split)
        try:
            assert model.experts.stream_misses == split.n_blobs
            runs.append(generate(model, None, PROMPT, OPTIONS))
        finally:
            model.experts.close()
    a, b = runs
    assert a.tokens == b.tokens and torch.equal(a.first_logits, b.first_logits)
    decode = a.cache.decode
    assert decode.streamed_experts > 0 and decode.cpu_experts > 0
    assert decode.uploaded_bytes >= decode.streamed_experts * fixed.blob_bytes


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "quant"), [(torch.float32, None),
                                              (torch.bfloat16, "int8")])
def test_auto_on_cuda_measures_once_and_repeats(small, tmp_path, dtype, quant):
    _, config = small
    path = tmp_path / "rates.json"
    cuda = torch.device("cuda")
    split, notes = resolve_stream_misses("auto", config, dtype, cuda, path=path, quant=quant)
    assert isinstance(split, StreamSplit) and "measured now" in notes[0]
    again, notes = resolve_stream_misses("auto", config, dtype, cuda, path=path, quant=quant)
    assert again == split and "read from" in notes[0]
    entries = json.loads(path.read_text())["entries"]
    assert list(entries) == [RatesKey.of(config, dtype, cuda, quant=quant).text()]
    rates = MissRates.from_entry(next(iter(entries.values())), "")
    assert rates.stream_bytes_per_s > 0 and rates.cpu_bytes_per_s > 0
    assert rates.blob_bytes == expert_blob_bytes(config.expert_width, config.hidden_size,
                                                 dtype, quant)
    # Not given, it is auto too (the default): the same kept split.
    default, notes = resolve_stream_misses(None, config, dtype, cuda, path=path, quant=quant)
    assert default == split and "read from" in notes[0]


def test_the_engine_options_take_auto(small, tmp_path, monkeypatch):
    from strata.engine.runtime.options import CacheOptions, plan_cache_options
    _, config = small
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="--stream-misses must be auto or a number of experts, "
                                         "got 'half'"):
        CacheOptions(stream_misses="half")
    for given in (None, "auto"):
        plan = plan_cache_options(CacheOptions(stream_misses=given, expert_cache_mib=12), config,
                                  torch.float32, CPU, max_context=128, prefill_chunk=48)
        try:
            assert plan.config.stream_misses == 0  # off CUDA: no bus
            assert not any("--stream-misses" in note for note in plan.notes)
        finally:
            plan.config.backend.close()
    assert not (tmp_path / "rates.json").exists()


def test_the_default_measures_rates_only_for_a_cache_that_is_used(small, monkeypatch):
    # Not given, --stream-misses is auto; on CUDA its rates are resolved (measured on a first
    # run) only once a cache sized with the fixed count is known to be used: where every
    # expert fits and no cache option is given, nothing is resolved. The sizing and the
    # resolution are stood in for here (no CUDA); the cuda test below runs them for real.
    from strata.engine.runtime import options as options_module
    from strata.engine.runtime.options import CacheOptions, plan_cache_options
    _, config = small
    cuda = torch.device("cuda")
    sized, resolved = [], []

    class Resolved(Exception):
        pass

    quants = []

    def resolve(value, *args, **kwargs):
        resolved.append(value)
        quants.append(kwargs["quant"])
        raise Resolved  # past here the plan would size a CUDA cache

    monkeypatch.setattr(options_module, "resolve_stream_misses", resolve)
    for fits in (True, False):
        monkeypatch.setattr(options_module, "_all_resident",
                            lambda *args, fits=fits: sized.append(args[3]) or fits)
        try:
            plan = plan_cache_options(CacheOptions(), config, torch.bfloat16, cuda,
                                      max_context=128, prefill_chunk=48)
            assert fits and plan.config is None
        except Resolved:
            assert not fits
    assert resolved == [None]  # once: for the model that does not fit
    assert [s["stream_misses"] for s in sized] == [default_stream_misses(config, cuda)] * 2
    resolved.clear()
    for given in (CacheOptions(stream_misses="auto"), CacheOptions(expert_cache_mib=12)):
        with pytest.raises(Resolved):  # an option given: the cache is used, no sizing first
            plan_cache_options(given, config, torch.bfloat16, cuda, max_context=128,
                               prefill_chunk=48)
    assert resolved == ["auto", None] and len(sized) == 2
    # The experts' format reaches the rates: a quantized store's split is timed over its blobs.
    with pytest.raises(Resolved):
        plan_cache_options(CacheOptions(expert_cache_mib=12), config, torch.bfloat16, cuda,
                           max_context=128, prefill_chunk=48, experts_quant="int8")
    assert quants == [None, None, None, "int8"]


@pytest.mark.cuda
def test_the_default_on_cuda_measures_nothing_where_every_expert_fits(small, tmp_path,
                                                                     monkeypatch):
    from strata.engine.runtime.options import CacheOptions, plan_cache_options
    _, config = small
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    plan = plan_cache_options(CacheOptions(), config, torch.float32, torch.device("cuda"),
                              max_context=128, prefill_chunk=48)
    assert plan.config is None and not (tmp_path / "rates.json").exists()
    used = plan_cache_options(CacheOptions(cpu_threads=1), config, torch.float32,  # a cache
                              torch.device("cuda"), max_context=128, prefill_chunk=48)
    try:
        assert isinstance(used.config.stream_misses, StreamSplit)
        assert "measured now" in used.notes[-1] and (tmp_path / "rates.json").exists()
    finally:
        used.config.backend.close()


@pytest.mark.cuda
def test_auto_on_cuda_is_the_kept_split(small, tmp_path, monkeypatch):
    from strata.engine.runtime.options import CacheOptions, plan_cache_options
    _, config = small
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    plans = [plan_cache_options(CacheOptions(expert_cache_mib=12, stream_misses="auto"), config,
                                torch.float32, torch.device("cuda"), max_context=128,
                                prefill_chunk=48)
             for _ in range(2)]
    try:
        first, second = (plan.config.stream_misses for plan in plans)
        assert isinstance(first, StreamSplit) and first == second
        assert "measured now" in plans[0].notes[-1] and "read from" in plans[1].notes[-1]
    finally:
        for plan in plans:
            plan.config.backend.close()
