"""Airflow's template-field rule: ``__init__`` stores every templated field as given (no read, no
transform), so Jinja strings and XComArgs render at run time; and ``sql`` may name a ``.sql`` file."""

from __future__ import annotations

import pendulum
import pytest

from airflow_provider_batchinfer import BatchInferenceOperator, OutputSpec, SaveMode, SuccessMarkerSensor

START = pendulum.datetime(2026, 1, 1, tz="UTC")


def _jinja(field: str) -> str:
    return f"{{{{ params.{field} }}}}"


@pytest.mark.parametrize("output_field", ["stage_location", "base_stage_location"])
@pytest.mark.parametrize("source", ["input", "sql"])
def test_every_template_field_is_stored_verbatim(output_field, source):
    fields = BatchInferenceOperator.template_fields
    kwargs = {f: _jinja(f) for f in ("model", "version", "model_service_conn_id")}
    kwargs[source] = _jinja(source)
    if source == "sql":
        kwargs["conn_id"] = _jinja("conn_id")
    op = BatchInferenceOperator(
        task_id="t", output_spec=OutputSpec(**{output_field: _jinja(output_field)}, mode=SaveMode.OVERWRITE), **kwargs
    )
    given = {**kwargs, output_field: _jinja(output_field)}
    for field in fields:
        assert getattr(op, field) == given.get(field), field


def test_a_list_input_is_stored_as_given():
    paths = ["{{ params.a }}", "{{ params.b }}"]
    op = BatchInferenceOperator(
        task_id="t", model="m", version="v", input=paths, output_spec=OutputSpec(stage_location="/out")
    )
    assert op.input is paths


def test_the_sensor_stores_its_template_fields_verbatim():
    kwargs = {field: _jinja(field) for field in SuccessMarkerSensor.template_fields}
    op = SuccessMarkerSensor(task_id="gate", **kwargs)
    for field, value in kwargs.items():
        assert getattr(op, field) == value, field


def test_no_template_field_is_a_property_or_derived():
    """Airflow renders by setattr: a template field must be a plain instance attribute."""
    op = BatchInferenceOperator(
        task_id="t", model="m", version="v", input="/in", output_spec=OutputSpec(stage_location="/out")
    )
    for field in BatchInferenceOperator.template_fields:
        assert field in vars(op), field
        assert not isinstance(getattr(type(op), field, None), property), field


def test_sql_renders_from_a_file_on_the_template_search_path(tmp_path):
    from airflow.sdk import DAG

    (tmp_path / "queries").mkdir()
    (tmp_path / "queries" / "x.sql").write_text("SELECT id FROM t WHERE day = '{{ params.day }}'")
    with DAG(
        "bi_templates",
        schedule=None,
        start_date=START,
        template_searchpath=[str(tmp_path)],
        params={"day": "2026-01-02", "out": "/out"},
    ):
        op = BatchInferenceOperator(
            task_id="t",
            model="m",
            version="v",
            sql="queries/x.sql",
            conn_id="db",
            output_spec=OutputSpec(stage_location="{{ params.out }}"),
        )
    assert BatchInferenceOperator.template_ext == (".sql",)
    assert op.sql == "queries/x.sql"  # stored as given; read only when rendered
    op.render_template_fields({"params": {"day": "2026-01-02", "out": "/out"}})
    assert op.sql == "SELECT id FROM t WHERE day = '2026-01-02'"
    assert op.stage_location == "/out"
