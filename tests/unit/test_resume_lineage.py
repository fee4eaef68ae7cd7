"""SaveMode.RESUME keeps only the parts of one lineage of attempts of the same result.

The claim (``_job.json``) lists the attempts whose parts are resumable (``JobFile.resumable``); a
new attempt inherits that list only when its result identity matches the claim's, else it lists
only itself. The runtime deletes a part of any other attempt before it scores (a zombie's late
part, or one scored for another input), and where two kept parts hold the same row the newest
attempt's wins, by the claim's order, never by how the names sort. For a query input, the digest
of the result the kept parts came from travels in the claim from one attempt to the next.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from contextlib import closing
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_batchinfer.contract import INPUT_DIR, ContractError, JobFile, RunOwner, part_name
from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, SaveMode
from airflow_provider_batchinfer.contract.sql_input import SQL_URL_ENV, SqlInput
from airflow_provider_batchinfer.runtime.inputs import sql_input
from airflow_provider_batchinfer.runtime.rows.resume import collect_committed, resume_state
from airflow_provider_batchinfer.store.commit.rundir import Preparation, claim, prepare, read_claim
from airflow_provider_batchinfer.store.identity import materialized_digest, result_identity
from airflow_provider_batchinfer.store.stage import Stage
from tests.runs import MODEL, OWNER, job_file

OLD, NEW, THIRD = "t01aaaa", "t02bbbb", "t03cccc"


def _part(run: Path, name: str, ids: list[int], text: str) -> None:
    """One complete part whose rows all hold ``text`` (which attempt's rows a reader got)."""
    path = run / name
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "text": [text] * len(ids)}), path)


def _texts(run: Path, names) -> dict[int, str]:
    table = pq.read_table([str(run / n) for n in names])
    return dict(zip(table["id"].to_pylist(), table["text"].to_pylist(), strict=True))


# --- the runtime: which parts are kept, and which wins ------------------------------------------------------


def test_where_two_kept_parts_hold_the_same_rows_the_newest_attempt_s_part_wins(tmp_path):
    """``part-00000-t01…`` sorts before ``part-00000-t02…``: the claim's order decides, not the names."""
    _part(tmp_path, part_name(0, OLD), [1, 2], "OLD")
    _part(tmp_path, part_name(0, NEW), [1, 2], "NEW")
    kept = collect_committed(Stage.open(str(tmp_path)), "id", attempts=(OLD, NEW))
    assert [f.name for f in kept["files"]] == [part_name(0, NEW)] and kept["rows"] == 2
    assert kept["removed"] == [part_name(0, OLD)] and not (tmp_path / part_name(0, OLD)).exists()
    assert _texts(tmp_path, [f.name for f in kept["files"]]) == {1: "NEW", 2: "NEW"}

    # the same names with the lineage the other way round: the claim's order is what counts
    _part(tmp_path, part_name(0, OLD), [1, 2], "OLD")
    kept = collect_committed(Stage.open(str(tmp_path)), "id", attempts=(NEW, OLD))
    assert [f.name for f in kept["files"]] == [part_name(0, OLD)] and kept["removed"] == [part_name(0, NEW)]


def test_a_resume_reads_the_rows_of_the_older_part_again_only_where_no_newer_part_holds_them(tmp_path):
    """Through ``resume_state`` (the done set): the older part overlaps the newer one in row 2, so it
    is deleted and its other row (1) is scored again; row 3 was never scored."""
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": pa.array([1, 2, 3, 4], pa.int64()), "x": [0.1, 0.2, 0.3, 0.4]}), source)
    run = tmp_path / "run"
    job = dataclasses.replace(
        job_file(run, attempt=THIRD, inputs=(str(source),)), resume=True, resumable=(OLD, NEW, THIRD)
    )
    claim(Stage.open(str(run)), job)
    _part(run, part_name(0, OLD), [1, 2], "OLD")
    _part(run, part_name(3, NEW), [2, 4], "NEW")
    kept = resume_state(job, Stage.open(str(run)), [str(source)], [[4]], ["id", "x"])
    assert [f.name for f in kept["files"]] == [part_name(3, NEW)] and kept["removed"] == [part_name(0, OLD)]
    assert pq.read_table(kept["read"].files)["id"].to_pylist() == [1, 3]


def test_parts_of_an_attempt_the_claim_does_not_list_are_deleted_before_anything_is_scored(tmp_path, capsys):
    """A zombie of another result wrote into the directory after the newer try claimed it: its part
    and its dead-letter part go (even where no kept part holds their rows), and so does a part name
    that carries no attempt."""
    zombie = "t01zzzz"
    _part(tmp_path, part_name(0, NEW), [1, 2], "NEW")
    _part(tmp_path, part_name(1, zombie), [3, 4], "ZOMBIE")
    _part(tmp_path, part_name(2, zombie, dead_letter=True), [5], "ZOMBIE")
    _part(tmp_path, "part-unnamed.parquet", [6], "NOBODY")
    kept = collect_committed(Stage.open(str(tmp_path)), "id", attempts=(NEW, THIRD))
    assert [f.name for f in kept["files"]] == [part_name(0, NEW)] and kept["error_files"] == []
    assert kept["rows"] == 2 and kept["error_rows"] == 0
    assert sorted(kept["removed"]) == sorted(
        [part_name(1, zombie), part_name(2, zombie, dead_letter=True), "part-unnamed.parquet"]
    )
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.parquet")) == [part_name(0, NEW)]
    assert (
        f"resume: removed {part_name(1, zombie)}: attempt {zombie} is not one the claim lists as resumable"
        in capsys.readouterr().out
    )


# --- the claim: which attempts a new one inherits ---------------------------------------------------------


def _result(fingerprint=(("/data/in/a.parquet", 100, 1),)) -> dict[str, str]:
    return result_identity(
        input_fingerprint=[list(f) for f in fingerprint],
        model_sha256=MODEL.sha256,
        input_spec=InputSpec(id_column="id"),
        job_spec=JobSpec(),
        model_flavor=MODEL.flavor,
    )


def _try(run: Path, attempt: str, try_number: int, mode=SaveMode.RESUME, result=None, **kwargs) -> Preparation:
    """One try as the operator makes it: prepare, then claim with the lineage prepare decided."""
    owner = dataclasses.replace(OWNER, try_number=try_number)
    result = _result() if result is None else result
    args = {"materialized_input": False, **kwargs}
    prep = prepare(Stage.open(str(run)), owner, mode, result=result, **args)
    job = dataclasses.replace(
        job_file(run, attempt=attempt, owner=owner), result=result, resume=prep.resume, resumable=prep.lineage(attempt)
    )
    claim(Stage.open(str(run)), job)
    return prep


def _lineage(run: Path) -> tuple[str, ...]:
    recorded = read_claim(Stage.open(str(run)))
    assert recorded is not None
    return recorded.resumable_attempts


def test_a_new_attempt_inherits_the_lineage_only_when_its_result_is_the_same(tmp_path):
    run = tmp_path / "run"
    _try(run, OLD, 1)  # a fresh start: only itself
    assert _lineage(run) == (OLD,)
    _part(run, part_name(0, OLD), [1], "OLD")
    _try(run, NEW, 2)  # the same result: it inherits
    assert _lineage(run) == (OLD, NEW) and (run / part_name(0, OLD)).exists()
    _try(run, THIRD, 3)
    assert _lineage(run) == (OLD, NEW, THIRD)

    changed = _result(fingerprint=(("/data/in/a.parquet", 100, 2),))  # the input was rewritten
    prep = _try(run, "t04dddd", 4, result=changed)
    assert not prep.resume and _lineage(run) == ("t04dddd",) and not (run / part_name(0, OLD)).exists()
    assert "differs in input" in prep.messages[0]
    _try(run, "t05eeee", 5, mode=SaveMode.OVERWRITE, result=changed)
    assert _lineage(run) == ("t05eeee",)
    _try(run, "t06ffff", 6, mode=SaveMode.ERROR, result=changed)  # clears its own retry's leftovers
    assert _lineage(run) == ("t06ffff",)
    _try(run, "t07gggg", 7, result=changed)
    assert _lineage(run) == ("t06ffff", "t07gggg")


def test_another_task_instance_s_claim_is_never_inherited(tmp_path):
    run = tmp_path / "run"
    _try(run, OLD, 1)
    other = RunOwner(dag_id=OWNER.dag_id, task_id=OWNER.task_id, run_id=OWNER.run_id, try_number=2, map_index=1)
    prep = prepare(Stage.open(str(run)), other, SaveMode.RESUME, result=_result(), materialized_input=False)
    assert not prep.resume and prep.lineage(NEW) == (NEW,)


def test_a_claim_an_older_provider_wrote_lists_only_its_own_attempt_and_a_bad_list_is_refused(tmp_path):
    job = dataclasses.replace(job_file(tmp_path, attempt=NEW), resumable=(OLD, NEW))
    data = json.loads(job.to_json())
    assert data["resumable"] == [OLD, NEW] and JobFile.from_json(job.to_json()) == job
    del data["resumable"]
    older = JobFile.from_json(json.dumps(data))
    assert older.resumable == () and older.resumable_attempts == (NEW,)
    with pytest.raises(ContractError, match=r"_job.json.resumable must be a list, got str"):
        JobFile.from_json(json.dumps({**data, "resumable": "t01aaaa"}))
    with pytest.raises(ContractError, match=r"_job.json.resumable must be a list of strings"):
        JobFile.from_json(json.dumps({**data, "resumable": [1]}))
    with pytest.raises(ContractError, match=r"_job.json.resumable holds '\.\./x', which is not an attempt id"):
        JobFile.from_json(json.dumps({**data, "resumable": ["../x"]}))
    # the attempt itself is always the newest, whatever the list says
    assert dataclasses.replace(job, resumable=(NEW, OLD)).resumable_attempts == (OLD, NEW)


# --- a query input: the digest of the kept parts' result travels in the claim ---------------------------


QUERY = "SELECT id, text FROM tickets ORDER BY id"


@pytest.fixture
def database(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "tickets.db"
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("CREATE TABLE tickets (id INTEGER PRIMARY KEY, text TEXT)")
        conn.executemany("INSERT INTO tickets VALUES (?, ?)", [(i, f"v1 {i}") for i in range(4)])
    monkeypatch.setenv(SQL_URL_ENV, f"sqlite:///{path}")
    return path


def _change(database: Path, version: str) -> None:
    with closing(sqlite3.connect(database)) as conn, conn:
        conn.execute("UPDATE tickets SET text = ? || substr(text, 3)", (version,))


def _sql_try(run: Path, attempt: str, try_number: int) -> tuple[JobFile, Preparation]:
    """A query-driven try as the operator makes it: prepare, then claim with the query's kept digest."""
    owner = dataclasses.replace(OWNER, try_number=try_number)
    result = _result(fingerprint=((QUERY, 0, 0),))
    prep = prepare(
        Stage.open(str(run)), owner, SaveMode.RESUME, result=result, materialized_input=True, requeried_input=True
    )
    job = dataclasses.replace(
        job_file(run, attempt=attempt, owner=owner, inputs=(f"{run}/{INPUT_DIR}",)),
        result=result,
        resume=prep.resume,
        resumable=prep.lineage(attempt),
        sql_input=SqlInput(query=QUERY, conn_id="tickets", chunk_rows=2, kept_digest=prep.input_digest),
    )
    claim(Stage.open(str(run)), job)
    return job, prep


def _materialize_only(job: JobFile) -> Path:
    """What a try killed after it re-ran the query, before it compared the result, leaves: its
    ``_input/<attempt>/`` (the first half of ``read_sql_input``)."""
    assert job.sql_input is not None
    dest = Stage.open(job.input_locations[0]).child(job.attempt)
    dest.fs.create_dir(dest.path, recursive=True)
    sql_input.stream(job.sql_input, dest)
    return Path(dest.path)


def test_a_try_killed_while_it_re_ran_the_query_does_not_move_what_the_kept_parts_are_compared_with(
    tmp_path, database, capsys
):
    """Try 1 scores a part from result v1 and dies. The table changes to v2. Try 2 keeps that part
    (its claim carries v1's digest), re-runs the query (v2) into its ``_input/`` and is killed
    before it compares. Try 3 must still compare with v1, not with try 2's leftover v2, so its own
    v2 result drops the v1 part."""
    run = tmp_path / "run"
    first, _ = _sql_try(run, OLD, 1)
    sql_input.read_sql_input(first, None)
    _part(run, part_name(0, OLD), [0, 1], "v1")
    v1 = materialized_digest(Stage.open(str(run / INPUT_DIR / OLD)))

    _change(database, "v2")
    second, prep = _sql_try(run, NEW, 2)
    assert prep.input_digest == v1 and second.sql_input is not None and second.sql_input.kept_digest == v1
    leftover = _materialize_only(second)
    assert materialized_digest(Stage.open(str(leftover))) != v1

    third, prep = _sql_try(run, THIRD, 3)
    assert prep.input_digest == v1  # from the claim, not from try 2's _input/
    assert third.sql_input is not None and third.sql_input.kept_digest == v1
    assert _lineage(run) == (OLD, NEW, THIRD)
    capsys.readouterr()
    sql_input.read_sql_input(third, None)
    assert not (run / part_name(0, OLD)).exists()  # scored from v1: every row is scored from v2
    assert "the query's result changed; removed the 1 file(s) it kept" in capsys.readouterr().out


def test_after_a_try_found_the_result_changed_only_its_own_parts_are_kept(tmp_path, database):
    """Try 2 compared, found v2, removed the v1 part and scored its own from v2; a late v1 part of
    try 1 (a zombie of it) appeared after. Try 3 keeps only try 2's lineage from then on, and
    compares with v2, so a result back at v1 drops try 2's parts too."""
    run = tmp_path / "run"
    first, _ = _sql_try(run, OLD, 1)
    sql_input.read_sql_input(first, None)
    _part(run, part_name(0, OLD), [0, 1], "v1")

    _change(database, "v2")
    second, _ = _sql_try(run, NEW, 2)
    sql_input.read_sql_input(second, None)  # compares: v2 differs, the v1 part is removed
    assert not (run / part_name(0, OLD)).exists()
    _part(run, part_name(0, NEW), [0, 1], "v2")
    _part(run, part_name(1, OLD), [2, 3], "v1")  # the zombie's late part
    v2 = materialized_digest(Stage.open(str(run / INPUT_DIR / NEW)))

    third, prep = _sql_try(run, THIRD, 3)
    assert prep.input_digest == v2 and _lineage(run) == (NEW, THIRD)
    assert "found the query's result changed and scored from the new one" in " ".join(prep.messages)
    sql_input.read_sql_input(third, None)  # still v2: try 2's part stays
    kept = resume_state(third, Stage.open(str(run)))
    assert [f.name for f in kept["files"]] == [part_name(0, NEW)] and kept["removed"] == [part_name(1, OLD)]

    _change(database, "v1")  # the result goes back to v1: try 2's v2 parts were not scored from it
    fourth, prep = _sql_try(run, "t04dddd", 4)
    assert prep.input_digest == v2 and _lineage(run) == (NEW, THIRD, "t04dddd")
    sql_input.read_sql_input(fourth, None)
    assert not (run / part_name(0, NEW)).exists()
