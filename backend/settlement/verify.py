"""Moved to the EVM rail (``backend.rails.evm.terms``); these names stay for the benchmarks and tests."""

from backend.rails.evm.terms import (
    MAX_VALIDITY_SECONDS,
    PAYLOAD_FIELDS,
    VALIDITY_MARGIN_SECONDS,
    EvmAuthorization,
    parse_evm_payload,
    verify_evm_authorization,
)

__all__ = [
    "MAX_VALIDITY_SECONDS",
    "PAYLOAD_FIELDS",
    "VALIDITY_MARGIN_SECONDS",
    "EvmAuthorization",
    "parse_evm_payload",
    "verify_evm_authorization",
]
