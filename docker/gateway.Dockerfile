# syntax=docker/dockerfile:1
# Tandem gateway image: HTTP/gRPC front end. No JAX: the gateway tokenizes and relays streams only.
#   make images REGISTRY=...   (or: docker build -f docker/gateway.Dockerfile -t REGISTRY/tandem-gateway:0.1.0 .)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY . .
# The gateway's and the planner's extras only (`tandem planner` runs from this image too): no JAX,
# no accelerator runtime. The check fails the build if a dependency ever pulls JAX in.
RUN pip install ".[gateway,planner]" \
 && ! python -c "import jax" 2>/dev/null

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
# Matches the chart's podSecurityContext (runAsUser/runAsGroup 10001, read-only root filesystem).
USER 10001:10001
EXPOSE 8000 50051
ENTRYPOINT ["tandem"]
CMD ["gateway"]
