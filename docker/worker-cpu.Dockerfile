# Tandem worker image (prefill and decode) with CPU jaxlib: for trying the chart on plain nodes.
#   make images            builds it here as tandem-worker-cpu:TAG (on tandem-base:bookworm, make base-image)
#   make images REGISTRY=...   builds REGISTRY/tandem-worker-cpu:TAG and pushes it
# PYTHON_IMAGE: as in docker/gateway.Dockerfile.
ARG PYTHON_IMAGE=tandem-base:bookworm

FROM ${PYTHON_IMAGE} AS build
# The jax the images ship (jaxlib follows it); the same in docker/worker-tpu.Dockerfile.
ARG JAX_VERSION=0.10.2
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# The build secret ca-bundle: as in docker/gateway.Dockerfile.
# The worker extra: the JAX engine (CPU jaxlib), no HTTP server, no test tools. Dependencies
# first (pyproject.toml alone), so a change to the code reuses this layer.
COPY pyproject.toml docker/requirements.py ./
RUN --mount=type=secret,id=ca-bundle if [ -f /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && pip install -q --upgrade pip \
 && python requirements.py ".[worker]" "jax==${JAX_VERSION}" > requirements.txt \
 && pip install -r requirements.txt
COPY . .
RUN --mount=type=secret,id=ca-bundle if [ -f /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && pip install --no-deps . && pip check \
 && ! python -c "import libtpu" 2>/dev/null \
 && JAX_PLATFORMS=cpu python -c "import jax; print(jax.__version__, jax.devices())" \
 && pip uninstall -y -q pip setuptools

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem \
 && install -d -o 10001 -g 10001 /var/cache/jax
COPY --from=build /opt/venv /opt/venv
# /var/cache/jax: the chart mounts an emptyDir there for the compilation cache; the directory,
# owned by the user, lets a Docker volume mounted there (compose.yaml) start writable too.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    JAX_PLATFORMS=cpu
USER 10001:10001
EXPOSE 50061 50062 50071 50072
ENTRYPOINT ["tandem"]
CMD ["prefill"]
