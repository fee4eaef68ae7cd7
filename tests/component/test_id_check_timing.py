"""A job with an id column records how long checking it unique took: the checks before Ray keep
the seconds for the ``_SUCCESS`` manifest's ``timings.id_check_s`` and print them in the job log.
No Ray: only the checks that run before it."""

from __future__ import annotations

from airflow_provider_batchinfer.contract.specs import InputSpec
from airflow_provider_batchinfer.runtime import driver
from tests.models import job_file, write_tickets


def _checked(tmp_path, model, registry, name: str, input_spec: InputSpec) -> driver.CheckedJob:
    data = write_tickets(tmp_path / f"in-{name}", rows=40, files=2)
    run_dir = tmp_path / f"out-{name}"
    run_dir.mkdir()
    return driver.check_before_ray(job_file(run_dir, model, registry.root, [data], input_spec=input_spec))


def test_the_checks_before_ray_time_the_id_check(tmp_path, registry, text_length_model, capsys):
    checked = _checked(tmp_path, text_length_model, registry, "ids", InputSpec(id_column="ticket_id"))
    assert checked.id_check_s is not None and checked.id_check_s >= 0
    assert f"40 ids of 'ticket_id' checked unique in {checked.id_check_s:.3f} s" in capsys.readouterr().out
    assert _checked(tmp_path, text_length_model, registry, "no-ids", InputSpec()).id_check_s is None
