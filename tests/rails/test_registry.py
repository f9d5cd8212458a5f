"""The rail registry (``backend.rails``): one rail per chain kind, and no kind branch outside the rails."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from backend.chains.addresses import AddressError
from backend.chains.registry import KINDS, ChainRegistry
from backend.rails.base import Rail
from backend.rails.evm.outcome import EXPIRY_GRACE_SECONDS
from backend.rails.evm.terms import EvmTerms
from backend.rails.registry import RAILS, rail_for, rail_of_kind, rail_of_network_id
from backend.rails.solana.rail import SolanaTerms

ROOT = Path(__file__).resolve().parents[2]
# A comparison of a chain kind with a literal kind, in code or templates ('evm' or "solana", either side).
KIND_BRANCH = re.compile(r"""kind\s*(==|!=)\s*['"](evm|solana)['"]|['"](evm|solana)['"]\s*(==|!=)\s*\S*kind\b""")
# Where a kind branch may remain, how many, and why. Everything else asks its rail (``rail_for``).
# None: the chains-file loader, below the rails, reads a kind's entry through its one table of kinds
# (``chains.registry._KIND_RULES``), and everything above asks the kind's rail.
ALLOWED: dict[str, int] = {}


def test_every_kind_has_one_rail():
    assert set(RAILS) == set(KINDS)
    for kind, rail in RAILS.items():
        assert rail.kind == kind and rail_of_kind(kind) is rail


def test_rail_for_each_configured_network():
    for network in ChainRegistry.load():
        assert rail_for(network) is RAILS[network.kind]


@pytest.mark.parametrize("kind", KINDS)
def test_each_rail_implements_the_whole_interface(kind):
    members = [name for name in dir(Rail) if not name.startswith("_")] + list(Rail.__annotations__)
    rail = rail_of_kind(kind)
    assert [name for name in members if not hasattr(rail, name)] == []


def test_addresses_are_normalised_by_their_rail():
    evm, solana = rail_of_kind("evm"), rail_of_kind("solana")
    assert evm.normalize_address("0x70997970c51812dc3a010c7d01b50e0d17dc79c8") == (
        "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
    )
    solana_key = "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWWM"
    assert solana.normalize_address(solana_key) == solana_key
    with pytest.raises(AddressError):
        evm.normalize_address(solana_key)
    with pytest.raises(AddressError):
        solana.normalize_address("0x70997970C51812dc3A010C7d01b50e0d17dc79C8")


def test_valid_before_is_compared_by_its_rail_not_against_a_clock():
    """``valid_before`` is a unix time on EVM and a block height on Solana. The bare comparison with the clock
    (``valid_before > time.time()``: "may it still execute?") was right for Solana rows only because block
    heights are smaller than unix times: with a height above the clock's seconds it answers "yes" for a
    transaction whose blockhash expired long ago, and with a grace added to heights it answers "yes" too long."""
    solana = rail_of_kind("solana")
    unix_now = 1_764_000_000
    valid_before = 2_000_000_300  # a Solana height (BLOCKHASH_MARGIN past the height read at /pay)
    height_now = valid_before + 1
    assert valid_before > unix_now  # the old bare comparison: "still valid"
    assert not solana.may_still_execute(_solana_terms(valid_before), height_now)  # its blockhash has expired
    assert solana.may_still_execute(_solana_terms(valid_before), valid_before)
    assert not solana.may_still_execute(_solana_terms(1_000), 1_000 + EXPIRY_GRACE_SECONDS)  # no grace on heights

    evm = rail_of_kind("evm")
    assert evm.may_still_execute(_evm_terms(unix_now), unix_now + EXPIRY_GRACE_SECONDS)  # final blocks may lag
    assert not evm.may_still_execute(_evm_terms(unix_now), unix_now + EXPIRY_GRACE_SECONDS + 1)
    assert evm.released_may_execute() and not solana.released_may_execute()


def _evm_terms(valid_before: int) -> EvmTerms:
    payer, pay_to, nonce, signature = "0x" + "11" * 20, "0x" + "22" * 20, "0x" + "01" * 32, "0x" + "ab" * 65
    raw = {"from": payer, "to": pay_to, "value": "1", "validAfter": "0", "validBefore": str(valid_before),
           "nonce": nonce, "signature": signature}  # fmt: skip
    return EvmTerms(payer, pay_to, 1, 0, valid_before, bytes.fromhex(nonce[2:]), signature, raw)


def _solana_terms(last_valid_block_height: int) -> SolanaTerms:
    return SolanaTerms("payer", "pay_to", 1, last_valid_block_height, "0x" + "cd" * 32, "base64")


def test_terms_carry_what_a_claim_stores_and_read_back_from_their_columns():
    """Each rail writes the common columns and its own (``Rail.columns``), and reads the same terms back."""
    evm, solana = _evm_terms(2), _solana_terms(2)
    assert evm.nonce_hex == "0x" + "01" * 32
    for terms, kind in ((evm, "evm"), (solana, "solana")):
        rail = rail_of_kind(kind)
        columns = rail.columns_of(terms)
        assert set(columns) == {"payer", "pay_to", "amount_atomic", "nonce", *rail.columns}
        assert None not in columns.values()
        assert rail.terms_from_columns(columns) == terms
    assert rail_of_kind("solana").columns_of(solana) == {
        "payer": "payer", "pay_to": "pay_to", "amount_atomic": 1, "nonce": "0x" + "cd" * 32,
        "last_valid_block_height": 2, "signed_transaction": "base64",
    }  # fmt: skip
    assert not set(rail_of_kind("evm").columns) & set(rail_of_kind("solana").columns)


def test_a_network_id_names_its_rail():
    """A settlement row knows its network's CAIP-2 id only (the network may be gone from the chains file)."""
    for network in ChainRegistry.load():
        assert rail_of_network_id(network.network) is rail_for(network)
    assert rail_of_network_id("solana:anything") is rail_of_kind("solana")
    assert rail_of_network_id("eip155:1") is rail_of_kind("evm")
    with pytest.raises(KeyError):
        rail_of_network_id("cosmos:hub")


def test_no_chain_kind_branch_outside_the_rails():
    files = subprocess.run(
        ["git", "ls-files", "backend", "relayer", "clients/python/payintent", "devnet"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    found: dict[str, list[str]] = {}
    for name in files:
        if name.startswith("backend/rails/") or not name.endswith((".py", ".html")):
            continue
        for number, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1):
            if KIND_BRANCH.search(line):
                found.setdefault(name, []).append(f"{number}: {line.strip()}")
    extra = {name: lines for name, lines in found.items() if len(lines) > ALLOWED.get(name, 0)}
    assert extra == {}, "ask the network's rail (backend.rails.registry.rail_for) instead"
    assert {name: len(lines) for name, lines in found.items()} == ALLOWED  # an exception that went: drop it


def test_a_rail_is_one_object_and_the_wallet_guard_does_not_depend_on_the_instance() -> None:
    """Review of the rails merge (L1): the guard against a payout to our own addresses picked a rail's networks by
    object identity, and two modules made rail objects of their own; an instance other than the registry's left
    the USDC mint/contract and the relay accounts unreserved."""
    from backend.chains.registry import ChainRegistry
    from backend.merchants.services import service_addresses
    from backend.rails.solana.rail import SolanaRail

    registry = ChainRegistry.load()
    by_registry = service_addresses(registry, rail_of_kind("solana"))
    assert any(network.usdc_address in by_registry for network in registry if rail_for(network).kind == "solana")
    assert service_addresses(registry, SolanaRail()) == by_registry


@pytest.mark.parametrize("kind", KINDS)
def test_a_rails_example_address_is_a_valid_payout_address_of_its_kind(kind):
    """The dev stack's demo merchant is paid to each rail's ``example_address`` (``devstack.seed_demo_merchant``)."""
    rail = rail_of_kind(kind)
    assert rail.normalize_address(rail.example_address) == rail.example_address
    assert rail.example_address not in rail.reserved_addresses()


def test_same_address_is_the_rails_rule():
    """The claim's "is payTo still the merchant's wallet" check compares through the rail: EVM addresses in any hex
    case are one account; Solana keys are case-sensitive base58."""
    evm, solana = rail_of_kind("evm"), rail_of_kind("solana")
    assert evm.same_address("0x70997970c51812dc3a010c7d01b50e0d17dc79c8", "0x70997970C51812dc3A010C7d01b50e0d17dc79C8")
    assert not evm.same_address("0x70997970C51812dc3A010C7d01b50e0d17dc79C8", "0x" + "00" * 20)
    key = "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWWM"
    assert solana.same_address(key, key) and not solana.same_address(key, key.lower())


def test_each_rail_serves_the_namespace_the_chains_file_gives_its_kind():
    from backend.chains.registry import _KIND_RULES

    assert {kind: rules.namespace for kind, rules in _KIND_RULES.items()} == {
        kind: rail.namespace for kind, rail in RAILS.items()
    }
