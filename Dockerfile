# syntax=docker/dockerfile:1
# The production image: one image for the api, the worker, the relayer and migrations (the command picks).
# docs/deploy.md says how to run it; docker-compose.yml is a whole stack. Never built here (no Docker
# engine on our machines): tests/test_deploy.py checks that every COPY source exists and is in the build context.

# 1. The hosted checkout page (checkout-ui/: TypeScript + Vite) as static files. Its dev dependencies
#    (typescript, vite) stay in this stage.
FROM node:20-bookworm-slim AS checkout
WORKDIR /build/checkout-ui
COPY checkout-ui/package.json checkout-ui/package-lock.json ./
RUN npm ci --no-audit --no-fund --loglevel=error
COPY checkout-ui/index.html checkout-ui/vite.config.ts checkout-ui/tsconfig.json ./
COPY checkout-ui/src ./src
RUN npm run build

# 2. Swagger UI for the API docs page (/api/v1/docs), served by the app (no CDN): the swagger-ui-dist version
#    package-lock.json locks, fetched with `npm pack` (no install scripts), checked against the lock's integrity
#    hash, and only the files the page needs (deploy/swagger_ui.mjs, which `make install` runs too).
FROM node:20-bookworm-slim AS swagger-ui
WORKDIR /build
COPY package.json package-lock.json ./
COPY deploy/swagger_ui.mjs deploy/
RUN node deploy/swagger_ui.mjs --pack /build/swagger-ui

# 3. The wheels: payintent (backend, relayer; the dashboard's templates and static files and Swagger UI
#    are package data of backend) and payintent-client (clients/python); built apart: no source tree in the image.
FROM python:3.11-slim AS wheel
WORKDIR /build
COPY pyproject.toml README.md ./
COPY backend backend
COPY --from=swagger-ui /build/swagger-ui backend/static/apidocs/swagger-ui
COPY relayer relayer
COPY clients/python clients/python
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . ./clients/python

# 4. The runtime: the runtime dependencies pinned by constraints.txt (no dev dependencies), the wheel,
#    the checkout bundle, the entrypoint and health checks; runs as an unprivileged user.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# The runtime dependencies first (a layer that survives code changes): the [project] dependencies of
# pyproject.toml, at the versions constraints.txt pins.
COPY pyproject.toml constraints.txt /tmp/deps/
RUN python -c 'import tomllib; print("\n".join(d for d in tomllib.load(open("/tmp/deps/pyproject.toml", "rb"))["project"]["dependencies"] if not d.startswith("payintent-client")))' \
        > /tmp/deps/requirements.txt \
    && pip install -r /tmp/deps/requirements.txt -c /tmp/deps/constraints.txt \
    && rm -rf /tmp/deps
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels
COPY --from=checkout /build/checkout-ui/dist /app/checkout-ui/dist
COPY deploy/entrypoint.py deploy/healthcheck.py /app/deploy/
# uid 10001: secret files mounted from the host must be readable by it (docs/deploy.md).
RUN useradd --system --uid 10001 --user-group --home-dir /app --no-create-home --shell /usr/sbin/nologin payintent
ENV CHECKOUT_DIST_DIR=/app/checkout-ui/dist
USER payintent
EXPOSE 8000
ENTRYPOINT ["python", "/app/deploy/entrypoint.py"]
CMD ["payintent", "serve", "--host", "0.0.0.0", "--port", "8000"]
