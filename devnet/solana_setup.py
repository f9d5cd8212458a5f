"""What the local Solana RPC creates at start: a 6-decimal USDC-like mint and funded accounts.

The setup file (JSON, written by ``devnet up``; it holds secret keys, so mode 0600)::

    {"mint": {"keypair": "<base58 64-byte keypair>", "authority": "<base58 64-byte keypair>", "decimals": 6},
     "accounts": [{"address": "<base58 pubkey>", "lamports": 1000000000, "usdc": 10000000000}]}

``mint.keypair`` fixes the mint's address; ``mint.authority`` may mint more later. Each account
gets ``lamports`` of SOL and, when ``usdc`` > 0, its associated token account holding ``usdc``
atomic units. Everything goes through the SVM as ordinary SPL Token / Associated Token Account
transactions paid by the server's faucet (nothing is written into account data directly).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solders.hash import Hash
from solders.instruction import Instruction
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey
from solders.system_program import CreateAccountParams, TransferParams, create_account, transfer
from solders.transaction import VersionedTransaction
from spl.token.constants import TOKEN_PROGRAM_ID
from spl.token.instructions import (
    create_idempotent_associated_token_account,
    get_associated_token_address,
    initialize_mint2,
    mint_to_checked,
)
from spl.token.models import InitializeMint2Params, MintToCheckedParams

from devnet.solana_ledger import Ledger
from devnet.solana_token import MINT_LEN


class SetupError(ValueError):
    """The setup file is unreadable or inconsistent."""


@dataclass(frozen=True)
class Funding:
    address: Pubkey
    lamports: int
    usdc: int


@dataclass(frozen=True)
class Setup:
    mint: Keypair
    authority: Keypair
    decimals: int
    accounts: tuple[Funding, ...]


def setup_document(
    mint: Keypair, authority: Keypair, accounts: list[tuple[str, int, int]], decimals: int = 6
) -> dict[str, Any]:
    """The setup file's content; ``accounts`` are (address, lamports, usdc atomic units)."""
    return {
        "mint": {"keypair": str(mint), "authority": str(authority), "decimals": decimals},
        "accounts": [{"address": a, "lamports": lamports, "usdc": usdc} for a, lamports, usdc in accounts],
    }


def read_setup(path: Path) -> Setup:
    try:
        document = json.loads(path.read_text())
        mint = document["mint"]
        accounts = tuple(
            Funding(Pubkey.from_string(a["address"]), int(a.get("lamports", 0)), int(a.get("usdc", 0)))
            for a in document.get("accounts", [])
        )
        setup = Setup(
            Keypair.from_base58_string(mint["keypair"]),
            Keypair.from_base58_string(mint["authority"]),
            int(mint.get("decimals", 6)),
            accounts,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SetupError(f"cannot use setup file {path}: {exc}") from None
    if any(f.lamports < 0 or f.usdc < 0 for f in setup.accounts) or not 0 <= setup.decimals <= 9:
        raise SetupError(f"{path}: amounts must be non-negative and decimals between 0 and 9")
    return setup


def apply_setup(ledger: Ledger, setup: Setup) -> Pubkey:
    """Create the mint and fund the accounts; returns the mint address. Raises if any transaction fails."""
    faucet = ledger.faucet
    mint = setup.mint.pubkey()
    rent = ledger.minimum_balance_for_rent_exemption(MINT_LEN)
    _send(
        ledger,
        [
            create_account(
                CreateAccountParams(
                    from_pubkey=faucet.pubkey(), to_pubkey=mint, lamports=rent, space=MINT_LEN, owner=TOKEN_PROGRAM_ID
                )
            ),
            initialize_mint2(
                InitializeMint2Params(
                    program_id=TOKEN_PROGRAM_ID,
                    mint=mint,
                    decimals=setup.decimals,
                    mint_authority=setup.authority.pubkey(),
                )
            ),
        ],
        [faucet, setup.mint],
    )
    for funding in setup.accounts:
        instructions: list[Instruction] = []
        if funding.lamports:
            instructions.append(
                transfer(
                    TransferParams(from_pubkey=faucet.pubkey(), to_pubkey=funding.address, lamports=funding.lamports)
                )
            )
        if funding.usdc:
            token_account = get_associated_token_address(funding.address, mint)
            instructions += [
                create_idempotent_associated_token_account(faucet.pubkey(), funding.address, mint),
                mint_to_checked(
                    MintToCheckedParams(
                        program_id=TOKEN_PROGRAM_ID,
                        mint=mint,
                        dest=token_account,
                        mint_authority=setup.authority.pubkey(),
                        amount=funding.usdc,
                        decimals=setup.decimals,
                    )
                ),
            ]
        if instructions:
            signers = [faucet, setup.authority] if funding.usdc else [faucet]
            _send(ledger, instructions, signers)
    return mint


def _send(ledger: Ledger, instructions: list[Instruction], signers: list[Keypair]) -> None:
    blockhash, _ = ledger.latest_blockhash()
    message = Message.new_with_blockhash(instructions, signers[0].pubkey(), Hash.from_string(blockhash))
    ledger.send(VersionedTransaction(message, signers), preflight=True)
