"""Progress on long jobs: rows done, the current and overall rate and an ETA in the log."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ProgressLog:
    """A daemon thread that logs progress every ``interval`` seconds from ``rows_done`` (the job's
    ``ProgressCounter``: an actor call on the pool, a method call in the driver), and remembers
    when the first rows arrived (the steady rate excludes Ray's and the replicas' start-up)."""

    def __init__(self, rows_done: Callable[[], int], total: int, interval: float) -> None:
        self.rows_done, self.total, self.interval = rows_done, total, interval
        self.first_rows_at: float | None = None
        self.first_rows = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.started = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        last_rows, last_t = 0, self.started
        while not self._stop.wait(self.interval):
            try:
                done = int(self.rows_done())
            except Exception:  # progress is best-effort; the job's result does not depend on it
                continue
            now = time.monotonic()
            if done and self.first_rows_at is None:
                self.first_rows_at, self.first_rows = now, done
            print(
                progress_line(
                    done, self.total, (done - last_rows) / max(now - last_t, 1e-9), done / max(now - self.started, 1e-9)
                ),
                flush=True,
            )
            last_rows, last_t = done, now

    def steady_rate(self, t_done: float, rows: int) -> float | None:
        """Rows/s from the first progress tick that saw rows to the end: excludes Ray and actor start-up.
        None when no tick saw rows, or none arrived after it (the counter's own timing is used then)."""
        first = self.first_rows_at
        if first is None or t_done - first <= 0 or rows <= self.first_rows:
            return None
        return round((rows - self.first_rows) / (t_done - first), 2)


def progress_line(done: int, total: int, current: float, overall: float) -> str:
    """One progress line: rows done of total, the rates and an ETA."""
    rate = current or overall
    eta = f"{(total - done) / rate:,.0f}s" if rate > 0 else "unknown (no batch scored yet)"
    pct = 100.0 * done / total if total else 100.0
    return (
        f"[batchinfer] progress: {done:,}/{total:,} rows ({pct:.1f}%), {current:,.1f} rows/s now, "
        f"{overall:,.1f} rows/s overall, ETA {eta}"
    )
