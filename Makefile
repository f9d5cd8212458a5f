# payintent: `make run` starts the local stack, `make test` runs the whole suite.
# Both install what they need into .venv/ (and node_modules/ once Node tools are used).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-db lint fmt bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: install
	$(BIN)/payintent dev

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Only the tests that touch the database (used by .ci/run against the machine's servers).
test-db: install
	$(BIN)/python -m pytest -m db $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install
	$(BIN)/python bench/api.py

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache *.egg-info
