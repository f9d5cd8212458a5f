"""Schemathesis' stateful phase against the live API: sequences of calls that follow the links it infers from the
document (an intent created, then read, listed or cancelled; a webhook created, then read, rotated or deleted...),
each answer under every check, with the same deviations by design as tests/test_fuzz_api.py (there, BY_DESIGN;
one is the stateful phase's own: a cancelled intent stays readable)."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings

from tests.test_fuzz_api import CHECKS, CONFIG, DOCUMENT, api_url, app, chains, known  # noqa: F401 - fixtures

# Its own schema object: without test_fuzz_api's hooks, which put fixed real ids into requests; here the ids come
# from earlier answers, through the links.
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)

STEPS = 10
SEQUENCES = 150


def test_call_sequences_conform_to_the_document(api_url: str, merchant: Any, known: Any) -> None:  # noqa: F811
    links = schema.as_state_machine()
    assert links.bundles, "no link inferred between operations: the stateful phase would test nothing"

    class Workflow(links):  # type: ignore[misc,valid-type]
        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": api_url, "headers": merchant.headers, "timeout": 30}

        def validate_response(self, response: Any, case: Any, additional_checks: Any = None, **kwargs: Any) -> None:
            case.validate_response(response, checks=CHECKS)

    Workflow.run(
        settings=settings(
            max_examples=SEQUENCES,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
    )
