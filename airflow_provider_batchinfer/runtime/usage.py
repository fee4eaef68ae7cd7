"""What a job held and did, and the budget guard that stops it before it costs too much (issue 16.2).

Three pieces, each hooked into the driver with a line or two:

- :class:`UsageCounter`: the job's progress actor (``io.ProgressCounter``) that also keeps each
  batch's model latency and, for text generation, the prompt and completion tokens;
- :class:`MeteredReplica`: the model replica, timing each batch and reporting it to the counter;
- :class:`Meter`: a context manager around the pipeline's write. It measures how long the job's
  reservation was held and, when ``JobSpec.max_cost`` or ``max_output_tokens_total`` is set, runs a
  watcher thread that stops the write once the running estimate would pass the limit. Nothing is
  committed then: the driver fails with :class:`BudgetExceededError`, saying how far the job got.

Stopping: Ray Data's write blocks the driver's main thread; the watcher sends this process SIGINT,
the meter's handler (installed only for the write) turns it into :class:`_BudgetStop`, which Ray
Data's executor treats like Ctrl+C (it shuts its operators down and re-raises), and the meter turns
that into the error once the write has unwound. Parts that were complete stay in the run directory
without ``_SUCCESS``: a retry with ``SaveMode.RESUME`` (and a higher limit) keeps them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract.usage import BASIS, Usage, estimate_cost
from airflow_provider_batchinfer.runtime.errors import JobError
from airflow_provider_batchinfer.runtime.io import ProgressCounter
from airflow_provider_batchinfer.runtime.replica import ModelReplica

if TYPE_CHECKING:
    import pyarrow as pa

    from airflow_provider_batchinfer.contract import JobFile
    from airflow_provider_batchinfer.runtime.plan import ActorPool

TEXT_GENERATION = "text_generation"
#: latencies kept for the percentiles; past this the counter keeps every other one (an even thinning)
MAX_LATENCIES = 100_000


class BudgetError(JobError):
    """The budget cannot work or was exceeded; a retry with the same limit would not do better."""

    permanent = True


class BudgetExceededError(BudgetError):
    """The job stopped because its running estimate would exceed ``JobSpec.max_cost`` or
    ``max_output_tokens_total``; nothing was committed."""


class _BudgetStop(BaseException):
    """Raised in the driver's main thread by the meter's SIGINT handler, to unwind Ray Data's write
    (a BaseException, like KeyboardInterrupt: Ray Data shuts its executor down for those)."""


def check_budget(job: JobFile, flavor: str) -> None:
    """Before Ray starts: a budget the job can enforce. ``max_cost`` needs a price for what the job
    reserves; ``max_output_tokens_total`` needs a text generation model."""
    spec, prices = job.job_spec, job.prices
    if spec.max_cost is not None:
        needed = ["price_per_cpu_hour"] if spec.num_cpus > 0 else []
        needed += ["price_per_gpu_hour"] if spec.num_gpus > 0 else []
        if not prices or not any(k in prices for k in needed):
            raise BudgetError(
                f"JobSpec.max_cost={spec.max_cost:g} needs prices to estimate the cost with: set the extras "
                f"{' and '.join(needed)} on the batchinfer connection (currency units per hour, e.g. "
                '{"price_per_cpu_hour": 0.048}), or drop max_cost'
            )
    if spec.max_output_tokens_total is not None and flavor != TEXT_GENERATION:
        raise BudgetError(
            f"JobSpec.max_output_tokens_total applies to text_generation models; {job.model.name}/"
            f"{job.model.version} is {flavor}: drop it, or use max_cost"
        )


class UsageCounter(ProgressCounter):
    """The progress actor, plus per-batch latencies and token counts reported by the replicas."""

    def __init__(self) -> None:
        super().__init__()
        self.latencies: list[float] = []
        self.batches = 0
        self.busy_s = 0.0
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None

    def batch(self, rows: int, seconds: float, tokens: tuple[int, int] | None = None) -> None:
        self.batches += 1
        self.busy_s += seconds
        self.latencies.append(seconds)
        if len(self.latencies) > MAX_LATENCIES:
            self.latencies = self.latencies[::2]
        if tokens is not None:
            self.tokens(*tokens)

    def tokens(self, prompt: int, completion: int) -> None:
        self.input_tokens = (self.input_tokens or 0) + int(prompt)
        self.output_tokens = (self.output_tokens or 0) + int(completion)

    def budget_view(self) -> tuple[int, int | None]:
        """(rows done, output tokens so far): what the budget watcher reads every tick."""
        return self.rows, self.output_tokens

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.latencies)
        return {
            "rows": self.rows,
            "batches": self.batches,
            "busy_s": self.busy_s,
            "batch_p50_s": percentile(ordered, 50),
            "batch_p95_s": percentile(ordered, 95),
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
        }


def percentile(ordered: list[float], q: float) -> float | None:
    """The ``q``-th percentile of sorted values (nearest rank); None for no values."""
    if not ordered:
        return None
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[int(rank) - 1]


def batch_tokens(out: pa.Table) -> tuple[int, int] | None:
    """(prompt, completion) tokens of a scored batch: the text generation flavors' ``usage`` column
    (``chat.response_types``); None for any other output. Dead-lettered rows (null usage) count 0."""
    if "usage" not in out.column_names:
        return None
    import pyarrow as pa
    import pyarrow.compute as pc

    column = out.column("usage")
    if not pa.types.is_struct(column.type) or column.type.get_field_index("completion_tokens") < 0:
        return None
    totals = []
    for name in ("prompt_tokens", "completion_tokens"):
        total = pc.sum(pc.struct_field(column, name)).as_py() if column.type.get_field_index(name) >= 0 else 0
        totals.append(int(total or 0))
    return totals[0], totals[1]


class MeteredReplica(ModelReplica):
    """:class:`~airflow_provider_batchinfer.runtime.replica.ModelReplica`, timing each batch (model
    call, input checks and dead-letter isolation included) for the usage's p50/p95 latency."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        started = time.perf_counter()
        out = super().__call__(batch)
        if self.counter is not None and batch.num_rows:
            self.counter.batch.remote(batch.num_rows, time.perf_counter() - started, batch_tokens(out))
        return out


class Meter:
    """Around the pipeline's write: how long the job's reservation was held, and the budget guard.

    ``with Meter(job, pool, counter, todo_rows): ds.write_datasink(...)``, then :meth:`check`
    outside any exception handler (it raises :class:`BudgetExceededError` with a clean chain, also
    when the limit was passed between the watcher's last tick and the end of the write)."""

    def __init__(self, job: JobFile, pool: ActorPool, counter: Any, todo_rows: int, interval: float = 0.5) -> None:
        self.job, self.counter, self.todo_rows, self.interval = job, counter, todo_rows, interval
        self.cpus, self.gpus = float(pool["reserved_cpus"]), float(pool["reserved_gpus"])
        self.prices: Mapping[str, float] = dict(job.prices)
        self.started = self.ended = 0.0
        self.reason: str | None = None  # why the guard stopped the job
        self._inside = self._installed = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: Any = None
        self._last: tuple[int, int | None] = (0, None)
        self.stats: dict[str, Any] = {}  # the counter's summary, read while Ray is still up (check())

    @property
    def guarded(self) -> bool:
        spec = self.job.job_spec
        return spec.max_cost is not None or spec.max_output_tokens_total is not None

    def held_s(self, now: float | None = None) -> float:
        end = self.ended or (time.monotonic() if now is None else now)
        return max(0.0, end - self.started) if self.started else 0.0

    def cost(self, held_s: float) -> float | None:
        return estimate_cost(self.cpus * held_s, self.gpus * held_s, self.prices)

    # --- the guard ---------------------------------------------------------------------------------------
    def __enter__(self) -> Meter:
        self.started = time.monotonic()
        if self.guarded:
            # signal handlers live in the main thread; elsewhere (the driver run from a thread) the
            # watcher only records the reason and check() fails the job once the write has ended
            if threading.current_thread() is threading.main_thread():
                self._previous = signal.signal(signal.SIGINT, self._on_signal)
                self._installed = self._inside = True
            self._thread = threading.Thread(target=self._watch, name="batchinfer-budget", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        with self._lock:
            self._inside = False
            self.ended = time.monotonic()
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
        # our own stop: swallowed here, raised by check() outside any handler (a clean message)
        return exc_type is not None and issubclass(exc_type, _BudgetStop)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.reason is not None and self._inside:
            raise _BudgetStop(self.reason)
        if callable(self._previous):  # a SIGINT that is not ours: what it did before
            self._previous(signum, frame)
        else:
            raise KeyboardInterrupt

    def _watch(self) -> None:
        """Every tick: decide at ``now`` whether the job must stop. The cost is a function of time
        alone, so its decision waits on nothing; the counter (rows for the message, output tokens for
        their limit) is read after ``now`` is taken, so a busy counter cannot carry the estimate past
        ``max_cost`` before the guard has decided (it did on a loaded machine: 30.04 of 30)."""
        while not self._done.wait(self._until_next_tick()):
            now = time.monotonic()
            counts_tokens = self.job.job_spec.max_output_tokens_total is not None
            if counts_tokens or self._cost_would_pass(self.held_s(now), self.interval):
                self._read_counter()
            reason = self.over_budget(self._last, lookahead=self.interval, now=now)
            if reason is None:
                continue
            with self._lock:
                if self.reason is None and self.ended == 0.0:
                    self.reason = reason
                    print(f"[batchinfer] budget: {reason}; stopping the job", flush=True)
                    if self._inside:
                        os.kill(os.getpid(), signal.SIGINT)
            return

    def _read_counter(self) -> None:
        if self.counter is None:  # no counter to read (and ray.get would start a local Ray)
            return
        import ray

        try:
            self._last = ray.get(self.counter.budget_view.remote(), timeout=10)
        except Exception:  # the counter is busy or gone: the guard keeps its last reading
            pass

    def held_at_limit(self) -> float | None:
        """Seconds of holding the reservation at which the estimate reaches ``max_cost`` (it grows
        linearly with time held), or None without a cost limit."""
        limit, per_second = self.job.job_spec.max_cost, self.cost(1.0)
        return None if limit is None or not per_second else limit / per_second

    def _cost_would_pass(self, held: float, lookahead: float) -> bool:
        """Whether the estimate passes ``max_cost`` within ``lookahead`` seconds of ``held``."""
        limit = self.job.job_spec.max_cost
        return limit is not None and (self.cost(held + lookahead) or 0.0) > limit

    def _until_next_tick(self) -> float:
        """A tick's wait: ``interval``, cut short so the last tick before the cost limit comes half a
        tick before it; a watcher woken late by a loaded machine still decides inside the limit."""
        limit_s = self.held_at_limit()
        if limit_s is None:
            return self.interval
        return max(0.0, min(self.interval, limit_s - self.interval / 2 - self.held_s()))

    def over_budget(self, seen: tuple[int, int | None], lookahead: float = 0.0, now: float | None = None) -> str | None:
        """Why the job must stop now, or None: its cost estimate would pass ``max_cost`` before the
        next tick (``lookahead`` seconds away), or its output tokens passed ``max_output_tokens_total``."""
        spec = self.job.job_spec
        rows, output_tokens = seen
        held = self.held_s(now)
        cost = self.cost(held) or 0.0
        if self._cost_would_pass(held, lookahead):
            return (
                f"the estimated cost would exceed JobSpec.max_cost={spec.max_cost:g}: {cost:.6g} after {held:.1f}s "
                f"holding {self.cpus:g} CPU / {self.gpus:g} GPU, {rows:,} of {self.todo_rows:,} rows scored"
            )
        limit = spec.max_output_tokens_total
        if limit is not None and output_tokens is not None and output_tokens > limit:
            return (
                f"{output_tokens:,} output tokens exceed JobSpec.max_output_tokens_total={limit:,} after {rows:,} of "
                f"{self.todo_rows:,} rows scored (estimated cost {cost:.6g})"
            )
        return None

    def check(self, run_dir: str) -> None:
        """After the write: raise :class:`BudgetExceededError` when the guard stopped the job, or when
        the finished job's usage is over its limit (it passed it after the watcher's last tick)."""
        import ray

        try:  # the latencies and tokens for the manifest; the driver shuts Ray down right after
            self.stats = ray.get(self.counter.summary.remote(), timeout=30)
            self._last = (int(self.stats["rows"]), self.stats["output_tokens"])
        except Exception:  # the record is still worth writing without them; the guard keeps its last reading
            pass
        reason = self.reason
        if reason is None and self.guarded:
            reason = self.over_budget(self._last)
        if reason is not None:
            raise BudgetExceededError(
                f"stopped: {reason}. Nothing was committed; complete parts stay in {run_dir} without _SUCCESS. "
                "Raise the limit and retry (with SaveMode.RESUME and InputSpec.id_column the retry keeps them "
                "and scores only the rest)"
            )

    # --- the record --------------------------------------------------------------------------------------
    def usage(self, wall_s: float, rows: int) -> Usage:
        """The manifest's ``usage`` section for this attempt (``rows``: scored + dead-lettered here),
        from what :meth:`check` read; needs no Ray."""
        stats = self.stats
        held = self.held_s()
        spec = self.job.job_spec
        cpu_s, gpu_s = round(self.cpus * held, 3), round(self.gpus * held, 3)
        cost = estimate_cost(cpu_s, gpu_s, self.prices)
        return Usage(
            wall_s=round(wall_s, 3),
            held_s=round(held, 3),
            reserved_cpus=self.cpus,
            reserved_gpus=self.gpus,
            cpu_seconds=cpu_s,
            gpu_seconds=gpu_s,
            rows=rows,
            rows_per_s=round(rows / held, 2) if held > 0 else None,
            batches=int(stats.get("batches") or 0),
            batch_p50_s=_round(stats.get("batch_p50_s")),
            batch_p95_s=_round(stats.get("batch_p95_s")),
            busy_s=round(float(stats.get("busy_s") or 0.0), 3),
            input_tokens=stats.get("input_tokens"),
            output_tokens=stats.get("output_tokens"),
            price_per_cpu_hour=self.prices.get("price_per_cpu_hour"),
            price_per_gpu_hour=self.prices.get("price_per_gpu_hour"),
            cost=None if cost is None else round(cost, 8),
            cost_per_million_rows=None if cost is None or not rows else round(cost / rows * 1e6, 6),
            max_cost=spec.max_cost,
            max_output_tokens_total=spec.max_output_tokens_total,
            basis=BASIS,
        )


def _round(value: Any, digits: int = 6) -> float | None:
    return None if value is None else round(float(value), digits)
