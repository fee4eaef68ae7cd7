"""What a job held and did, and the budget that stops it before it costs too much.

Three pieces, each hooked into the driver with a line or two:

- :class:`UsageCounter`: the job's progress counter (``io.ProgressCounter``, an entry on the
  cluster's ``usage_board.UsageBoard``) that also keeps each batch's model latency and, for text
  generation, the prompt and completion tokens;
- :class:`MeteredReplica`: the model replica, timing each batch and reporting it to the counter;
- :class:`Meter`: a context manager around the pipeline's write that measures how long the job's
  reservation was held, and the budget of ``JobSpec.max_cost`` and ``max_output_tokens_total``.

The cost estimate is the reservation's CPUs and GPUs at the connection's prices times the seconds
held, so ``max_cost`` is a deadline, known once the reservation is: ``max_cost`` over the cost per
second, less a margin for the stop. Ray Data's own execution loop enforces it: each of its steps
calls :meth:`Meter.step`, which raises once the deadline has passed (or the output tokens the
counter has seen pass their limit); Ray Data ends the execution as for any failed task, and the
driver fails with :class:`BudgetExceededError`, saying how far the job got. Nothing is committed:
parts that were complete stay in the run directory without ``_SUCCESS``, and a retry with
``SaveMode.RESUME`` (and a higher limit) keeps them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract.usage import BASIS, Usage, estimate_cost
from airflow_provider_batchinfer.runtime.errors import JobError
from airflow_provider_batchinfer.runtime.model.replica import ModelReplica
from airflow_provider_batchinfer.runtime.output.parts import ProgressCounter

if TYPE_CHECKING:
    import pyarrow as pa

    from airflow_provider_batchinfer.contract import JobFile
    from airflow_provider_batchinfer.runtime.planning.pipeline import ActorPool

TEXT_GENERATION = "text_generation"
#: latencies kept for the percentiles; past this the counter keeps every other one (an even thinning)
MAX_LATENCIES = 100_000
#: seconds before the cost estimate reaches ``max_cost`` at which the job is stopped: Ray Data's loop
#: notices within a step (0.1 s while tasks run) and shuts its operators down, on the reservation
STOP_MARGIN_S = 1.0


class BudgetError(JobError):
    """The budget cannot work or was exceeded; a retry with the same limit would not do better."""

    permanent = True


class BudgetExceededError(BudgetError):
    """The job stopped because its running estimate would exceed ``JobSpec.max_cost`` or
    ``max_output_tokens_total``; nothing was committed."""


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
    """The job's progress counter (an entry on the usage board), plus per-batch latencies and token
    counts reported by the replicas."""

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
        """(rows done, output tokens so far): what the budget reads for a token limit."""
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
    """:class:`~airflow_provider_batchinfer.runtime.model.replica.ModelReplica`, timing each batch (model
    call, input checks and dead-letter isolation included) for the usage's p50/p95 latency.

    ``slice_rows``: a replica that reads its own input (``pool_dataset.reads_in_replicas``) gets each
    read task's block whole, and scores it in batches of at most this many rows, as Ray Data's
    ``batch_size`` would have cut it: the same batches, latencies and progress reports as a
    replica fed by read tasks."""

    def __init__(self, *args: Any, slice_rows: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slice_rows = slice_rows

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = self.slice_rows
        if not rows or batch.num_rows <= rows:
            return self._timed(batch)
        import pyarrow as pa

        parts = [self._timed(batch.slice(start, rows)) for start in range(0, batch.num_rows, rows)]
        return pa.concat_tables(parts, promote_options="default")  # dead-lettered rows hold fewer columns

    def _timed(self, batch: pa.Table) -> pa.Table:
        started = time.perf_counter()
        out = super().__call__(batch)
        if self.counter is not None and batch.num_rows:
            self.counter.batch.remote(batch.num_rows, time.perf_counter() - started, batch_tokens(out))
        return out


class Meter:
    """Around the pipeline's write: how long the job's reservation was held, and the budget.

    ``with meter.guard(ds): ds.write_datasink(...)``, then :meth:`check` outside any exception
    handler (it raises :class:`BudgetExceededError` with a clean chain). Without ``guard`` (the
    driver's own scoring, ``in_driver.py``: no budget runs there) it only measures."""

    def __init__(self, job: JobFile, pool: ActorPool, counter: Any, todo_rows: int) -> None:
        self.job, self.counter, self.todo_rows = job, counter, todo_rows
        self.cpus, self.gpus = float(pool["reserved_cpus"]), float(pool["reserved_gpus"])
        self.prices: Mapping[str, float] = dict(job.prices)
        self.started = self.ended = 0.0
        self.stopped: tuple[str, float] | None = None  # why the budget stopped the write ("cost"/"tokens"), when
        self.seen: tuple[int, int | None] = (0, None)  # the counter's last (rows, output tokens)
        self._reading: Any = None  # the counter read in flight (an ObjectRef)
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

    def deadline_s(self) -> float | None:
        """Seconds of holding the reservation after which the job is stopped, or None without a cost
        limit. The estimate grows linearly with time held, so ``max_cost`` is a deadline: the seconds
        at which the estimate reaches it, less :data:`STOP_MARGIN_S` for Ray Data to notice and shut
        its operators down (at most half of them, so a small budget still leaves the job time)."""
        limit, per_second = self.job.job_spec.max_cost, self.cost(1.0)
        if limit is None or not per_second:
            return None
        at_limit = limit / per_second
        return max(at_limit - STOP_MARGIN_S, at_limit / 2)

    # --- the guard ---------------------------------------------------------------------------------------
    def guard(self, ds: Any) -> Meter:
        """Have Ray Data's executor call :meth:`step` at each step of the write's execution loop.

        The loop already wakes at least every 0.1 s while tasks run (``ray.wait`` with a timeout), and
        an error raised in it ends the execution as any failed task does: the executor shuts its
        operators down and the write raises the error in the driver. Nothing else runs: no thread, no
        signal. Returns the meter, to enter around the write."""
        if not self.guarded:
            return self
        callback = type("BatchinferBudget", (_ray_types()[1],), {"on_execution_step": lambda _, __: self.step()})
        context = ds.context  # the dataset's own copy: the process's DataContext is left alone
        context.custom_execution_callback_classes = [*context.custom_execution_callback_classes, callback]
        return self

    def __enter__(self) -> Meter:
        self.started = time.monotonic()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        self.ended = time.monotonic()
        # our own stop: swallowed here, raised by check() outside any handler (a clean message)
        return self.stopped is not None and exc is not None and isinstance(exc, _ray_types()[0])

    def step(self, now: float | None = None) -> None:
        """Stop the write (raise) once it has held the reservation for :meth:`deadline_s`, or once the
        output tokens the counter has seen pass ``max_output_tokens_total``."""
        now = time.monotonic() if now is None else now
        if self.stopped is None:
            deadline = self.deadline_s()
            if deadline is not None and self.held_s(now) >= deadline:
                self.stopped = ("cost", self.held_s(now))
            elif self._over_tokens(self._read_counter()):
                self.stopped = ("tokens", self.held_s(now))
        if self.stopped is not None:
            what = "max_cost" if self.stopped[0] == "cost" else "max_output_tokens_total"
            print(
                f"[batchinfer] budget: {what} reached after {self.stopped[1]:.1f}s held; stopping the job", flush=True
            )
            raise _ray_types()[0](f"stopped by JobSpec.{what}")

    def _read_counter(self) -> tuple[int, int | None]:
        """The counter's (rows, output tokens) as last read, without waiting: one read is in flight
        at a time and is taken once it has arrived. Only with a token limit (the cost needs no count)."""
        if self.counter is None or self.job.job_spec.max_output_tokens_total is None:
            return self.seen
        import ray

        if self._reading is None:
            self._reading = self.counter.budget_view.remote()
        elif ray.wait([self._reading], timeout=0)[0]:
            try:
                self.seen = ray.get(self._reading)
            except Exception:  # the counter is gone: the job's own failure follows; keep the last reading
                pass
            self._reading = None
        return self.seen

    def _over_tokens(self, seen: tuple[int, int | None]) -> bool:
        limit = self.job.job_spec.max_output_tokens_total
        return limit is not None and seen[1] is not None and seen[1] > limit

    def over_budget(self) -> str | None:
        """Why the job may not commit, or None: the guard stopped it, or the finished job is over a
        limit after all (a write that ended between two steps of Ray Data's loop)."""
        spec = self.job.job_spec
        rows, tokens = self.seen
        kind, held = self.stopped or ("", self.held_s())
        cost = self.cost(held) or 0.0
        if kind == "cost" or (not kind and spec.max_cost is not None and cost > spec.max_cost):
            verb = "exceeded" if cost > (spec.max_cost or 0.0) else "would exceed"  # a stop Ray Data's loop delayed
            return (
                f"the estimated cost {verb} JobSpec.max_cost={spec.max_cost:g}: {cost:.6g} after {held:.1f}s "
                f"holding {self.cpus:g} CPU / {self.gpus:g} GPU, {rows:,} of {self.todo_rows:,} rows scored"
            )
        if kind == "tokens" or self._over_tokens(self.seen):
            return (
                f"{tokens:,} output tokens exceed JobSpec.max_output_tokens_total={spec.max_output_tokens_total:,} "
                f"after {rows:,} of {self.todo_rows:,} rows scored (estimated cost {cost:.6g})"
            )
        return None

    def check(self, run_dir: str) -> None:
        """After the write: raise :class:`BudgetExceededError` when the guard stopped the job, or when
        the finished job's usage is over its limit."""
        if self.counter is not None:
            import ray

            try:  # the latencies and tokens for the manifest and the message; Ray is shut down right after
                self.stats = ray.get(self.counter.summary.remote(), timeout=30)
                self.seen = (int(self.stats["rows"]), self.stats["output_tokens"])
            except Exception:  # the record is still worth writing without them; keep the last reading
                pass
        reason = self.over_budget() if self.guarded else None
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


@functools.cache
def _ray_types() -> tuple[type[Exception], type]:
    """The guard's stop (an ``ExecutionTimeoutError``, so Ray Data logs it as a timeout, not as a bug
    of its own) and Ray Data's callback base; imported on first use: ``ray.data`` is a heavy import."""
    import ray.data.exceptions
    from ray.data._internal.execution.execution_callback import ExecutionCallback

    timeout_error = getattr(ray.data.exceptions, "ExecutionTimeoutError", Exception)  # older Ray: logged as a bug
    return type("BudgetStop", (timeout_error,), {}), ExecutionCallback
