# Tandem gateway image: HTTP/gRPC front end. No JAX: the gateway tokenizes and relays streams only.
#   make images            builds it here as tandem-gateway:TAG (on tandem-base:bookworm, make base-image)
#   make images REGISTRY=...   builds REGISTRY/tandem-gateway:TAG and pushes it
# Needs BuildKit for docker/gateway.Dockerfile.dockerignore (Docker >= 23 with buildx, or Docker
# 20.10's own client with DOCKER_BUILDKIT=1; the Makefile picks one).
# PYTHON_IMAGE: Debian bookworm with its python3.11 and venv (docker/base-image.sh makes one from
# Debian's packages, nothing pulled); python:3.11-slim-bookworm works too where a registry can be reached.
ARG PYTHON_IMAGE=tandem-base:bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# pip reaches PyPI with the base image's CA certificates, or with the bundle given as the build
# secret ca-bundle (make images passes the host's, so a TLS-inspecting proxy's CA is trusted
# during the build; a secret is never written into a layer).
# The dependencies first, from pyproject.toml alone, so a change to the code reuses this layer.
# The gateway's and the planner's extras only (`tandem planner` runs from this image too): no JAX,
# no accelerator runtime.
COPY pyproject.toml docker/requirements.py ./
RUN --mount=type=secret,id=ca-bundle if [ -f /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && pip install -q --upgrade pip \
 && python requirements.py ".[gateway,planner]" > requirements.txt \
 && pip install -r requirements.txt
COPY . .
# The project itself; the build fails if a dependency ever pulls JAX in. pip and setuptools stay
# out of the image (nothing installs at run time).
RUN --mount=type=secret,id=ca-bundle if [ -f /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && pip install --no-deps . && pip check \
 && ! python -c "import jax" 2>/dev/null \
 && pip uninstall -y -q pip setuptools

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
# Matches the chart's podSecurityContext (runAsUser/runAsGroup 10001, read-only root filesystem).
USER 10001:10001
EXPOSE 8000 50051 9400
ENTRYPOINT ["tandem"]
CMD ["gateway"]
