# syntax=docker/dockerfile:1
# Tandem worker image (prefill and decode) with CPU jaxlib: for trying the chart on plain nodes.
#   make images REGISTRY=...   (or: docker build -f docker/worker-cpu.Dockerfile -t REGISTRY/tandem-worker-cpu:0.1.0 .)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY . .
# The worker extra: the JAX engine (CPU jaxlib), no HTTP server, no test tools.
RUN pip install ".[worker]" && python -c "import jax; print(jax.devices())"

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    JAX_PLATFORMS=cpu
USER 10001:10001
EXPOSE 50061 50062
ENTRYPOINT ["tandem"]
CMD ["prefill"]
