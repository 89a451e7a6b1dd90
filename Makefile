# Tandem developer entry points. `make serve` and `make test` are the README's quick start.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000
ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: install serve test test-unit bench proto clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,test-reference,tpu]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/tandem local --port $(PORT) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra tests

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -ra tests/unit

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/run_all.py $(if $(QUICK),--quick,)

# Regenerates the committed gRPC stubs (tests/unit/test_proto_fresh.py fails if they are stale).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. tandem_proto/*.proto

clean:
	rm -rf $(VENV) build *.egg-info
