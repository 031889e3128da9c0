"""`strata trace` and `strata simulate`: output, determinism, and one-line errors."""

import json

import numpy as np
import pytest

from strata import cli
from strata.formats.trace import DECODE, Trace, save_trace

SYNTH = ["--layers", "3", "--experts", "8", "--top-k", "2", "--requests", "3",
         "--prompt-tokens", "4:20", "--decode-tokens", "5:15", "--prompt-chunk", "8"]


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "t.npz"
    assert cli.main(["trace", "synth", str(path), "--kind", "markov", *SYNTH]) == 0
    return path


def run(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def simulate_json(capsys, trace_path, *argv):
    status, out, err = run(capsys, "simulate", trace_path, "--json", "--quiet", *argv)
    assert status == 0, err
    return out, json.loads(out)


def test_synth_and_info(capsys, tmp_path, trace_path):
    status, out, _ = run(capsys, "trace", "info", trace_path)
    assert status == 0
    assert "n_experts       8" in out and "strata-routing-trace" in out
    status, out, _ = run(capsys, "trace", "info", trace_path, "--json")
    info = json.loads(out)
    assert (info["n_layers"], info["top_k"], info["requests"]) == (3, 2, 3)
    assert info["meta"]["synth"]["kind"] == "markov"
    again = tmp_path / "again.npz"
    run(capsys, "trace", "synth", again, "--kind", "markov", *SYNTH)
    assert again.read_bytes() == trace_path.read_bytes()


def test_simulate_json_is_complete_and_byte_identical(capsys, trace_path):
    argv = ["--policy", "static", "--policy", "lru", "--policy", "sieve", "--slots", "4,10"]
    first, data = simulate_json(capsys, trace_path, *argv)
    second, _ = simulate_json(capsys, trace_path, *argv)
    assert first == second
    assert data["format"] == "strata-simulate" and data["version"] == 1
    rows = [(r["policy"], r["slots"], r["path"]) for r in data["results"]]
    assert rows == [
        ("static", 4, "batched"), ("lru", 4, "kernel"), ("sieve", 4, "kernel"),
        ("belady", 4, "bound"), ("oracle-static", 4, "bound"),
        ("static", 10, "batched"), ("lru", 10, "kernel"), ("sieve", 10, "kernel"),
        ("belady", 10, "bound"), ("oracle-static", 10, "bound"),
    ]
    for row in data["results"]:
        assert row["hits"] + row["misses"] == row["accesses"] == data["trace"]["accesses"]
        assert row["hit_rate"] == row["hits"] / row["accesses"]
        assert len(row["per_layer"]["hits"]) == 3
        belady = next(r for r in data["results"]
                      if r["policy"] == "belady" and r["slots"] == row["slots"])
        assert row["hits"] <= belady["hits"]
    static = data["results"][0]
    assert static["hits"] == data["results"][4]["hits"]  # profile self: static is the oracle


def test_policy_opt_belongs_to_the_policy_before_it(capsys, trace_path):
    _, data = simulate_json(capsys, trace_path, "--policy", "lru", "--policy-opt",
                            "max_admits=1", "--policy", "lfu", "--policy-opt", "decay=0.5",
                            "--policy", "lru", "--slots", "6", "--bounds", "none")
    labels = [(r["policy"], r["options"]) for r in data["results"]]
    assert labels == [("lru(max_admits=1)", {"max_admits": 1}),
                      ("lfu(decay=0.5)", {"decay": 0.5, "max_admits": 4}),
                      ("lru", {"max_admits": 4})]
    # Without --policy, --policy-opt sets the default policy's options.
    _, data = simulate_json(capsys, trace_path, "--slots", "6", "--bounds", "none")
    assert [r["policy"] for r in data["results"]] == ["coldest-in-loan"]


def test_table_output(capsys, trace_path):
    status, out, _ = run(capsys, "simulate", trace_path, "--policy", "lru", "--slots", "6",
                         "--quiet", "--bounds", "belady,belady-per-layer,oracle-static")
    assert status == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"trace {trace_path}: 3 requests")
    assert "profile: self" in lines[1]
    assert lines[2].split()[:3] == ["policy", "path", "slots"]
    assert [line.split()[0] for line in lines[3:]] == [
        "lru", "belady", "belady-per-layer", "oracle-static"]


def test_plot(capsys, tmp_path, trace_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "hit.png"
    status, out, _ = run(capsys, "simulate", trace_path, "--policy", "static", "--policy",
                         "lfu", "--slots", "4,8,12", "--plot", png, "--quiet")
    assert status == 0 and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cost_model_flags_and_file(capsys, tmp_path, trace_path):
    flags = ["--device-gbps", "3000", "--host-gbps", "80", "--pcie-gbps", "25"]
    _, data = simulate_json(capsys, trace_path, "--policy", "lru", "--slots", "6", *flags,
                            "--dense-mib", "100")
    cost = data["results"][0]["cost"]
    assert cost["decode_tok_s"] > 0 and cost["decode_round_ms"] > 0
    assert data["settings"]["cost"]["expert_bytes"] == 3 * 2048 * 768 * 2  # the trace's meta
    bw = tmp_path / "bw.json"
    bw.write_text(json.dumps({"device_gbps": 3000, "host_gbps": 80, "pcie_gbps": 25}))
    _, from_file = simulate_json(capsys, trace_path, "--policy", "lru", "--slots", "6",
                                 "--bandwidths", bw, "--dense-mib", "100")
    assert from_file["results"][0]["cost"] == cost


def test_kv_grow_from_the_trace_geometry(capsys, monkeypatch, trace_path):
    # The synthetic trace records 9 MiB experts and 1 KiB per segment cell, 6 segments. With
    # 4 KiB chunks a chunk holds 4 cells: steps of 4 cells take 6 chunks (24 KiB), one slot.
    monkeypatch.setenv("STRATA_KV_GROW_INIT", "4")
    monkeypatch.setenv("STRATA_KV_GROW_STEP", "4")
    _, data = simulate_json(
        capsys, trace_path, "--policy", "coldest-in-loan", "--slots", "20", "--loan-slots",
        "2", "--kv-grow", "--floor-slots", "4", "--chunk-bytes", "4096")
    kv = data["settings"]["kv"]
    # max_context defaults to the longest request
    assert (kv["kv_segments"], kv["slot_bytes"], kv["max_context"]) == (6, 9437184, 25)
    row = data["results"][0]
    assert row["grows"] > 0 and row["gave_up_slots"] > 0 and row["kv_shortfalls"] == 0


def test_profile_files(capsys, tmp_path, trace_path):
    counts = tmp_path / "counts.npz"
    np.savez(counts, counts=np.arange(24).reshape(3, 8))
    _, data = simulate_json(capsys, trace_path, "--policy", "static", "--slots", "6",
                            "--profile", counts, "--bounds", "none")
    assert data["settings"]["profile"] == str(counts)
    _, same = simulate_json(capsys, trace_path, "--policy", "static", "--slots", "6",
                            "--profile", trace_path, "--bounds", "none")
    _, self_ = simulate_json(capsys, trace_path, "--policy", "static", "--slots", "6",
                             "--bounds", "none")
    assert same["results"][0]["hits"] == self_["results"][0]["hits"]
    _, empty = simulate_json(capsys, trace_path, "--policy", "static", "--slots", "6",
                             "--profile", "none", "--bounds", "none")
    assert empty["results"][0]["hits"] == 0


def no_geometry_trace(tmp_path):
    ids = np.zeros((2, 1, 1), np.int32)
    path = tmp_path / "bare.npz"
    save_trace(Trace(2, ids, [0, 1, 2], np.full(2, DECODE, np.uint8), [0, 2]), path)
    return path


@pytest.mark.parametrize(("argv", "message"), [
    (["--policy", "nope"], "unknown policy 'nope'; known: coldest-in-loan"),
    (["--policy", "lru", "--policy-opt", "speed=9"], "unknown option 'speed'"),
    (["--policy-opt", "max_admits=1", "--policy", "lru"],
     "comes before any --policy: put each --policy-opt after the --policy it sets"),
    (["--policy", "lru", "--policy", "lru"], "policy lru is given twice"),
    (["--slots", "4", "--loan-slots", "5"], "--loan-slots 5 exceeds --slots 4"),
    (["--loan-slots", "-1"], "--loan-slots must be >= 0, got -1"),
    (["--kv-grow", "--floor-slots", "-2"], "floor_slots must be an int >= 0, got -2"),
    (["--kv-grow", "--slot-bytes", "0"], "--slot-bytes must be an integer >= 1, got 0"),
    (["--device-gbps", "1", "--host-gbps", "1", "--pcie-gbps", "1", "--dense-mib", "-1"],
     "dense_bytes must be an int >= 0"),
    (["--profile", "missing.npz"], "--profile: no file at missing.npz"),
    (["--max-context", "100"], "--max-context applies only with --kv-grow"),
    (["--kv-grow", "--max-context", "3"], "--max-context 3 is below the trace's longest"),
    (["--kv-grow", "--budget-mib", "1"], "budget 1.0 MiB is below what the start takes"),
    (["--device-gbps", "100"], "the cost model needs --host-gbps, --pcie-gbps too"),
    (["--device-gbps", "0", "--host-gbps", "1", "--pcie-gbps", "1"],
     "device_gbps must be a finite number > 0"),
])
def test_bad_arguments_are_one_line(capsys, trace_path, argv, message):
    if "--slots" not in argv:
        argv = [*argv, "--slots", "6"]
    status, _, err = run(capsys, "simulate", trace_path, "--quiet", *argv)
    assert status == 2
    assert err.startswith("strata simulate: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_bad_trace_files_and_geometry(capsys, tmp_path):
    status, _, err = run(capsys, "simulate", tmp_path / "none.npz", "--slots", "4")
    assert status == 2 and "no trace file at" in err
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"junk")
    status, _, err = run(capsys, "trace", "info", junk)
    assert status == 2 and "is not a readable .npz trace" in err
    bare = no_geometry_trace(tmp_path)
    status, _, err = run(capsys, "simulate", bare, "--slots", "1", "--kv-grow", "--quiet")
    assert status == 2 and "--kv-grow needs --slot-bytes" in err
    status, _, err = run(capsys, "simulate", bare, "--slots", "1", "--quiet",
                         "--device-gbps", "1", "--host-gbps", "1", "--pcie-gbps", "1")
    assert status == 2 and "the cost model needs --slot-bytes" in err
    bad_profile = tmp_path / "p.npz"
    np.savez(bad_profile, counts=np.ones((2, 2)))
    status, _, err = run(capsys, "simulate", bare, "--slots", "1", "--profile", bad_profile)
    assert status == 2 and "counts must be finite, >= 0 and of shape (1, 2)" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "t.npz", "--slots", "4,x"], "is not a list of slot counts"),
    (["simulate", "t.npz", "--slots", "4", "--bounds", "optimal"], "unknown bound 'optimal'"),
    (["trace", "synth", "o.npz", "--prompt-tokens", "9:3"], "want 0 <= LO <= HI"),
])
def test_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_synth_rejects_a_bad_spec(capsys, tmp_path):
    status, _, err = run(capsys, "trace", "synth", tmp_path / "o.npz", "--experts", "4",
                         "--top-k", "8")
    assert status == 2 and "top_k 8 exceeds n_experts 4" in err
    assert not (tmp_path / "o.npz").exists()
