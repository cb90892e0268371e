# The GPU agent with its builtin engine. torch comes from the CPU index here; for a GPU
# host build FROM a CUDA base image and install the matching torch build instead.
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY ace_common ./ace_common
COPY gpu_agent ./gpu_agent
COPY protos ./protos
RUN pip install --no-cache-dir '.[agent]'
# Fixtures (tiny model, tokenizer, adapters, catalog) are made at build time, nothing
# from a hub; the compose file shares them with the gateway through a named volume.
RUN python -m gpu_agent.fixtures --out /fixtures \
    && mkdir -p /var/cache/ace && chown -R 65534:65534 /fixtures /var/cache/ace
USER 65534:65534
EXPOSE 8000 50061 9400
ENTRYPOINT ["python", "-m", "gpu_agent"]
