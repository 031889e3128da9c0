"""`strata chat` driven through a pseudo-terminal, as a person types into it."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import torch

from support.checkpoints import cached_checkpoint


def _read_until(fd: int, pattern: str, seen: list[str], timeout: float = 120.0) -> str:
    """Read the terminal until `pattern` (a regex) appears in what was read; the text so far."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = "".join(seen)
        if re.search(pattern, text):
            return text
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                seen.append(os.read(fd, 4096).decode(errors="replace"))
            except OSError:
                break
    raise AssertionError(f"{pattern!r} never appeared in:\n{''.join(seen)}")


def test_two_turns_the_second_reusing_the_first():
    ckpt = cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32)
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata.cli", "chat", "--model", str(ckpt), "--device", "cpu",
         "--temperature", "0", "--max-new", "6", "--verbose"],
        stdin=child, stdout=child, stderr=child, close_fds=True)
    os.close(child)
    seen: list[str] = []
    try:
        _read_until(main, r"> ", seen)
        os.write(main, b"hello there\n")
        first = _read_until(main, r"prompt tokens \((\d+) reused\)", seen)
        turn1 = re.findall(r"(\d+) prompt tokens \((\d+) reused\)", first)[-1]
        _read_until(main, r"> $", seen)
        os.write(main, b"and again\n")
        both = _read_until(main, r"prompt tokens.*\n(.|\n)*prompt tokens \(\d+ reused\)", seen)
        turn2 = re.findall(r"(\d+) prompt tokens \((\d+) reused\)", both)[-1]
        os.write(main, b"/reset\n")
        _read_until(main, r"a new conversation", seen)
        os.write(main, b"\x04")  # end of input: leaves cleanly
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main)
    assert int(turn1[1]) == 0
    # The second turn's rendering starts with the first turn's prompt: it is reused at least.
    assert int(turn2[1]) >= int(turn1[0]) and int(turn2[0]) > int(turn1[0])
    assert "Traceback" not in "".join(seen)
