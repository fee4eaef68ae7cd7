# Ray head and GPU workers: CUDA base, Ray, the provider's runtime (never Airflow), torch and the
# model libraries, at the versions of constraints/constraints-3.11.txt (the tested set; the base
# image's Ray is the one it pins). vLLM is optional: build with --build-arg WITH_VLLM=1 for LLM jobs
# (the pins of pyproject.toml's [llm] extra: the vLLM that ray[llm] 2.60.0 is built for).
FROM rayproject/ray:2.60.0-py311-gpu

ARG WITH_VLLM=0
COPY docker/ray-requirements.txt /tmp/ray-requirements.txt
COPY constraints/constraints-3.11.txt /tmp/constraints-3.11.txt
# torch is pinned by version only, so on this CUDA image pip takes the CUDA build of that version
RUN pip install --no-cache-dir -c /tmp/constraints-3.11.txt -r /tmp/ray-requirements.txt \
 && if [ "$WITH_VLLM" = "1" ]; then pip install --no-cache-dir "ray[llm]==2.60.0" "vllm[audio]==0.29.0"; fi

# --no-deps: the runtime imports no Airflow, so the Ray image does not carry it
COPY pyproject.toml README.md LICENSE /opt/batchinfer/
COPY airflow_provider_batchinfer /opt/batchinfer/airflow_provider_batchinfer
RUN pip install --no-cache-dir --no-deps /opt/batchinfer
