# kthrottle — the two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test unit integration spark bench lint typecheck kafka clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Fetch Apache Kafka's jars from Maven Central once (cached in ~/.cache/kthrottle).
kafka: $(STAMP)
	$(PY) -c 'from proxy.local_kafka import ensure_kafka_jars; print(ensure_kafka_jars())'

# The proxy; with no upstream configured it starts an embedded 3-broker Kafka cluster behind it.
run: $(STAMP) kafka
	$(VENV)/bin/kthrottle run $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy protocol quotas

unit: $(STAMP)
	$(VENV)/bin/pytest -q tests/unit

integration: $(STAMP) kafka
	$(VENV)/bin/pytest -q tests/integration

# Every test: lint, types, unit and integration tests against a real local cluster.
test: $(STAMP) kafka lint typecheck
	$(VENV)/bin/pytest -q -ra tests

bench: $(STAMP) kafka
	$(PY) -m bench.throughput

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
