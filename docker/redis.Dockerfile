# Redis from Debian's redis-server, on the same base as the Tandem images (docker/base-image.sh):
# for the container tests (tests/containers, tests/conftest.py's redis_url) and compose.yaml, where
# no registry can be pulled from. Built here by `make images` as tandem-redis:TAG, never pushed:
# the chart's bundled Redis has its own image (values.yaml redis.image).
# It runs as the Tandem images do (uid 10001, read-only root filesystem); data goes to /tmp
# (a tmpfs or emptyDir), nothing is saved to disk unless the command line asks.
ARG PYTHON_IMAGE=tandem-base:bookworm
FROM ${PYTHON_IMAGE}
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* /var/log/apt /var/log/dpkg.log \
 && redis-server --version
USER 10001:10001
WORKDIR /tmp
EXPOSE 6379
ENTRYPOINT ["redis-server"]
CMD ["--bind", "0.0.0.0", "--protected-mode", "no", "--dir", "/tmp", "--save", "", "--appendonly", "no"]
