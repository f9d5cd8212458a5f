# payintent: `make run` starts the local stack, `make test` runs the whole suite.
# Both install what they need into .venv/ (and node_modules/ once Node tools are used).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NODE_STAMP := node_modules/.installed
CHECKOUT := checkout-ui/dist/index.html
SWAGGER_UI := backend/static/apidocs/swagger-ui/swagger-ui-bundle.js

.PHONY: install browser nginx run test test-db drills lint fmt bench contracts clean

install: $(STAMP) $(NODE_STAMP) $(CHECKOUT) $(SWAGGER_UI)

$(STAMP): pyproject.toml constraints.txt clients/python/pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt --config-settings editable_mode=compat -e ./clients/python -e '.[dev]'
	touch $(STAMP)

# Node tools for the local devnet (Anvil binary, solc, OpenZeppelin); nothing is fetched at run time.
$(NODE_STAMP): package.json package-lock.json
	@command -v npm >/dev/null || { echo "Node 20+ with npm is required (https://nodejs.org)"; exit 1; }
	npm ci --no-audit --no-fund --loglevel=error
	touch $(NODE_STAMP)

# The hosted checkout page (checkout-ui/): a static bundle under checkout-ui/dist/, served at /pay/<intent_id>.
$(CHECKOUT): checkout-ui/package.json checkout-ui/package-lock.json checkout-ui/index.html checkout-ui/vite.config.ts checkout-ui/tsconfig.json $(wildcard checkout-ui/src/*)
	@command -v npm >/dev/null || { echo "Node 20+ with npm is required (https://nodejs.org)"; exit 1; }
	cd checkout-ui && npm ci --no-audit --no-fund --loglevel=error && npm run build --silent

# Swagger UI for the API docs page (/api/v1/docs), served by the app itself (no CDN): the files the page needs,
# copied from node_modules/swagger-ui-dist (pinned in package.json) into backend/static/apidocs/swagger-ui/.
$(SWAGGER_UI): $(NODE_STAMP) deploy/swagger_ui.mjs
	node deploy/swagger_ui.mjs

# The e2e suite drives headless Chromium: found on PATH (or CHROMIUM=...), else installed from Debian's packages.
browser:
	@if [ -n "$$CHROMIUM" ] || command -v chromium >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; \
	else \
		echo "The e2e tests need Chromium: install it (Debian: sudo apt-get install chromium) or set CHROMIUM=/path/to/chrome"; exit 1; \
	fi

# tests/observability/test_slow_clients.py runs deploy/nginx.conf under a real nginx: found on PATH or in /usr/sbin,
# else installed from Debian's packages (package nginx: the core modules the file uses). Never started as a service.
nginx:
	@if command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q nginx >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q nginx >/dev/null; }; \
	else \
		echo "The slow-client tests need nginx: install it (Debian: sudo apt-get install nginx)"; exit 1; \
	fi

# Rebuild devnet/artifacts/TestUSDC.json from devnet/contracts/ (the artifact is committed).
contracts: $(NODE_STAMP)
	node devnet/build_contract.mjs

run: install
	$(BIN)/payintent dev

# The suite runs in parallel (pytest-xdist): it mostly waits (chains, processes, timeouts), so 4 workers pay off
# even on 2 cores. Each worker has its own databases, Redis, devnets and ports; tests of one xdist_group (e2e/,
# tests/test_devstack_stop.py) stay on one worker. `make test PYTEST_XDIST=` runs it in one process.
PYTEST_XDIST ?= -n 4 --dist loadgroup

test: install browser nginx
	$(BIN)/python -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

# Only the tests that touch a database or Redis (.ci/run points them at the machine's servers).
test-db: install nginx
	$(BIN)/python -m pytest -m "db or redis" $(PYTEST_XDIST) $(PYTEST_ARGS)

# Reliability drills: faults against the full local stack (docs/drills.md); fails on a double charge,
# a charge the service did not record, a payment left unsettled or a lost webhook event.
drills: install
	$(BIN)/python -m drills.run $(DRILLS_ARGS)

# mypy reads its files and settings from [tool.mypy] in pyproject.toml (docs/architecture.md, "App state and type checking").
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

fmt: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install
	$(BIN)/python -m bench.api
	$(BIN)/python -m bench.webhooks

clean:
	rm -rf $(VENV) node_modules checkout-ui/node_modules checkout-ui/dist backend/static/apidocs/swagger-ui var .pytest_cache .ruff_cache .import_linter_cache .mypy_cache *.egg-info
