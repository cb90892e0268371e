# The gateway's ext_proc service. No torch, and nothing of the agent: the gateway imports
# only the vocabulary both share (ace_common: tiers, the catalog schema, the generated
# gRPC stubs).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ace_common ./ace_common
COPY extproc ./extproc
# the postgres extra (psycopg): the replicas share their state through PostgreSQL
# (--database-url; deploy/kubernetes sets it); the kubernetes extra: --discovery
# inferencepool (the InferencePool overlays use it)
RUN pip install --no-cache-dir ".[postgres,kubernetes]" && mkdir -p /var/lib/ace && chown 65534:65534 /var/lib/ace
USER 65534:65534
EXPOSE 50051
ENTRYPOINT ["python", "-m", "extproc"]
