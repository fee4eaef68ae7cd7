"""The batch runs pages' pure parts: a row from an XCom value, pagination, formatting, the manifest's
readable form, the SVG trend plot, where the run page may read and which tasks are the operator."""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET

import pytest

from airflow_provider_batchinfer import BatchInferenceOperator
from airflow_provider_batchinfer.contract import FileEntry
from airflow_provider_batchinfer.contract.tables import TableOutput
from airflow_provider_batchinfer.store.roots import Placed, Refused, check_local, open_placed, place
from airflow_provider_batchinfer.ui.identity import OPERATOR_CLASS, OPERATOR_MODULE, operator_tasks
from airflow_provider_batchinfer.ui.views import (
    MAX_PAGE_SIZE,
    Page,
    fmt_bytes,
    fmt_cost,
    fmt_seconds,
    manifest_view,
    page_bounds,
    run_row,
    svg_plot,
    trend_points,
)
from tests.runs import manifest_for

TI = {
    "dag_id": "d",
    "task_id": "t",
    "run_id": "r",
    "map_index": -1,
    "try_number": 2,
    "state": "success",
    "duration": 9.0,
}


def test_a_row_takes_its_figures_from_the_return_value_and_its_usage():
    value = {
        "rows": 98,
        "input_rows": 100,
        "error_rows": 2,
        "model": "m",
        "model_version": "v1",
        "sha256": "a" * 64,
        "output_location": "/stage/r",
        "attempt": "t02x",
        "reused_rows": 40,
        "usage": {"wall_s": 4.0, "rows_per_s": 25.0, "cpu_seconds": 8.0, "gpu_seconds": 0.0, "cost": 0.0001},
    }
    row = run_row(TI, value)
    assert (row.input_rows, row.output_rows, row.error_rows, row.reused_rows) == (100, 98, 2, 40)
    assert (row.wall_s, row.rows_per_s, row.cpu_seconds, row.cost) == (4.0, 25.0, 8.0, 0.0001)
    assert (row.try_number, row.attempt, row.output_location) == (2, "t02x", "/stage/r")


def test_a_row_without_usage_falls_back_on_the_task_duration_and_without_a_result_shows_nothing():
    old = run_row(TI, {"rows": 90, "input_rows": 90, "error_rows": 0})
    assert (old.wall_s, old.rows_per_s, old.cost) == (9.0, 10.0, None)
    pending = run_row({**TI, "state": "running"}, None)
    assert (pending.input_rows, pending.wall_s, pending.model, pending.state) == (None, None, None, "running")
    odd = run_row(TI, {"input_rows": "many", "usage": "none", "rows": float("nan")})
    assert (odd.input_rows, odd.output_rows, odd.cpu_seconds) == (None, None, None)


def test_pages_are_bounded_and_link_by_offset():
    assert page_bounds("-5", "100000") == (0, MAX_PAGE_SIZE)
    assert page_bounds("x", None) == (0, 50)
    page = Page(offset=50, limit=50, total=120)
    assert (page.first, page.last, page.prev_offset, page.next_offset) == (51, 100, 0, 100)
    assert Page(0, 50, 0).first == 0 and Page(100, 50, 120).next_offset is None


def test_formatting():
    assert [fmt_seconds(v) for v in (None, 12.34, 245, 7380)] == ["–", "12.3 s", "4 min 05 s", "2 h 03 min"]
    assert [fmt_bytes(v) for v in (None, 512, 2048, 5 * 1024**3)] == ["–", "512 B", "2.0 KiB", "5.0 GiB"]
    assert [fmt_cost(v) for v in (None, 0.0, 0.00123, 1.5)] == ["–", "0.0000", "0.0012", "1.5000"]


def test_the_manifest_view_shows_parts_lineage_and_the_snapshot_but_no_catalog_settings():
    files = (FileEntry("part-00000-t01a.parquet", 100, 3, "b" * 64),)
    table = TableOutput(
        "ml.scores", {"uri": "sqlite:///c.db", "s3.secret-access-key": "k"}, "r", "overwrite", "/c", "/t"
    )
    manifest = dataclasses.replace(manifest_for("/t/data/r/t01a", files), table=table.with_snapshot(77))
    view = manifest_view(manifest)
    assert view["files"] == [{"name": "part-00000-t01a.parquet", "size": 100, "rows": 3, "sha256": "b" * 64}]
    assert view["lineage"] == {"inputs": ["/data/in"], "outputs": ["iceberg://ml.scores"]}
    assert view["table"]["snapshot_id"] == 77 and "catalog" not in view["table"]
    assert "secret" not in repr(view)


def test_trend_points_and_the_svg_plot():
    rows = [
        run_row(
            {**TI, "run_id": "a"}, {"input_rows": 1000, "error_rows": 10, "usage": {"rows_per_s": 50.0, "cost": 0.002}}
        ),
        run_row({**TI, "run_id": "b", "state": "failed"}, None),
        run_row({**TI, "run_id": "c"}, {"input_rows": 0, "error_rows": 0, "usage": {"rows_per_s": None}}),
    ]
    points = trend_points(rows)
    assert [p.run_id for p in points] == ["a", "c"]
    assert (points[0].cost_per_million, points[0].error_fraction) == (2.0, 0.01)
    assert (points[1].cost_per_million, points[1].error_fraction, points[1].rows_per_s) == (None, None, 0.0)
    svg = svg_plot([p.rows_per_s for p in points], [p.run_id for p in points], "rows/s <&>")
    root = ET.fromstring(svg)  # well-formed, the title escaped
    assert root.tag.endswith("svg") and len(root.findall("{http://www.w3.org/2000/svg}circle")) == 2
    assert "no data" in svg_plot([None], ["x"], "empty")
    assert ">25,945<" in svg_plot([25945.2, 1.0], ["a", "b"], "rows/s") and ">0.0552<" in svg_plot([0.0552], ["a"], "x")


# --- where the run page and the table reader may read (roots.py); which tasks are the operator (ui/identity.py)
ROOTS = {"stage_root": "/srv/stage", "registry_root": "s3://lake/registry"}
SHOWN = "the connection's roots (stage_root /srv/stage, registry_root s3://lake/registry)"


def test_a_location_below_a_root_is_placed_and_anything_else_is_refused():
    assert place("/srv/stage/emb/run1", ROOTS) == Placed("/srv/stage", ("emb", "run1"))
    assert place("file:///srv/stage/emb/", ROOTS) == Placed("/srv/stage", ("emb",))
    assert place("file:/srv/stage/_iceberg/t/data", ROOTS) == Placed("/srv/stage", ("_iceberg", "t", "data"))
    assert place("s3a://lake/registry/m/v1", ROOTS) == Placed("s3://lake/registry", ("m", "v1"))
    refused = {
        "/srv/stage-other/run": f"/srv/stage-other/run is outside {SHOWN}: runs are read only below them",
        "/srv/stage/../etc": f"contains '..'; paths may not climb out of their root; runs are read only below {SHOWN}",
        "s3://lake/registry-x/run": "is outside",
        "s3://other/registry/run": "is outside",
        "gs://lake/registry/run": f"is a gs:// location, and the connection configures no root there: runs are "
        f"read only below {SHOWN}",
        "http://127.0.0.1:9/x": "is a http:// location",
        "s3://lake/registry/run?endpoint_override=127.0.0.1": f"holds a query, a fragment, a backslash or a control "
        f"character, which no location the provider writes has; runs are read only below {SHOWN}",
        "/srv/stage/run#x": "holds a query, a fragment",
        "/srv/stage/run\nx": "control character",
        "emb/run1": "is not an absolute path or URI",
        "": "is not a usable location",
    }
    for location, message in refused.items():
        with pytest.raises(Refused) as info:
            place(location, ROOTS)
        assert message in str(info.value), (location, str(info.value))
    with pytest.raises(Refused, match="None is not a usable location"):
        place(None, ROOTS)
    with pytest.raises(
        Refused, match=r"configures no root there: runs are read only below the connection's roots \(none configured\)"
    ):
        place("/srv/stage/run", {"stage_root": ""})


def test_a_local_path_is_checked_after_its_symlinks(tmp_path):
    root, outside = tmp_path / "stage", tmp_path / "outside"
    (root / "run" / "_errors").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.parquet").write_bytes(b"x")
    (root / "run" / "_errors" / "part.parquet").symlink_to(outside / "secret.parquet")
    (root / "run" / "_errors" / "own.parquet").write_bytes(b"y")
    check_local(str(root / "run" / "_errors" / "own.parquet"), str(root))
    with pytest.raises(Refused, match=r"resolves to .*outside/secret.parquet, outside the connection's root"):
        check_local(str(root / "run" / "_errors" / "part.parquet"), str(root))


def test_a_placed_location_is_opened_from_its_root_and_keeps_its_spelling(tmp_path):
    """The root is opened (the connection's way), never the location; a refused one opens nothing."""
    from airflow_provider_batchinfer.store.stage import Stage

    (tmp_path / "stage" / "run").mkdir(parents=True)
    opened: list[str] = []

    def open_root(root: str) -> Stage:
        opened.append(root)
        return Stage.open(root)

    roots = {"stage_root": str(tmp_path / "stage")}
    stage = open_placed(f"file:{tmp_path}/stage/run", roots, open_root)
    assert (stage.location, stage.path, stage.fs.type_name) == (
        f"file:{tmp_path}/stage/run",
        f"{tmp_path}/stage/run",
        "local",
    )
    assert opened == [str(tmp_path / "stage")]
    (tmp_path / "stage" / "link").symlink_to(tmp_path)
    opened.clear()
    for location in (f"{tmp_path}/other", "gs://b/x?endpoint_override=127.0.0.1:9", f"{tmp_path}/stage/link"):
        with pytest.raises(Refused):
            open_placed(location, roots, open_root)
    assert opened == [str(tmp_path / "stage")]  # only the link's root was opened, and the link refused


def test_the_operator_is_known_by_its_module_and_class():
    assert (BatchInferenceOperator.__module__, BatchInferenceOperator.__name__) == (OPERATOR_MODULE, OPERATOR_CLASS)

    def task(task_id: str, module: str, cls: str = OPERATOR_CLASS) -> dict:
        return {"__type": "operator", "__var": {"task_id": task_id, "task_type": cls, "_task_module": module}}

    data = {
        "dag": {
            "tasks": [
                task("real", OPERATOR_MODULE),
                task("look_alike", "dags.my_dag"),
                task("other", OPERATOR_MODULE, "SuccessMarkerSensor"),
                "not a task",
            ]
        }
    }
    assert operator_tasks(data) == {"real"}
    assert operator_tasks(None) == operator_tasks({"dag": {"tasks": "x"}}) == frozenset()
