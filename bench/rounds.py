"""Summarize bench/offload.py's JSON lines (one object a process, as gpu_session.sh's offload stages
write them) as the tables bench/results/ keeps: each decode run's round, and for an A/B
(offload-ab's lines, tagged with `side` and `round`) each pair's ratios.

A row a decode run: its ms a round and a layer, over its bound and over the best split's, the CPU
experts' ms and GB/s, where the CPU's own thread ran them the runs' own ms and GB/s, the team's
wake-up and each pass's GB/s (gate and up, then down: `CpuExperts.last_call`), the wait for the
device, the host-side ms, the misses a round on the CPU and streamed, and what the scheduler did to
the CPU's team (`strata-cpu` threads: sleeps, preemptions and ms waiting for a core a round, where
recorded). A figure a run does not have (runs before it was measured) is "-". With `--ab`, the
pairs: for each round and run name, the new side's ms a round, CPU ms and host-side ms over the
base side's. With `--interleaved`, each setting of a process whose settings took turns request by
request in one engine (offload.py `--interleave`) against its base: its rounds over the base's,
request by request (the median and the range, the machine's drift falling on both), and whether
its tokens are the base's.

    python bench/rounds.py gpu-out/offload.jsonl
    python bench/rounds.py gpu-out/offload-ab.jsonl --ab
    python bench/rounds.py gpu-out/offload.jsonl --interleaved
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# The columns of a run's row: (heading, the figure's key in its `round`, format).
COLUMNS = (("ms a round", "round_ms", ".2f"), ("ms a layer", "ms_per_layer", ".3f"),
           ("over bound", "over_bound", ".2f"),
           ("over the best split's", "over_best_split_bound", ".2f"), ("CPU ms", "cpu_ms", ".2f"),
           ("CPU GB/s", "cpu_gb_s", ".1f"), ("run ms", "cpu_run_ms", ".2f"),
           ("run GB/s", "cpu_run_gb_s", ".1f"), ("team up ms", "cpu_team_up_ms", ".2f"),
           ("gate+up GB/s", "cpu_pass1_gb_s", ".1f"), ("down GB/s", "cpu_pass2_gb_s", ".1f"),
           ("wait ms", "wait_ms", ".2f"), ("token wait ms", "token_wait_ms", ".2f"),
           ("host-side ms", "host_ms", ".2f"),
           ("CPU misses", "cpu_experts_per_round", ".1f"),
           ("streamed", "streamed_experts_per_round", ".1f"))
TEAM = "strata-cpu"  # `_cpu_experts.WORKER_NAME`: the CPU team's threads' name
TEAM_FIELDS = (("sleeps", "voluntary", ".1f"), ("preemptions", "involuntary", ".1f"),
               ("ms waiting", "runnable_ms", ".3f"))
RATIOS = ("round_ms", "cpu_ms", "host_ms")


def read_lines(paths: list[Path]) -> list[dict]:
    """The JSON objects of `paths` (lines not starting with "{" skipped: progress, errors),
    each with `file` and `line` (1-based) added. ValueError naming the file and line of a line
    that is not JSON."""
    documents = []
    for path in paths:
        for number, text in enumerate(path.read_text().splitlines(), 1):
            if not text.startswith("{"):
                continue
            try:
                document = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not a JSON object: {error}") from None
            documents.append({**document, "file": path.name, "line": number})
    return documents


def decode_rows(documents: list[dict]) -> list[dict]:
    """One row a decode run of each document: `where` (file:line, and side and round where
    tagged), `run` (its name) and each column's and the team's figures (None: not recorded)."""
    rows = []
    for document in documents:
        where = f"{document['file']}:{document['line']}" + "".join(
            f" {key} {document[key]}" for key in ("side", "round") if key in document)
        for name, run in document.get("runs", {}).items():
            figures = run.get("round") if isinstance(run, dict) else None
            if not figures:
                continue  # a prefill run
            team = run.get("threads_per_round", {}).get("by_name", {}).get(TEAM, {})
            rows.append({"where": where, "run": name, "side": document.get("side"),
                         "round": document.get("round"),
                         **{key: figures.get(key) for _, key, _ in COLUMNS},
                         **{f"team_{key}": team.get(key) for _, key, _ in TEAM_FIELDS}})
    return rows


def ab_pairs(rows: list[dict]) -> list[dict]:
    """Each base row with the next new row of the same round and run after it (in the lines'
    order: a file may hold several calls' rounds of the same numbers), the new side's figures
    over the base's (`RATIOS`; None where either is missing or the base's is 0)."""
    waiting: dict[tuple, dict] = {}  # (round, run): the base row not yet paired
    pairs = []
    for row in rows:
        key = (row["round"], row["run"])
        if row["side"] == "base":
            waiting[key] = row
        elif row["side"] == "new" and key in waiting:
            base = waiting.pop(key)
            pairs.append({"where": base["where"], "round": row["round"], "run": row["run"], **{
                name: row[name] / base[name] if row[name] is not None and base[name] else None
                for name in RATIOS}})
    return pairs


def interleaved_ratios(documents: list[dict]) -> list[dict]:
    """Each interleaved decode run but its base, against the base (`interleaved_base`; in
    lines written before offload.py named it, the document's first interleaved run): `where`,
    `base`, `run`, the requests compared, the median, lowest and highest of the run's ms a
    round over the base's in the same request, and `same_tokens`."""
    out = []
    for document in documents:
        runs = {name: run for name, run in document.get("runs", {}).items()
                if isinstance(run, dict) and run.get("interleaved")}
        for name, run in runs.items():
            base_name = run.get("interleaved_base") or next(iter(runs))
            base = runs.get(base_name)
            if base is None or name == base_name:
                continue
            ratios = sorted(new / old for new, old in zip(  # the same requests, in turn
                run["decode_ms_per_round_each"], base["decode_ms_per_round_each"], strict=True))
            out.append({"where": f"{document['file']}:{document['line']}", "base": base_name,
                        "run": name, "requests": len(ratios),
                        "median": statistics.median(ratios), "low": ratios[0],
                        "high": ratios[-1], "same_tokens": run["tokens"] == base["tokens"]})
    return out


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> list[str]:
    """The decode rows as a Markdown table's lines."""
    headings = ["where", "run", *(h for h, _, _ in COLUMNS),
                *(f"team {h}" for h, _, _ in TEAM_FIELDS)]
    lines = ["| " + " | ".join(headings) + " |",
             "| --- | --- |" + " ---: |" * (len(headings) - 2)]
    for row in rows:
        cells = [row["where"], row["run"],
                 *(_cell(row[key], spec) for _, key, spec in COLUMNS),
                 *(_cell(row[f"team_{key}"], spec) for _, key, spec in TEAM_FIELDS)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def ab_table(pairs: list[dict]) -> list[str]:
    """The pairs as a Markdown table's lines: new over base."""
    lines = ["| base | round | run | " + " | ".join(f"{key} new/base" for key in RATIOS)
             + " |", "| --- | ---: | --- |" + " ---: |" * len(RATIOS)]
    for pair in pairs:
        lines.append(f"| {pair['where']} | {pair['round']} | {pair['run']} | " + " | ".join(
            _cell(pair[key], ".3f") for key in RATIOS) + " |")
    return lines


def interleaved_table(ratios: list[dict]) -> list[str]:
    """The interleaved runs against their bases as a Markdown table's lines."""
    lines = ["| where | base | run | requests | ms a round, run/base: median | lowest | highest "
             "| same tokens |", "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in ratios:
        lines.append(f"| {r['where']} | {r['base']} | {r['run']} | {r['requests']} | "
                     f"{r['median']:.3f} | {r['low']:.3f} | {r['high']:.3f} | "
                     f"{'yes' if r['same_tokens'] else 'no'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="files of offload.py's JSON lines")
    parser.add_argument("--ab", action="store_true",
                        help="also the pairs of an A/B's lines (tagged side and round)")
    parser.add_argument("--interleaved", action="store_true",
                        help="also each interleaved setting against its base, request by "
                        "request")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.paths if not path.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    try:
        documents = read_lines(args.paths)
    except ValueError as error:
        parser.error(str(error))
    rows = decode_rows(documents)
    print("\n".join(table(rows)))
    if args.ab:
        pairs = ab_pairs(rows)
        if not pairs:
            parser.error("--ab: no run has both a base and a new side in one round")
        print()
        print("\n".join(ab_table(pairs)))
    if args.interleaved:
        ratios = interleaved_ratios(documents)
        if not ratios:
            parser.error("--interleaved: no process's runs took turns (offload.py --interleave)")
        print()
        print("\n".join(interleaved_table(ratios)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
