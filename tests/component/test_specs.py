from __future__ import annotations

import pytest

from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec, OutputSpec, SaveMode, SpecError


def test_output_spec_needs_exactly_one_location():
    with pytest.raises(SpecError, match="exactly one of stage_location .* got both"):
        OutputSpec(stage_location="/a", base_stage_location="/b")
    with pytest.raises(SpecError, match="got neither"):
        OutputSpec()


def test_output_spec_defaults_to_error_and_parses_mode_strings():
    assert OutputSpec(base_stage_location="x").mode is SaveMode.ERROR
    assert OutputSpec(base_stage_location="x", mode="overwrite").mode is SaveMode.OVERWRITE
    with pytest.raises(SpecError, match="not a save mode; use one of SaveMode.ERROR, SaveMode.OVERWRITE"):
        OutputSpec(base_stage_location="x", mode="append")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": 0}, "JobSpec.replicas must be a whole number >= 1"),
        ({"max_batch_rows": 2.5}, "JobSpec.max_batch_rows must be a whole number"),
        ({"num_gpus": -1}, "JobSpec.num_gpus must be a number >= 0"),
        ({"num_cpus": 0, "num_gpus": 0}, "needs num_cpus > 0 or num_gpus > 0"),
        ({"num_gpus": 1.5}, "takes whole GPUs; use 1 or 2"),
        ({"memory": -5}, "JobSpec.memory is bytes per replica"),
        ({"replicas": 1, "num_workers": 2}, "fewer than num_workers=2"),
        ({"progress_interval_s": 60}, "progress_interval_s must be in \\(0, 30\\]"),
        (
            {"resource_wait_s": -1},
            r"resource_wait_s is the seconds .* got -1\. Write e\.g\. JobSpec\(resource_wait_s=600\)",
        ),
        ({"resource_wait_s": "10m"}, r"resource_wait_s .* got '10m'"),
        ({"resource_wait_s": True}, r"resource_wait_s .* got True"),
    ],
)
def test_job_spec_rejects_bad_values_with_what_to_change(kwargs, message):
    with pytest.raises(SpecError, match=message):
        JobSpec(**kwargs)


def test_input_spec_validation():
    with pytest.raises(SpecError, match=r"write \['text'\]"):
        InputSpec(columns="text")
    with pytest.raises(SpecError, match="names \\['a'\\] more than once"):
        InputSpec(columns=["a", "a"])
    with pytest.raises(SpecError, match="passthrough_columns \\['id'\\] are not in InputSpec.columns"):
        InputSpec(columns=["text"], passthrough_columns=["id"])
    with pytest.raises(SpecError, match="column_mapping maps \\['body'\\]"):
        InputSpec(columns=["text"], column_mapping={"body": "text"})


def test_specs_round_trip_through_the_job_spec_dicts():
    for spec in (
        InputSpec(columns=["id", "body"], passthrough_columns=["id"], column_mapping={"body": "text"}, params={"k": 1}),
        OutputSpec(base_stage_location="s3://b/p", mode=SaveMode.OVERWRITE),
        JobSpec(replicas=2, num_workers=2, num_gpus=1, memory=2**30, max_batch_rows=64),
    ):
        assert type(spec).from_dict(spec.to_dict()) == spec
    with pytest.raises(SpecError, match="JobSpec has no field\\(s\\) \\['gpus'\\]"):
        JobSpec.from_dict({"gpus": 1})


def test_bad_spec_fails_when_the_dag_file_is_parsed(airflow_db, tmp_path):
    """A wrong combination is an import error of the DAG file, shown in the UI, not a 2 a.m. failure."""
    from airflow.dag_processing.dagbag import DagBag

    (tmp_path / "bad_dag.py").write_text(
        "import pendulum\n"
        "from airflow.sdk import DAG\n"
        "from airflow_provider_batchinfer import BatchInferenceOperator, OutputSpec\n"
        "with DAG('bad', schedule=None, start_date=pendulum.datetime(2026, 1, 1)):\n"
        "    BatchInferenceOperator(task_id='t', model='m', version='v', input='x',\n"
        "        output_spec=OutputSpec(stage_location='/a', base_stage_location='/b'))\n"
    )
    bag = DagBag(dag_folder=str(tmp_path))
    (error,) = bag.import_errors.values()
    assert "exactly one of stage_location" in error


def test_on_empty_is_checked_when_built_and_travels_in_the_job_file(tmp_path):
    """``InputSpec(on_empty=...)``: "fail" by default, "skip" or "commit"; a bad value names the allowed
    ones. It goes into the job file the runtime reads, and a default spec's dict is what it was before
    (job files and job identities written without it stay the same); it decides no row, so the result
    identity leaves it out and a RESUME is never refused over it."""
    from airflow_provider_batchinfer.contract import JobFile
    from airflow_provider_batchinfer.store.identity import result_identity
    from tests.models import TextLength, job_file

    assert InputSpec().on_empty == "fail"
    for bad in ("ignore", "", None, "SKIP"):
        with pytest.raises(SpecError, match=r"InputSpec.on_empty=.* is not one of \['fail', 'skip', 'commit'\]"):
            InputSpec(on_empty=bad)
    assert "on_empty" not in InputSpec(id_column="id").to_dict()
    for value in ("fail", "skip", "commit"):
        spec = InputSpec(id_column="id", on_empty=value)
        assert InputSpec.from_dict(spec.to_dict()) == spec
    assert InputSpec.from_dict({"id_column": "id"}).on_empty == "fail"  # a job file written before on_empty
    with pytest.raises(SpecError, match=r"not one of \['fail', 'skip', 'commit'\]"):
        InputSpec.from_dict({"on_empty": "drop"})

    from airflow_provider_batchinfer.registry import ModelRegistry

    mv = ModelRegistry(str(tmp_path / "registry")).log_model(
        "text_length", "v1", "python", python_class=TextLength, signature={"inputs": {"text": "string"}}
    )
    job = job_file(tmp_path / "out", mv, str(tmp_path / "registry"), ["in"], input_spec=InputSpec(on_empty="commit"))
    assert JobFile.from_json(job.to_json(), where="_job.json").input_spec.on_empty == "commit"
    same = {"input_fingerprint": [], "model_sha256": "0" * 64, "job_spec": JobSpec()}
    assert result_identity(input_spec=InputSpec(on_empty="commit"), **same) == result_identity(
        input_spec=InputSpec(), **same
    )
