"""Wait for an idle machine before each timed system.

The benchmark refuses to call a target held when the 1-minute load average before a system's run is
above the core count. Without a wait, the benchmark's own previous system (plain Ray Data's workers, an
actor pool, a Ray shutting down) is still in that average, or still running, when the next one starts:
a run once marked eight of its figures NOT MEASURED for its own load. So before each system the harness
waits until the last second's CPU was mostly idle *and* the load average has fallen to the core count,
at most ``MAX_WAIT_S``. It never lowers the bar: a machine busy with something else stays busy, the
wait runs out, and the figure is marked as before.
"""

from __future__ import annotations

import os
import time

MAX_WAIT_S = 90.0
BUSY_AT_MOST = 0.25  # of all cores, over the last second


def busy_fraction(interval_s: float = 1.0) -> float:
    """How busy all cores were, 0..1, over the next ``interval_s`` seconds (iowait counts as idle)."""
    import psutil  # the bench group's, and Airflow's own dependency

    return psutil.cpu_percent(interval=interval_s) / 100.0


def wait_for_idle(max_wait_s: float = MAX_WAIT_S) -> float:
    """Block until the machine is idle (see the module's docstring) or ``max_wait_s`` has passed;
    the seconds waited, recorded beside each result as ``settled_s``."""
    cores = os.cpu_count() or 1
    started = time.monotonic()
    while time.monotonic() - started < max_wait_s:
        if busy_fraction() <= BUSY_AT_MOST and os.getloadavg()[0] <= cores:
            break
    return round(time.monotonic() - started, 1)
