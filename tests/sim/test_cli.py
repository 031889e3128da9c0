"""`strata trace` and `strata simulate`: output, determinism, and one-line errors."""

import json
import os
import subprocess
import sys
from xml.etree import ElementTree

import numpy as np
import pytest

from strata import cli
from strata.formats.trace import DECODE, Trace, load_trace, save_trace
from strata.policies import load_registry
from strata.sim.plot import PANELS, hit_rate_figure
from strata.sim.sweep import sweep

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


MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-"}


@pytest.mark.parametrize("fmt", ["png", "pdf", "svg"])
def test_plot_writes_the_format_of_its_suffix(capsys, tmp_path, trace_path, fmt):
    pytest.importorskip("matplotlib")
    out_path = tmp_path / f"hit.{fmt}"
    status, out, _ = run(capsys, "simulate", trace_path, "--policy", "static", "--policy",
                         "lfu", "--slots", "4,8,12", "--plot", out_path, "--quiet")
    assert status == 0 and f"wrote {out_path}" in out
    data = out_path.read_bytes()
    if fmt == "svg":
        root = ElementTree.fromstring(data)
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        # Text stays text (svg.fonttype none): the title names the trace's shape and settings.
        text = " ".join(t for t in root.itertext())
        assert "3 requests" in text and "3 layers x top-2 of 8" in text
        assert "profile: self" in text and "K/V: fixed" in text
    else:
        assert data.startswith(MAGIC[fmt])
    again = tmp_path / f"again.{fmt}"
    run(capsys, "simulate", trace_path, "--policy", "static", "--policy", "lfu", "--slots",
        "4,8,12", "--plot", again, "--quiet")
    assert again.read_bytes() == data  # no date or version inside: the same bytes


@pytest.mark.parametrize(("name", "says"), [
    ("hit.jpg", "--plot {path} has suffix .jpg; the plot's format comes from it: .png, .pdf, "
                ".svg"),
    ("hit", "--plot {path} has no suffix; the plot's format comes from it: .png, .pdf, .svg"),
])
def test_a_plot_suffix_without_a_format_is_refused_before_the_replays(capsys, tmp_path,
                                                                       trace_path, name, says):
    pytest.importorskip("matplotlib")
    path = tmp_path / name
    status, out, err = run(capsys, "simulate", trace_path, "--slots", "4", "--plot", path)
    assert status == 2 and out == "" and not path.exists()
    assert err == f"strata simulate: {says.format(path=path)}\n"


def test_a_plot_of_a_zero_slot_cache_is_refused_before_the_replays(capsys, tmp_path,
                                                                   trace_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "hit.png"
    status, _, err = run(capsys, "simulate", trace_path, "--slots", "0,4", "--plot", path)
    assert status == 2 and not path.exists()
    assert err == ("strata simulate: --plot draws cache sizes on a log2 axis, where --slots 0 "
                   "has no place: leave it out, or drop --plot\n")


def test_the_figure_two_panels_log2_bounds_and_lines_told_apart(trace_path):
    pytest.importorskip("matplotlib")
    trace = load_trace(trace_path)
    specs = [("static", []), ("coldest-in-loan", []), ("lru", [])]
    results = sweep(trace, specs, [4, 8, 16], registry=load_registry())
    fig = hit_rate_figure(results, "the title", "the settings")
    assert fig.get_suptitle() == "the title\nthe settings"
    assert [ax.get_title() for ax in fig.axes] == list(PANELS)
    labels = ["static", "coldest-in-loan", "lru", "belady", "oracle-static"]
    for ax, rate in zip(fig.axes, (lambda r: r.hit_rate, decode_rate), strict=True):
        assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
        assert list(ax.get_xticks()) == [4, 8, 16]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "8", "16"]
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert list(lines) == labels
        for label, line in lines.items():
            mine = sorted((r.slots, rate(r)) for r in results if r.policy == label)
            assert list(line.get_ydata()) == [y for _, y in mine]
            # Nudged sideways by less than a tenth of a doubling, never onto another line's x.
            ratios = np.asarray(line.get_xdata()) / [x for x, _ in mine]
            assert np.allclose(ratios, ratios[0]) and abs(np.log2(ratios[0])) < 0.1
        # static and coldest-in-loan coincide here (a fixed K/V: the same cache) ...
        same = lines["static"], lines["coldest-in-loan"]
        assert list(same[0].get_ydata()) == list(same[1].get_ydata())
        # ... and stay told apart: their own x, marker and line style.
        assert same[0].get_xdata()[0] != same[1].get_xdata()[0]
        assert same[0].get_marker() != same[1].get_marker()
        assert same[0].get_linestyle() != same[1].get_linestyle()
        assert lines["belady"].get_linestyle() == "--"
    legend = fig.axes[1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == labels


def decode_rate(result):
    accesses, hits = result.phase_counts(DECODE)
    return hits / accesses


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


# --- the front door's shell manners, for every command (through a real pipe) ---

def strata_argv(*argv):
    return [sys.executable, "-m", "strata.cli", *map(str, argv)]


def quiet_env(tmp_path):
    return os.environ | {"STRATA_CACHE_DIR": str(tmp_path / "cache"), "STRATA_LOAD_PLUGINS": ""}


PIPED = {
    "policies": ("policies", "--json"),
    "trace-info": ("trace", "info", "TRACE", "--json"),
    "simulate": ("simulate", "TRACE", "--slots", "4,8", "--json", "--quiet"),
    "generate": ("generate", "Hello", "--max-new", "200", "--seed", "1"),
}


@pytest.mark.parametrize("name", list(PIPED))
def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path, trace_path, name):
    """`strata ... | head -c 5`: head exits after 5 bytes; strata exits 0 with no traceback
    (and no "Exception ignored" from the flush at exit)."""
    argv = [trace_path if arg == "TRACE" else arg for arg in PIPED[name]]
    writer = subprocess.Popen(strata_argv(*argv), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=quiet_env(tmp_path))
    head = subprocess.run(["head", "-c", "5"], stdin=writer.stdout, capture_output=True)
    writer.stdout.close()
    err = writer.stderr.read().decode()
    assert writer.wait(timeout=120) == 0, err
    assert len(head.stdout) == 5
    assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize("name", ["policies", "generate"])
def test_a_pipe_closed_before_anything_is_written_is_quiet_too(tmp_path, name):
    """The reader gone before the first write: every write fails, the first one included."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(strata_argv(*PIPED[name]), stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env=quiet_env(tmp_path),
                              timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


def test_a_broken_pipe_elsewhere_keeps_its_traceback(monkeypatch):
    """Only stdout's own closed reader is quiet: another BrokenPipeError is a bug to see."""
    def run(args):
        raise BrokenPipeError("a socket, not stdout")

    monkeypatch.setattr("strata.cli.policies.run", run)
    with pytest.raises(BrokenPipeError, match="a socket"):
        cli.main(["policies"])


@pytest.mark.parametrize(("argv", "line"), [
    (["simulate", "TRACE", "--slots", "4", "--polcy", "lru"],
     "strata simulate: unrecognized arguments: --polcy lru; did you mean --policy? "
     "(see strata simulate --help)"),
    (["trace", "synth", "OUT", "--lyers", "3"],
     "strata trace synth: unrecognized arguments: --lyers 3; did you mean --layers? "
     "(see strata trace synth --help)"),
    (["trace", "info", "TRACE", "--frobnicate"],
     "strata trace info: unrecognized arguments: --frobnicate (see strata trace info --help)"),
    (["simulat", "TRACE"], "did you mean simulate? (see strata --help)"),
])
def test_a_misspelt_flag_is_named_by_its_subcommand_with_the_closest(capsys, tmp_path,
                                                                     trace_path, argv, line):
    argv = [{"TRACE": str(trace_path), "OUT": str(tmp_path / "o.npz")}.get(a, a) for a in argv]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert err.rstrip("\n").endswith(line), err
