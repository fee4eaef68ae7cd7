# Ray head and GPU workers: CUDA base, Ray, the provider's runtime (never Airflow), torch and the
# model libraries. vLLM is optional: build with --build-arg WITH_VLLM=1 for LLM jobs.
FROM rayproject/ray:2.60.0-py311-gpu

ARG WITH_VLLM=0
COPY docker/ray-requirements.txt /tmp/ray-requirements.txt
RUN pip install --no-cache-dir -r /tmp/ray-requirements.txt \
 && if [ "$WITH_VLLM" = "1" ]; then pip install --no-cache-dir "vllm" "ray[llm]==2.60.0"; fi

# --no-deps: the runtime imports no Airflow, so the Ray image does not carry it
COPY pyproject.toml README.md /opt/batchinfer/
COPY airflow_provider_batchinfer /opt/batchinfer/airflow_provider_batchinfer
RUN pip install --no-cache-dir --no-deps /opt/batchinfer
