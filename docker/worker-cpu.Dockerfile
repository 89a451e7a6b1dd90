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
# Tandem's CPU kernel (the paged step's attention, tandem_engine/cpu_kernels), built here for
# x86-64-v3 (AVX2: every current x86 node type) so the image needs no compiler; a CPU without those
# features takes the XLA gather path instead (logged).
ENV TANDEM_KERNEL_MARCH=x86-64-v3 TANDEM_KERNEL_CACHE=/opt/tandem/kernels
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends g++ >/dev/null \
 && JAX_PLATFORMS=cpu python -c "from tandem_engine.cpu_kernels import build; print(build())"

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem \
 && install -d -o 10001 -g 10001 /var/cache/jax
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/tandem/kernels /opt/tandem/kernels
# /var/cache/jax: the chart mounts an emptyDir there for the compilation cache; the directory,
# owned by the user, lets a Docker volume mounted there (compose.yaml) start writable too.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    JAX_PLATFORMS=cpu \
    TANDEM_KERNEL_MARCH=x86-64-v3 \
    TANDEM_KERNEL_CACHE=/opt/tandem/kernels
USER 10001:10001
EXPOSE 50061 50062 50071 50072
ENTRYPOINT ["tandem"]
CMD ["prefill"]
