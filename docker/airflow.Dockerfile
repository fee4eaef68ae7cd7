# Airflow with the provider installed: api-server, scheduler, dag-processor and triggerer all use it.
# The Airflow side only submits and watches Ray jobs, so it needs neither torch nor a GPU.
FROM apache/airflow:3.3.2-python3.11

COPY --chown=airflow:root pyproject.toml README.md /opt/batchinfer/
COPY --chown=airflow:root airflow_provider_batchinfer /opt/batchinfer/airflow_provider_batchinfer
RUN pip install --no-cache-dir "apache-airflow==3.3.2" "/opt/batchinfer[s3]"
