# Tandem worker image (prefill and decode) with jax[tpu] (libtpu) for GKE TPU node pools
# (v5e, v5p, v6e). GKE exposes the chips as google.com/tpu; no privileged mode is needed on
# GKE >= 1.28.
#   make images            builds it here as tandem-worker-tpu:TAG (on tandem-base:bookworm, make base-image)
#   make images REGISTRY=...   builds REGISTRY/tandem-worker-tpu:TAG and pushes it
# PYTHON_IMAGE: as in docker/gateway.Dockerfile.
ARG PYTHON_IMAGE=tandem-base:bookworm

FROM ${PYTHON_IMAGE} AS build
# The jax the image ships; jax's own tpu extra pins the jaxlib and the libtpu built for it
# (0.10.2 -> libtpu 0.0.42.1), and the check below fails the build if the installed libtpu is
# not that pin. The same JAX_VERSION as docker/worker-cpu.Dockerfile.
ARG JAX_VERSION=0.10.2
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# The build secret ca-bundle: as in docker/gateway.Dockerfile.
# The worker extra plus jax[tpu], which pulls the matching jaxlib and libtpu wheels from PyPI.
# Dependencies first (pyproject.toml alone), so a change to the code reuses this layer.
COPY pyproject.toml docker/requirements.py ./
RUN --mount=type=secret,id=ca-bundle if [ -f /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && pip install -q --upgrade pip \
 && python requirements.py ".[worker,tpu]" "jax[tpu]==${JAX_VERSION}" > requirements.txt \
 && pip install -r requirements.txt
COPY . .
# Importing works without a TPU; devices are only probed at run time.
RUN --mount=type=secret,id=ca-bundle if [ -f /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && pip install --no-deps . && pip check \
 && python requirements.py --check-libtpu \
 && pip uninstall -y -q pip setuptools

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem \
 && install -d -o 10001 -g 10001 /var/cache/jax
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    JAX_PLATFORMS=tpu
USER 10001:10001
EXPOSE 50061 50062 50071 50072
ENTRYPOINT ["tandem"]
CMD ["decode"]
