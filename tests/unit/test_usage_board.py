"""The cluster's usage board keeps each job's counter apart (runtime/model/usage_board.py), here without Ray."""

from __future__ import annotations

import pickle

import pytest

from airflow_provider_batchinfer.runtime.model import usage_board
from airflow_provider_batchinfer.runtime.model.usage_board import COUNTER_METHODS, JobCounter, UsageBoard, board_name


def test_jobs_on_one_board_count_apart_and_a_finished_job_is_dropped():
    board = UsageBoard()
    board.call("a/1", "add", 10)
    board.call("b/1", "add", 3)
    board.call("a/1", "batch", 5, 0.2, None)
    board.call("a/1", "placed", "actor-1", "node-1", "127.0.0.1")
    assert board.call("a/1", "get") == 10 and board.call("b/1", "get") == 3
    assert board.call("a/1", "placements") == [("actor-1", "node-1", "127.0.0.1")]
    assert board.call("a/1", "summary")["batches"] == 1 and board.call("b/1", "summary")["batches"] == 0
    board.forget("a/1")
    assert board.jobs() == 1 and board.call("a/1", "get") == 0  # a new entry: the old one is gone


def test_an_entry_no_call_touched_for_hours_is_dropped_when_a_new_job_comes(monkeypatch):
    board = UsageBoard()
    now = [1000.0]
    monkeypatch.setattr(usage_board.time, "monotonic", lambda: now[0])
    board.call("dead/1", "add", 1)  # its driver died before forgetting it
    now[0] += usage_board.STALE_S + 1
    board.call("live/1", "add", 1)
    assert board.jobs() == 1


def test_only_counter_methods_are_answered():
    with pytest.raises(AttributeError, match="no method '_drop_stale'"):
        UsageBoard().call("a/1", "_drop_stale", 0.0)
    counter = JobCounter(board=None, key="a/1")
    with pytest.raises(AttributeError):
        counter.forget  # not a counter method: never sent to the board
    assert {"add", "batch", "placed", "summary"} <= COUNTER_METHODS


def test_the_job_counter_pickles_for_the_replicas_and_the_name_follows_the_code():
    counter = pickle.loads(pickle.dumps(JobCounter(board="handle", key="job/abc")))
    assert (counter.board, counter.key) == ("handle", "job/abc")
    assert board_name() == board_name() and board_name().startswith("usage-board-")
