# syntax=docker/dockerfile:1
# Tandem worker image (prefill and decode) with jax[tpu] (libtpu) for GKE TPU node pools
# (v5e, v5p, v6e). GKE exposes the chips as google.com/tpu; no privileged mode is needed on
# GKE >= 1.28.
#   make images REGISTRY=...   (or: docker build -f docker/worker-tpu.Dockerfile -t REGISTRY/tandem-worker-tpu:0.1.0 .)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY . .
# The worker extra plus jax[tpu], which pulls the matching jaxlib and libtpu wheels from PyPI. Importing works without a TPU;
# devices are only probed at run time.
RUN pip install ".[worker,tpu]" && python -c "import jax, libtpu"

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    JAX_PLATFORMS=tpu
USER 10001:10001
EXPOSE 50061 50062
ENTRYPOINT ["tandem"]
CMD ["decode"]
