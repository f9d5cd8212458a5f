"""The error catalog (backend.errors.CATALOG) is the one source of codes and statuses.

Every code the source raises is in it, every entry is raised somewhere, and what README's error tables,
the views' docstrings (the OpenAPI descriptions) and the API's response descriptions say of a code's status
agrees with it. Source only: no app, no database.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.errors import CATALOG, SETTLEMENT_FAILURES, ChainUnavailable, DomainError

ROOT = Path(__file__).resolve().parent.parent
# Where error codes are raised: the services and entry points, and the Solana rules whose codes /pay answers.
SOURCES = [*sorted((ROOT / "backend").rglob("*.py")), *sorted((ROOT / "relayer").rglob("*.py"))]
SOLANA_RULES = ROOT / "clients" / "python" / "payintent" / "solana_tx.py"
# The exceptions whose first argument is a catalog code.
RAISERS = {"DomainError", "MerchantError", "SolanaTransactionError"}
CODE = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*\b")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _raised_codes(path: Path) -> Iterator[tuple[str, int, str]]:
    """(code, line, name) of each ``DomainError("CODE", ...)``-like call with a literal code."""
    for node in ast.walk(_tree(path)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        first = node.args[0]
        if name in RAISERS and isinstance(first, ast.Constant) and isinstance(first.value, str):
            yield first.value, node.lineno, name


def _string_constants(path: Path) -> set[str]:
    """Every string literal of a file, but for the catalog's own keys."""
    tree = _tree(path)
    skip = {
        id(child)
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "CATALOG"
        for child in ast.walk(node)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if id(node) not in skip and isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_every_raised_code_is_in_the_catalog() -> None:
    missing = [
        f"{path.relative_to(ROOT)}:{line}: {name}({code!r})"
        for path in [*SOURCES, SOLANA_RULES]
        for code, line, name in _raised_codes(path)
        if code not in CATALOG
    ]
    assert not missing, f"add these codes to backend.errors.CATALOG: {missing}"


def test_no_raise_site_decides_a_status() -> None:
    """``DomainError(400, ...)``, the old ``APIError`` form: the status is the catalog's."""
    offenders = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in SOURCES
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in {"DomainError", "APIError"}
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, int)
    ]
    assert not offenders


def test_every_catalog_code_is_used() -> None:
    used: set[str] = set()
    for path in [*SOURCES, SOLANA_RULES]:
        used |= _string_constants(path)
    unused = sorted(set(CATALOG) - used)
    assert not unused, f"no code raises these catalog entries (remove them, or raise them): {unused}"


def test_the_translation_codes_have_their_status() -> None:
    from backend.http_errors import _HTTP_CODES

    assert {status: CATALOG[code].status for status, code in _HTTP_CODES.items()} == {s: s for s in _HTTP_CODES}


def _readme_rows() -> list[tuple[int, str]]:
    """(status, code) of each row of README's tables under "### Errors" (a row may list several codes)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n### Errors\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = re.match(r"\| (\d{3}) \| (.+?) \|", line)
        if match:
            rows += [(int(match[1]), code) for code in re.findall(r"`([A-Z][A-Z0-9_]+)`", match[2])]
    return rows


def test_readme_error_tables_match_the_catalog() -> None:
    rows = _readme_rows()
    assert len(rows) > 40
    wrong = [(code, status) for status, code in rows if code not in CATALOG or CATALOG[code].status != status]
    assert not wrong, f"README says (code, status) {wrong}; the catalog disagrees or lacks the code"
    listed = {code for _, code in rows}
    unlisted = sorted(code for code, kind in CATALOG.items() if kind.where == "api" and code not in listed)
    assert not unlisted, f"README's error tables lack these API codes: {unlisted}"
    assert not {code for code, kind in CATALOG.items() if kind.where != "api"} & listed


def _view_docstrings() -> Iterator[tuple[str, str]]:
    for path in sorted((ROOT / "backend").rglob("views.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef) and (doc := ast.get_docstring(node)):
                yield f"{path.relative_to(ROOT)}:{node.name}", doc


def _documented_statuses(text: str) -> Iterator[tuple[str, int]]:
    """``CODE (409...)`` and ``A / B and C (400...)``: each code with the status written after it."""
    chain = r"[A-Z][A-Z0-9_]+(?:\s+(?:/|and)\s+[A-Z][A-Z0-9_]+)*"
    for match in re.finditer(rf"({chain}) \((\d{{3}})\b", text):
        for code in re.findall(r"[A-Z][A-Z0-9_]+", match[1]):
            yield code, int(match[2])


def test_view_docstrings_match_the_catalog() -> None:
    checked = 0
    for where, doc in _view_docstrings():
        for code, status in _documented_statuses(doc):
            assert code in CATALOG, f"{where}: {code} is not in the catalog"
            assert CATALOG[code].status == status, f"{where}: {code} ({status}); the catalog says {CATALOG[code]}"
            checked += 1
    assert checked > 20


def test_response_descriptions_match_the_catalog() -> None:
    from backend.http import _ERROR_DESCRIPTIONS

    for status, description in _ERROR_DESCRIPTIONS.items():
        for code in CODE.findall(description):
            if "_" in code or code in CATALOG:
                assert CATALOG[code].status == status, f"{status}: {description}"


@pytest.mark.parametrize("code", sorted(CATALOG))
def test_each_kind_is_an_error_status(code: str) -> None:
    kind = CATALOG[code]
    assert 400 <= kind.status < 600 and kind.description and kind.where in {"api", "http", "admin"}


def test_domain_errors_take_their_status_from_the_catalog() -> None:
    err = DomainError("RATE_LIMITED", headers={"Retry-After": "3"}, retry_after=3)
    assert (err.http_status, err.message, err.headers) == (
        429,
        CATALOG["RATE_LIMITED"].description,
        {"Retry-After": "3"},
    )
    assert err.body() == {
        "success": False,
        "error": {"code": "RATE_LIMITED", "message": CATALOG["RATE_LIMITED"].description, "retry_after": 3},
    }
    chain = ChainUnavailable("Base Sepolia")
    assert (chain.http_status, chain.code, chain.message) == (
        503,
        "CHAIN_UNAVAILABLE",
        "Base Sepolia cannot be reached right now; try again",
    )
    with pytest.raises(ValueError, match=r"not in backend\.errors\.CATALOG"):
        DomainError("NO_SUCH_CODE", "never")


def test_the_catalog_module_imports_no_flask_and_no_domain() -> None:
    imported: list[str] = []
    for node in ast.walk(_tree(ROOT / "backend" / "errors.py")):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append(node.module or "")
    assert not [name for name in imported if name.startswith(("flask", "werkzeug", "backend"))]


def _settlement_failure_literals() -> set[str]:
    """The literal codes handed to ``fail_settlement(id, CODE, ...)`` and ``CannotSucceed(reason, CODE)``."""
    found: set[str] = set()
    for path in SOURCES:
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Call) or len(node.args) < 2:
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            code = node.args[1]
            if name in {"fail_settlement", "CannotSucceed"} and isinstance(code, ast.Constant):
                found.add(str(code.value))
    return found


def test_every_settlement_failure_code_is_known_and_documented() -> None:
    """A settlement's failure code reaches the merchant as payment.failed's ``code``: each is an API code of the
    catalog or one of SETTLEMENT_FAILURES (the chain decided after the claim), which docs/webhooks.md lists."""
    from backend.rails.evm.relay import PAYER_HAS_CODE
    from backend.settlement.reconcile import FAILURE_CODES
    from backend.settlement.services import DUPLICATE_PAYMENT

    codes = _settlement_failure_literals() | set(FAILURE_CODES.values()) | {DUPLICATE_PAYMENT, PAYER_HAS_CODE}
    assert {"ALREADY_PAID", "SETTLEMENT_FAILED", "AUTHORIZATION_CANCELED"} <= codes  # the scan finds them
    assert sorted(codes - set(CATALOG) - set(SETTLEMENT_FAILURES)) == []
    assert not set(SETTLEMENT_FAILURES) & set(CATALOG)
    assert set(SETTLEMENT_FAILURES) <= codes, "an entry no settlement fails with"
    webhooks = (ROOT / "docs" / "webhooks.md").read_text(encoding="utf-8")
    table = webhooks.split("Settlement failure codes", 1)[-1]
    assert [code for code in SETTLEMENT_FAILURES if f"`{code}`" not in table] == []
