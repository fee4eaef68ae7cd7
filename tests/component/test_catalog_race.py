"""Two first runs open the embedded Iceberg catalog at the same moment: pyiceberg's SQL catalog
creates its tables when it is opened and finds none, so both processes try to create them, and
without care one of them fails with ``table iceberg_tables already exists``. Here two real processes
open a fresh SQLite catalog together, released by one barrier, round after round, and each then
commits a namespace of its own through the catalog it opened."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
from pathlib import Path
from typing import Any

#: rounds with the lock beside the SQLite file, then as many where it cannot be made
ROUNDS = 20


def _catalog(root: str, n: int) -> dict[str, str]:
    from airflow_provider_batchinfer.store.iceberg.catalog import embedded_catalog

    return embedded_catalog(os.path.join(root, f"round-{n}", "stage"), os.path.join(root, "home"))


def _open_and_commit(worker: int, root: str, rounds: int, barrier: Any, results: Any) -> None:
    """One first run per round: open the round's fresh catalog when the other process does, then
    create a namespace (a commit to the catalog). Puts ``(round, worker, error)``."""
    from airflow_provider_batchinfer.store.iceberg.catalog import open_catalog

    open_catalog(_catalog(root, -1 - worker))  # imports done before the first round
    for n in range(rounds):
        props = _catalog(root, n)
        barrier.wait(timeout=60)
        try:
            open_catalog(props).create_namespace(f"w{worker}")
            error = ""
        except Exception as exc:  # reported to the test, which names it
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        results.put((n, worker, error))


def _race(root: Path, rounds: int) -> list[tuple[int, int, str]]:
    context = multiprocessing.get_context("spawn")  # no forked copy of this process's state
    barrier, results = context.Barrier(2), context.Queue()
    workers = [
        context.Process(target=_open_and_commit, args=(w, str(root), rounds, barrier, results)) for w in range(2)
    ]
    for process in workers:
        process.start()
    out = [results.get(timeout=120) for _ in range(2 * rounds)]
    for process in workers:
        process.join(timeout=60)
        assert process.exitcode == 0
    return sorted(out)


def test_two_first_runs_open_a_fresh_catalog_at_once_and_both_commit(tmp_path):
    """Both processes succeed in every round: for the first ``ROUNDS`` the lock beside the SQLite
    file serializes the catalog's creation; for the next ``ROUNDS`` the lock file cannot be opened (a
    directory stands in its place) and the catalog's own 'already exists' is taken as the other
    process's creation, the catalog opened again."""
    for n in range(ROUNDS, 2 * ROUNDS):
        os.makedirs(_catalog(str(tmp_path), n)["uri"].removeprefix("sqlite:///") + ".lock")

    outcomes = _race(tmp_path, 2 * ROUNDS)

    failed = [(n, w, error) for n, w, error in outcomes if error]
    assert not failed, f"{len(failed)} of {4 * ROUNDS} first runs failed: {failed[:3]}"
    for n in range(2 * ROUNDS):
        db = _catalog(str(tmp_path), n)["uri"].removeprefix("sqlite:///")
        with sqlite3.connect(db) as con:
            rows = con.execute("SELECT DISTINCT namespace FROM iceberg_namespace_properties").fetchall()
        assert sorted(r[0] for r in rows) == ["w0", "w1"], f"round {n}"
