# Tandem developer entry points. `make serve` and `make test` are the README's quick start.
#   make serve    installs only what serving needs (the [local] extra), then runs `tandem local`
#   make test     adds the test tools ([dev], [test-reference]: pytest, the real clients, torch);
#                 runs make check first, then every test: unit (fast and slow), integration, e2e
#   make test-unit  the fast unit tier (minutes): tests/unit without the `slow` ones, for iterating
#   make test-slow  the slow unit tier alone: compile-heavy engine tests (families against
#                 transformers, tp 2 and 4 in child processes, TPU compiles); make test runs it too
#   make check    ruff (lint), mypy (the seams), lint-imports (the layering contracts): pyproject.toml
#   make install  everything a developer uses (what make test installs, plus [bench])
#   make images   builds the three images in docker/ here (REGISTRY=...: and pushes them)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000
ARGS ?=
PIP := $(BIN)/pip install --progress-bar off --disable-pip-version-check

# Extras per target (pyproject.toml [project.optional-dependencies]).
SERVE_EXTRAS := local
TEST_EXTRAS := local,dev,test-reference,tpu
DEV_EXTRAS := $(TEST_EXTRAS),bench
# One stamp per set, newer than pyproject.toml once installed (.installed: the test set, as before,
# so an existing .venv is not reinstalled). The venv itself is order-only: creating it forces nothing.
CREATED := $(VENV)/.created
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install serve check test test-unit test-slow bench proto base-image images clean

$(CREATED):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	touch $(CREATED)

$(SERVE_STAMP): pyproject.toml | $(CREATED)
	@echo "make serve: installing tandem-serve[$(SERVE_EXTRAS)] into $(VENV): the gateway, prefill and decode"
	@echo "  workers (JAX on CPU), the planner and an embedded Redis; no test tools (make test adds them)."
	$(PIP) -e '.[$(SERVE_EXTRAS)]'
	touch $(SERVE_STAMP)

$(STAMP): pyproject.toml | $(CREATED)
	@echo "make test: installing tandem-serve[$(TEST_EXTRAS)] into $(VENV): what make serve installs plus"
	@echo "  pytest, the real clients the tests drive (openai, langchain-openai, schemathesis), the Helm"
	@echo "  library and kubernetes-validate for the chart, torch/transformers for the reference-model tests,"
	@echo "  and libtpu (jax[tpu]) so the TPU compile tests run without a TPU."
	$(PIP) -e '.[$(TEST_EXTRAS)]'
	touch $(STAMP)

$(DEV_STAMP): pyproject.toml $(STAMP)
	@echo "make install: adding tandem-serve[bench] (matplotlib, py-spy) to the test set in $(VENV)."
	$(PIP) -e '.[$(DEV_EXTRAS)]'
	touch $(DEV_STAMP)

install: $(DEV_STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/tandem local --port $(PORT) $(ARGS)

# Lint, types at the seams, the import contracts: seconds, so they run before the suite and a
# layering break fails fast. Their configuration is in pyproject.toml ([tool.ruff], [tool.mypy],
# [tool.importlinter]).
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Every tier. JAX's persistent compilation cache (tests/conftest.py, TANDEM_TEST_COMPILE_CACHE) is
# kept across runs, so a second run compiles little. tests/unit runs in UNIT_JOBS processes
# (pytest-xdist, a test file per process): one process kept ~0.85 of 2 cores busy (compiles are
# single-threaded), two took tests/unit from 8.0 to 6.0 minutes here. tests/integration mostly
# waits (on Redis failovers, timeouts, leases: 3 min 5 s of wall time for 1 min 22 s of CPU in
# one process), so it runs in INTEGRATION_JOBS, a file per process (3: 1 min 18 s, 2026-12-06).
# The end-to-end and container tiers start whole clusters whose processes already fill the
# cores, and several of their tests bound time under load: they run in one.
UNIT_JOBS ?= 2
INTEGRATION_JOBS ?= 3
jobs = $(if $(filter-out 0 1,$(1)),-n $(1) --dist loadfile,)
unit_jobs = $(call jobs,$(UNIT_JOBS))
# Each tier prints its 10 slowest tests: where the suite's time goes, in every run's log.
test: check
	$(BIN)/python -m pytest -q -ra --durations=10 $(unit_jobs) tests/unit
	$(BIN)/python -m pytest -q -ra --durations=10 $(call jobs,$(INTEGRATION_JOBS)) tests/integration
	$(BIN)/python -m pytest -q -ra --durations=10 tests --ignore=tests/unit --ignore=tests/integration

# The tiers of tests/unit (pyproject.toml's `slow` marker): the fast one for a person iterating,
# the slow one for the compile-heavy cases. Neither runs tests/integration or tests/e2e.
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -ra $(unit_jobs) -m "not slow" tests/unit

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -ra $(unit_jobs) -m slow tests/unit

bench: $(STAMP)
	$(PIP) -q -e '.[bench]'
	$(BIN)/python bench/run_all.py $(if $(QUICK),--quick,)

# Regenerates the committed gRPC stubs (tests/unit/test_proto_fresh.py fails if they are stale).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. tandem_proto/*.proto

# ---- Images -----------------------------------------------------------------------------------
# make base-image   debootstraps Debian bookworm (minbase + python3.11, venv, CA certificates) and
#                   `docker import`s it as $(BASE_IMAGE) (docker/base-image.sh; root; its ID is
#                   written to build/base/base-image.id). Nothing is pulled from a registry.
# make images       builds docker/{gateway,worker-cpu,worker-tpu}.Dockerfile on it, here, as
#                   tandem-<name>:$(TAG), and tandem-redis:$(TAG) (Debian's redis-server, for the
#                   container tests and compose.yaml); IMAGES_ONLY="gateway worker-cpu" builds fewer.
# make images REGISTRY=us-docker.pkg.dev/my-project/tandem [TAG=0.1.0] [PUSH=0] [PLATFORM=linux/amd64]
#                   builds the three as $(REGISTRY)/tandem-<name>:$(TAG), pushes them (PUSH=0: build
#                   only) and writes $(IMAGE_VALUES): chart values with each image's repository, tag
#                   and pushed digest, for `helm install ... -f $(IMAGE_VALUES)`; needs `docker login`.
# PYTHON_IMAGE=python:3.11-slim-bookworm builds on that instead of the base image (a registry
# must answer). BuildKit reads docker/*.Dockerfile.dockerignore: Docker >= 23 with buildx, or
# Debian's Docker 20.10 client with DOCKER_BUILDKIT=1 (chosen below when the first `docker` on
# PATH has no buildx and /usr/bin/docker exists).
REGISTRY ?=
TAG ?= $(shell sed -n 's/^appVersion: *"*\([^"]*\)"*$$/\1/p' charts/tandem/Chart.yaml)
PUSH ?= $(if $(REGISTRY),1,0)
ifeq ($(origin DOCKER),undefined)
DOCKER := $(shell if docker buildx version >/dev/null 2>&1; then echo docker; elif [ -x /usr/bin/docker ]; then echo /usr/bin/docker; else echo docker; fi)
endif
PLATFORM ?= linux/amd64
BASE_IMAGE ?= tandem-base:bookworm
PYTHON_IMAGE ?= $(BASE_IMAGE)
IMAGE_VALUES ?= build/images-values.yaml
# <Dockerfile name>:<key under the chart's `images:`>
IMAGES := gateway:gateway worker-cpu:workerCpu worker-tpu:workerTpu
IMAGES_ONLY ?=
BUILT := $(if $(IMAGES_ONLY),$(filter $(addsuffix :%,$(IMAGES_ONLY)),$(IMAGES)),$(IMAGES))

image_name = $(word 1,$(subst :, ,$(1)))
image_key = $(word 2,$(subst :, ,$(1)))
image_ref = $(if $(REGISTRY),$(REGISTRY)/,)tandem-$(call image_name,$(1))
# The CA bundle pip trusts in the images' build stages (a BuildKit secret, never stored in a layer):
# the host's by default, so a TLS-inspecting proxy the host trusts is trusted; CA_BUNDLE= for none.
CA_BUNDLE ?= $(wildcard /etc/ssl/certs/ca-certificates.crt)
comma := ,
docker_build = DOCKER_BUILDKIT=1 $(DOCKER) build --platform $(PLATFORM) --build-arg PYTHON_IMAGE=$(PYTHON_IMAGE)$(if $(CA_BUNDLE), --secret id=ca-bundle$(comma)src=$(CA_BUNDLE))

define build_image
$(docker_build) -f docker/$(call image_name,$(1)).Dockerfile -t $(call image_ref,$(1)):$(TAG) .
$(if $(filter 1,$(PUSH)),$(DOCKER) push $(call image_ref,$(1)):$(TAG))
$(if $(REGISTRY),printf '  %s:\n    repository: %s\n    tag: "%s"\n    digest: "%s"\n' $(call image_key,$(1)) $(call image_ref,$(1)) $(TAG) "$$($(DOCKER) image inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' $(call image_ref,$(1)):$(TAG) | sed -n 's|^$(call image_ref,$(1))@||p' | head -n 1)" >> $(IMAGE_VALUES))

endef

base-image:
	BASE_IMAGE=$(BASE_IMAGE) DOCKER=$(DOCKER) docker/base-image.sh

images: $(if $(filter $(BASE_IMAGE),$(PYTHON_IMAGE)),base-image)
	$(if $(TAG),,$(error make images: no TAG given and none found as appVersion in charts/tandem/Chart.yaml))
	@echo "make images: building $(foreach i,$(BUILT),$(call image_ref,$(i)):$(TAG))$(if $(REGISTRY),, tandem-redis:$(TAG)) on $(PYTHON_IMAGE)$(if $(filter 1,$(PUSH)), and pushing them,$(if $(REGISTRY),; PUSH=0: not pushing,; no REGISTRY: local images, not pushed)) for $(PLATFORM)"
	$(if $(REGISTRY),mkdir -p $(dir $(IMAGE_VALUES)))
	$(if $(REGISTRY),printf '# Written by make images: the chart values for these images (helm install -f %s).\nimages:\n' $(IMAGE_VALUES) > $(IMAGE_VALUES))
	$(foreach i,$(BUILT),$(call build_image,$(i)))
	$(if $(REGISTRY),,$(docker_build) -f docker/redis.Dockerfile -t tandem-redis:$(TAG) .)
	$(if $(REGISTRY),@echo "make images: wrote $(IMAGE_VALUES); install with: helm install tandem charts/tandem -f $(IMAGE_VALUES) ...",@$(DOCKER) image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E '^tandem-[a-z-]+:$(TAG) ' || true)

clean:
	rm -rf $(VENV) build *.egg-info
