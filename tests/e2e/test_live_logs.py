"""Live logs: while a deferred ``ray_jobs`` job runs, :class:`RayJobTrigger` logs the driver's new
lines (progress, rows/s, ETA) on every poll, from threads that never block the triggerer's loop,
and ``execute_complete`` forwards only what the trigger did not log. Against the session's real
``ray start --head`` cluster."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import pytest

from airflow_provider_batchinfer.launchers.ray_jobs import new_log_lines
from airflow_provider_batchinfer.triggers.base import event_log_offset
from airflow_provider_batchinfer.triggers.ray_job import RayJobTrigger
from tests.e2e import test_ray_jobs, test_reattach
from tests.e2e.test_reattach import gated_tickets
from tests.task_context import TaskInstanceStandIn

# the cluster connection and a launcher on it (the ray_jobs tests' own fixtures), and a model whose
# job runs until its gate is opened (the re-attach tests')
ray_jobs_conn, launcher = test_ray_jobs.ray_jobs_conn, test_ray_jobs.launcher
gated_model, gate = test_reattach.gated_model, test_reattach.gate
PROGRESS = "[batchinfer] progress:"


class Recorder(logging.Handler):
    """Every record a logger emits, with the wall time it was emitted at."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.created, record.getMessage()))


def _recorded_logger(name: str) -> tuple[logging.Logger, Recorder]:
    logger = logging.getLogger(f"test_live_logs.{name}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    recorder = Recorder()
    logger.handlers = [recorder]
    return logger, recorder


def test_only_complete_lines_are_forwarded_and_the_offset_moves_past_them():
    text = "a\nb\npartial"
    assert new_log_lines(text, 0, final=False) == (["a", "b"], 4)
    assert new_log_lines(text, 4, final=False) == ([], 4)  # a line still being written waits
    assert new_log_lines(text + " line\nc\n", 4, final=False) == (["partial line", "c"], len(text) + 8)
    assert new_log_lines(text, 4, final=True) == (["partial"], len(text))  # the job ended: all of it


def test_the_offset_travels_in_the_trigger_and_its_events():
    trigger = RayJobTrigger(submission_id="sid", model_service_conn_id="c", log_offset=120)
    assert trigger.serialize()[1]["log_offset"] == 120
    assert RayJobTrigger(**trigger.serialize()[1]).log_offset == 120
    with pytest.raises(ValueError, match="log_offset must be a character offset >= 0, got -1"):
        RayJobTrigger(submission_id="sid", model_service_conn_id="c", log_offset=-1)
    assert event_log_offset({"log_offset": 42}) == 42
    # an event from a trigger that logged nothing (or an older one) forwards the whole log
    assert event_log_offset({}) == 0 and event_log_offset({"log_offset": "7"}) == 0


@pytest.mark.usefixtures("airflow_db")
def test_a_deferred_job_s_progress_reaches_the_log_while_it_runs(ray_jobs_conn, launcher, gated_model, gate, tmp_path):
    """The job is held at its gate until the trigger has logged a progress line: two minutes at
    most, so a trigger that logs none while the job runs fails the test instead of hanging it."""
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_provider_batchinfer import BatchInferenceOperator, JobSpec, OutputSpec

    tickets = gated_tickets(tmp_path / "input", rows=200, files=2, gate=gate)
    op = BatchInferenceOperator(
        task_id="infer",
        model="gated_length",
        version="v1",
        input=str(tickets),
        output_spec=OutputSpec(stage_location=str(tmp_path / "out")),
        job_spec=JobSpec(max_batch_rows=50, progress_interval_s=1.0),
        deferrable=True,
        poll_interval=1.0,
    )
    ti = TaskInstanceStandIn(run_id="manual__live_logs")
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": ti})
    trigger = deferred.value.trigger
    assert isinstance(trigger, RayJobTrigger)
    trigger._log, trigger_log = _recorded_logger("trigger")  # where the triggerer routes a trigger's log

    async def watch():
        ticks: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            open_by = time.monotonic() + 120
            while not done.is_set():
                ticks.append(time.monotonic())
                logged = any(m.startswith(PROGRESS) for _t, m in trigger_log.records)
                if not gate.exists() and (logged or time.monotonic() > open_by):
                    gate.touch()
                await asyncio.sleep(0.05)

        ticking = asyncio.create_task(ticker())
        event = await anext(trigger.run())  # the trigger's one event: the job ended
        done.set()
        await ticking
        return event, ticks

    event, ticks = asyncio.run(watch())

    payload = event.payload
    assert payload["status"] == "success", payload
    info = launcher.client().get_job_info(trigger.submission_id)
    ended_at = info.end_time / 1000  # the cluster's end of the job, epoch seconds
    progress = [(t, m) for t, m in trigger_log.records if m.startswith(PROGRESS)]
    assert [m for t, m in progress if t < ended_at], (
        f"no progress line logged before the job ended: {trigger_log.records}"
    )
    # the loop was never blocked for long: the Jobs API calls ran in threads
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert len(ticks) > 20 and max(gaps) < 2.0, max(gaps)
    # everything the trigger logged is behind the event's offset, and is not logged a second time
    assert payload["log_offset"] == len(launcher.logs(trigger.submission_id))
    op._cached_logger, task_log = _recorded_logger("task")  # what the operator's ``log`` returns
    result = op.execute_complete({"ti": ti}, payload)
    assert result["rows"] == 200
    assert any(m.startswith("Committed 200 rows") for _t, m in task_log.records), task_log.records
    assert not [m for _t, m in task_log.records if m.startswith(PROGRESS)], task_log.records
