"""The benchmark's wait for an idle machine (``benchmarks/idle.py``): a machine kept busy reads busy
and is waited out to the limit, never called idle."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.idle import busy_fraction, wait_for_idle

SPIN = "import time\nend = time.monotonic() + float(__import__('sys').argv[1])\nwhile time.monotonic() < end: pass"


def _spinners(seconds: float) -> list[subprocess.Popen]:
    """One busy loop per core, for ``seconds``."""
    return [subprocess.Popen([sys.executable, "-c", SPIN, str(seconds)]) for _ in range(os.cpu_count() or 1)]


def test_a_machine_kept_busy_reads_busy_and_is_waited_out_to_the_limit():
    spinners = _spinners(6)
    try:
        assert busy_fraction(1.0) > 0.8  # every core spinning
        assert wait_for_idle(max_wait_s=2.0) >= 2.0  # busy the whole time: the wait runs out
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def test_busy_fraction_is_a_share_of_all_cores():
    assert 0.0 <= busy_fraction(0.2) <= 1.0
