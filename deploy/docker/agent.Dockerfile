# syntax=docker/dockerfile:1
# The device agent, for devices that run containers (gateways, Jetsons, x86 boxes) and for
# load tests. Mount the bundle from `specfleet devices provision` at /bundle. It installs the
# agent's own wheel (deploy/agent-wheel/: the device packages only). Build from the repository
# root (`--build-arg EXTRA=litert` for LiteRT instead of ONNX Runtime):
#   docker build -f deploy/docker/agent.Dockerfile -t specfleet-agent .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY deploy/agent-wheel/pyproject.toml pyproject.toml
COPY core core
COPY broker broker
COPY inference inference
COPY device_agent device_agent
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG EXTRA=onnx
RUN useradd --system --uid 10001 --home-dir /var/lib/specfleet --create-home specfleet
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/specfleet_agent-*.whl)[${EXTRA}]" && rm -rf /wheels
COPY deploy/docker/entrypoint.sh /usr/local/bin/specfleet-entrypoint
ENV PYTHONUNBUFFERED=1
USER specfleet
WORKDIR /var/lib/specfleet
# The bundle names its files relative to itself; models land in the agent's own store.
VOLUME ["/bundle", "/var/lib/specfleet"]
ENTRYPOINT ["specfleet-entrypoint"]
CMD ["agent", "--models-dir", "/var/lib/specfleet/models"]
