"""Target checks on resolved addresses (no network needed: literals and the loopback name)."""

from __future__ import annotations

import ipaddress

import pytest

from backend.webhooks.transport import TargetRefused, address_allowed, post, resolve


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.0.0.5", False),
        ("172.16.3.4", False),
        ("192.168.0.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # carrier-grade NAT
        ("0.0.0.0", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("::ffff:127.0.0.1", False),  # loopback wrapped in IPv6
        ("::ffff:10.0.0.1", False),
        ("224.0.0.1", False),
    ],
)
def test_only_public_unicast_addresses_are_allowed(address, allowed):
    assert address_allowed(ipaddress.ip_address(address)) is allowed


def test_names_are_checked_on_every_resolved_address():
    with pytest.raises(TargetRefused, match="not a public address"):
        resolve("localhost", 80, allow_private=False)
    assert resolve("localhost", 80, allow_private=True) in {"127.0.0.1", "::1"}


def test_a_refused_target_is_never_contacted():
    result = post("http://127.0.0.1:9/hook", b"{}", {}, allow_private=False)
    assert not result.succeeded
    assert result.status_code is None
    assert result.error.startswith("refused:")
