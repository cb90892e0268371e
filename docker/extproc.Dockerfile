# The gateway's ext_proc service. No torch: the gateway never needs it (it imports only
# the agent's published contracts: its generated gRPC stubs, ace_common/proto, and the
# catalog's schema, ace_common/catalog_schema.py).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY gpu_agent/__init__.py ./gpu_agent/__init__.py
COPY ace_common/proto ./gpu_agent/_proto
COPY ace_common/catalog_schema.py ./gpu_agent/catalog_schema.py
<<<<<<< HEAD
# the postgres extra (psycopg): the replicas share their state through PostgreSQL
# (--database-url; deploy/kubernetes sets it)
RUN pip install --no-cache-dir ".[postgres]" && mkdir -p /var/lib/ace && chown 65534:65534 /var/lib/ace
=======
# the kubernetes extra: --discovery inferencepool (the InferencePool overlays use it)
RUN pip install --no-cache-dir ".[kubernetes]" && mkdir -p /var/lib/ace && chown 65534:65534 /var/lib/ace
>>>>>>> wt/discovery
USER 65534:65534
EXPOSE 50051
ENTRYPOINT ["python", "-m", "extproc"]
