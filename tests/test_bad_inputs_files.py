"""Every bad input a clean error, through the real command line (issue 18).

Each case of `support.bad_inputs` (configs of every family, the files around the weights,
tokenizers, prompts, options and sizes, profiles and traces) runs `strata` as a user does and
must end with exit status 2, exactly one line on stderr naming what was wrong, and no
traceback; a size case must also be refused within SIZE_SECONDS having grown by less than
SIZE_RSS_BYTES (and runs under an address-space limit, so one that is not refused fails here
instead of filling the machine).

Cases that need no torch run as `python -m strata.cli` in a fresh interpreter; the others (and
every size case, whose memory it measures) run through `support.cli_runner`, whose children
are `python -m strata.cli` with torch imported once beforehand (a fresh interpreter per case
would spend most of the run importing torch). `test_the_runner_is_the_command_line` checks
that both give the same answer.
"""

from __future__ import annotations

import pytest

from support.bad_inputs import SIZE_RSS_BYTES, SIZE_SECONDS, all_cases, checkpoint, generate
from support.cli_runner import CliResult, CliRunner, run_subprocess

CASES = all_cases()


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    with CliRunner(tmp_path_factory.mktemp("runs")) as cli:
        yield cli


def _run(runner: CliRunner, case, run, timeout: float) -> CliResult:
    if run.light and not case.size:  # the runner measures a size case's memory
        return run_subprocess(run.argv, stdin=run.stdin, env=run.env, timeout=timeout)
    return runner.run(run.argv, stdin=run.stdin, stdin_path=run.stdin_path, env=run.env,
                      timeout=timeout)


def test_the_matrix_is_large():
    assert len(CASES) >= 100
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_one_clean_line(case, runner, tmp_path):
    run = case.build(tmp_path)
    result = _run(runner, case, run, timeout=SIZE_SECONDS * 2 if case.size else 120)
    where = f"{case.id}: status {result.status}, stderr:\n{result.stderr[-3000:]}"
    assert not result.timed_out, where
    assert result.status == 2, where
    assert "Traceback" not in result.stderr, where
    lines = result.stderr_lines
    assert len(lines) == 1, where
    assert lines[0].startswith(f"strata {run.argv[0]}: ") or lines[0].startswith("strata: "), \
        where
    for text in case.expect:
        assert text in lines[0], f"{text!r} not in the message; {where}"
    if case.size:
        assert result.seconds < SIZE_SECONDS, where
        assert result.extra_rss_bytes < SIZE_RSS_BYTES, where


def test_the_runner_is_the_command_line(runner, tmp_path):
    """A case through the runner and through a fresh interpreter: the same status and line."""
    run = generate(checkpoint(tmp_path, num_attention_heads="4"))
    forked = runner.run(run.argv)
    fresh = run_subprocess(run.argv)
    assert (forked.status, forked.stderr, forked.stdout) == \
        (fresh.status, fresh.stderr, fresh.stdout)
    assert forked.status == 2 and "num_attention_heads" in forked.stderr


def test_an_expert_cache_far_beyond_the_budget_is_capped_and_said(runner, tmp_path):
    """Not an error: the cache cannot be larger than the budget, and the startup line says the
    asked-for size was capped (1e308 MiB once overflowed converting to slots)."""
    # 64 KiB chunks and a budget that leaves 8 of the 16 experts' slots.
    run = generate(checkpoint(tmp_path), "--expert-cache", "1e308", "--vram-budget-mib", "3.8",
                   "--max-context", "256")
    result = runner.run(run.argv, env={"STRATA_VMM_CHUNK_BYTES": "65536"}, timeout=120)
    assert result.status == 0, result.stderr
    assert "1e+308 MiB, capped by the budget" in result.stderr
