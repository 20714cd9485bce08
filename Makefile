# kthrottle — the two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test unit integration bench lint typecheck kafka spark tools bench-tools clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Fetch Apache Kafka's jars from Maven Central once (cached in ~/.cache/kthrottle).
kafka: $(STAMP)
	$(PY) -c 'from harness.local_kafka import ensure_kafka_jars; print(ensure_kafka_jars())'

# Fetch Spark's Kafka connector jars once (cached in ~/.cache/kthrottle/spark-<version>); spark_tests
# fetch them on first use too.
spark: $(STAMP)
	$(PY) -m spark_tests.jars

# The proxy; with no upstream configured it starts an embedded 3-broker Kafka cluster behind it.
# The example quotas (deploy/quotas.toml), metrics on :9300 and a throttled demo producer;
# ARGS replaces those, e.g. make run ARGS="--upstream broker:9092".
RUN_ARGS ?= --config deploy/quotas.toml --metrics-port 9300 --demo
run: $(STAMP) kafka
	$(VENV)/bin/kthrottle run $(or $(ARGS),$(RUN_ARGS))

# Debian's docker-compose, prometheus, haproxy and tmux, which the tests run, and for `make bench`
# tcpdump too (see the script).
tools:
	bash harness/install_tools.sh

bench-tools:
	bash harness/install_tools.sh --bench

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy protocol quotas config/principal_mapping

unit: $(STAMP) tools
	$(VENV)/bin/pytest -q tests/unit

integration: $(STAMP) kafka tools
	$(VENV)/bin/pytest -q -ra $(PARALLEL) tests/integration

# Every test: lint, types, unit and integration tests against a real local cluster. In parallel:
# TEST_WORKERS pytest-xdist workers, each with its own cluster and ports; the groups and the tests
# that run alone are conftest.py's (docs/testing.md).
TEST_WORKERS ?= 4
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
test: $(STAMP) kafka tools lint typecheck
	$(VENV)/bin/pytest -q -ra $(PARALLEL) tests/unit tests/integration spark_tests

bench: $(STAMP) kafka bench-tools
	$(PY) -m bench.throughput
	$(PY) -m bench.hardening
	$(PY) -m bench.metadata_load
	$(PY) -m bench.fleet
	$(PY) -m bench.tls
	$(PY) -m bench.fetch_stream
	$(PY) -m bench.connections
	$(PY) -m bench.capacity
	$(PY) -m bench.overload --legs
	$(PY) -m bench.fetch_overload --legs

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
