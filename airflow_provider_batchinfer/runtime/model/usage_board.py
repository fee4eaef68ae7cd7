"""One usage board per Ray cluster, holding every running job's :class:`UsageCounter`.

A job's replicas report their rows, batch times, tokens and node to a counter the driver reads for
its progress log, the manifest's usage and the token budget. An actor of its own per job would be
one more Ray worker process to start for every job (about a CPU-second, and a second of a small
job's wall time). The board is one detached actor per cluster, started by the first job that needs
it, as Ray Data keeps one ``_StatsActor`` per cluster: each job's counter is an entry on it, keyed
by the job, dropped when the job is done and expired if its driver died first.

The board's name carries a digest of the counter's code, so a job never reports to a board that an
older or newer provider version started on a long-lived cluster.
"""

from __future__ import annotations

import hashlib
import inspect
import time
import uuid
from typing import Any

from airflow_provider_batchinfer.runtime.model.usage import UsageCounter
from airflow_provider_batchinfer.runtime.output.parts import ProgressCounter

BOARD_NAMESPACE = "batchinfer"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node alone
#: a job's entry that no call touched for this long belongs to a driver that died: it is dropped
STALE_S = 6 * 3600.0
#: what a job's counter answers (``counter.<method>.remote(...)``), the same for the actor per job
#: it replaces and for the direct counter of a job scored in the driver
COUNTER_METHODS = frozenset(
    {"add", "batch", "tokens", "placed", "get", "summary", "budget_view", "reported_rate", "placements"}
)


class UsageBoard:
    """The cluster's counters, by job key. One call at a time (an actor's default), so a counter
    needs no lock of its own."""

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[UsageCounter, float]] = {}

    def call(self, key: str, method: str, *args: Any) -> Any:
        if method not in COUNTER_METHODS:
            raise AttributeError(f"a usage counter has no method {method!r}")
        now = time.monotonic()
        entry = self._jobs.get(key)
        if entry is None:
            self._drop_stale(now)
            entry = (UsageCounter(), now)
        self._jobs[key] = (entry[0], now)
        return getattr(entry[0], method)(*args)

    def forget(self, key: str) -> None:
        self._jobs.pop(key, None)

    def jobs(self) -> int:
        return len(self._jobs)

    def _drop_stale(self, now: float) -> None:
        for key in [k for k, (_, touched) in self._jobs.items() if now - touched > STALE_S]:
            del self._jobs[key]


class _Method:
    """``counter.<name>.remote(*args)`` as a call on the board, like an actor method."""

    def __init__(self, board: Any, key: str, name: str) -> None:
        self.board, self.key, self.name = board, key, name

    def remote(self, *args: Any) -> Any:
        return self.board.call.remote(self.key, self.name, *args)


class JobCounter:
    """A job's counter on the board, used as an actor handle is: ``counter.add.remote(rows)``
    returns an ``ObjectRef``. Picklable: the replicas get it as a constructor argument."""

    def __init__(self, board: Any, key: str) -> None:
        self.board, self.key = board, key

    def __getattr__(self, name: str) -> _Method:
        if name not in COUNTER_METHODS:
            raise AttributeError(name)
        return _Method(self.board, self.key, name)

    def close(self) -> None:
        """Drop the job's entry (fire and forget: the board expires it anyway)."""
        self.board.forget.remote(self.key)


def board_name() -> str:
    """The board's actor name: the digest of the code that answers the calls."""
    source = "".join(inspect.getsource(c) for c in (ProgressCounter, UsageCounter, UsageBoard))
    return "usage-board-" + hashlib.sha256(source.encode()).hexdigest()[:12]


def job_counter(job_id: str) -> JobCounter:
    """The running job's counter: the cluster's board (started if none runs yet) and a key of its own."""
    import ray

    board = (
        ray.remote(num_cpus=0)(UsageBoard)
        .options(
            name=board_name(),
            namespace=BOARD_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            resources={HEAD_NODE_RESOURCE: 0.001},  # on the head, which an autoscaler never removes
        )
        .remote()
    )
    return JobCounter(board, f"{job_id}/{uuid.uuid4().hex}")
