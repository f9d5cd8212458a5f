"""The on-chain audit of payments (EVM chains): what the service says it took against what the chain holds.

Used by the benchmarks (``bench.pay``, ``bench.load``) and the drills (``drills.payments``), each after its
own checks of the database. Given the payments the service recorded as paid (``Paid``) and the token
balances of every buyer and payee before (``balances``), ``audit`` returns the problems found:

- exactly once: each paid payment's transaction succeeded and moved, in the USDC contract, exactly one
  transfer: the payment's amount from its buyer to its payee (nothing else, nothing twice); no transaction
  counts for two payments;
- the balances add up, to the atomic unit: each audited address's change is what it received as a payee
  minus what it paid as a buyer. A buyer who lost more than their recorded payments is an unrecorded
  charge; a payee short of its payments is a payment counted but not made.

Reads go straight to the chain's JSON-RPC (batched), never through the service.
"""

from __future__ import annotations

import json
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BALANCE_OF = "0x70a08231"  # balanceOf(address)
TRANSFER_TOPIC = (
    "0xddf252ad1be2c89b69c2b068fc378daa952ba7f163c4a11628f55a4df523b3ef"  # Transfer(address,address,uint256)
)
BATCH = 100


@dataclass(frozen=True)
class Token:
    """One network's chain (its JSON-RPC URL, not through any proxy) and its USDC contract."""

    rpc_url: str
    usdc: str


@dataclass(frozen=True)
class Paid:
    """A payment the service recorded as paid: ``atomic`` USDC from ``buyer`` to ``payee`` on ``network``,
    by transaction ``tx_hash`` (None: the balances are audited, not the transaction)."""

    network: str
    buyer: str
    payee: str
    atomic: int
    tx_hash: str | None = None


Balances = dict[tuple[str, str], int]  # (network, lower-case address) -> atomic USDC


def rpc_batch(url: str, calls: Sequence[tuple[str, list[Any]]], timeout: float = 30) -> list[Any]:
    """The results of JSON-RPC ``calls`` (method, params), in order, sent in batches of BATCH."""
    results: list[Any] = []
    for start in range(0, len(calls), BATCH):
        chunk = calls[start : start + BATCH]
        body = [{"jsonrpc": "2.0", "id": i, "method": m, "params": p} for i, (m, p) in enumerate(chunk)]
        request = urllib.request.Request(
            url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # a local chain's URL
            answers = sorted(json.loads(answer.read()), key=lambda a: a["id"])
        for a in answers:
            if "error" in a:
                raise RuntimeError(f"{url}: {a['error']}")
            results.append(a["result"])
    return results


def balances(tokens: Mapping[str, Token], addresses: Mapping[str, Iterable[str]]) -> Balances:
    """USDC balances of ``addresses`` per network, read now."""
    out: Balances = {}
    for network, wanted in addresses.items():
        token = tokens[network]
        keys = sorted({a.lower() for a in wanted})
        calls = [("eth_call", [{"to": token.usdc, "data": BALANCE_OF + a[2:].rjust(64, "0")}, "latest"]) for a in keys]
        for address, value in zip(keys, rpc_batch(token.rpc_url, calls), strict=True):
            out[(network, address)] = int(value, 16)
    return out


def _transfers(receipt: dict[str, Any], usdc: str) -> list[tuple[str, str, int]]:
    """The USDC Transfer events of a receipt: (from, to, value), addresses lower-case."""
    found = []
    for entry in receipt.get("logs") or []:
        topics = entry.get("topics") or []
        if str(entry.get("address", "")).lower() == usdc.lower() and topics and topics[0].lower() == TRANSFER_TOPIC:
            found.append(("0x" + topics[1][-40:].lower(), "0x" + topics[2][-40:].lower(), int(entry["data"], 16)))
    return found


def check_transactions(tokens: Mapping[str, Token], paid: Sequence[Paid]) -> list[str]:
    """Each paid payment's transaction: succeeded, and moved exactly its amount from buyer to payee, once."""
    problems = []
    hashes = Counter(p.tx_hash.lower() for p in paid if p.tx_hash)
    twice = sum(n - 1 for n in hashes.values() if n > 1)
    if twice:
        problems.append(f"{twice} x a transaction counted for two payments")
    by_network: dict[str, list[Paid]] = defaultdict(list)
    for p in paid:
        if p.tx_hash:
            by_network[p.network].append(p)
    for network, group in by_network.items():
        token = tokens[network]
        receipts = rpc_batch(token.rpc_url, [("eth_getTransactionReceipt", [p.tx_hash]) for p in group])
        failed = wrong = 0
        example = ""
        for p, receipt in zip(group, receipts, strict=True):
            if receipt is None or int(receipt["status"], 16) != 1:
                failed += 1
                continue
            moved = _transfers(receipt, token.usdc)
            if moved != [(p.buyer.lower(), p.payee.lower(), p.atomic)]:
                wrong += 1
                example = example or f"{p.tx_hash} moved {moved} for {p.atomic} from {p.buyer} to {p.payee}"
        if failed:
            problems.append(f"{failed} x a paid payment's transaction on {network} missing or reverted")
        if wrong:
            problems.append(f"{wrong} x a transaction on {network} not exactly its payment's transfer, e.g. {example}")
    return problems


def check_balances(
    tokens: Mapping[str, Token], paid: Sequence[Paid], before: Mapping[tuple[str, str], int]
) -> list[str]:
    """Every address of ``before``: its balance now is before + received - paid, to the atomic unit."""
    problems = []
    expected: Counter[tuple[str, str]] = Counter()
    for p in paid:
        expected[(p.network, p.buyer.lower())] -= p.atomic
        expected[(p.network, p.payee.lower())] += p.atomic
    before = {(n, a.lower()): v for (n, a), v in before.items()}
    missing = [key for key in expected if key not in before]
    if missing:
        problems.append(f"{len(missing)} x an address of a paid payment without a balance before, e.g. {missing[0]}")
    wanted: dict[str, list[str]] = defaultdict(list)
    for network, address in before:
        wanted[network].append(address)
    now = balances(tokens, wanted)
    payees = {(p.network, p.payee.lower()) for p in paid}
    for key, was in sorted(before.items()):
        change, recorded = now[key] - was, expected[key]
        if change == recorded:
            continue
        network, address = key
        if key in payees or change > 0:
            problems.append(f"{network}: {address} received {change} atomic USDC for {recorded} recorded")
        else:
            problems.append(
                f"{network}: {address} lost {-change} atomic USDC for {-recorded} recorded"
                + (" (an unrecorded charge)" if -change > -recorded else "")
            )
    return problems


def audit(tokens: Mapping[str, Token], paid: Sequence[Paid], before: Mapping[tuple[str, str], int]) -> list[str]:
    """The problems of ``paid`` on chain (``check_transactions``) and of the balances of ``before``'s
    addresses since (``check_balances``); empty when everything adds up."""
    return check_transactions(tokens, paid) + check_balances(tokens, paid, before)
