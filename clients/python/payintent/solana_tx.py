"""The Solana payment transaction: how it is built and the rules a buyer-signed one must follow.

One definition, shared by the server (which builds the unsigned transaction and checks the signed
one before its relay co-signs) and the client package (which signs it). The transaction is a
version-0 message without address lookup tables whose fee payer is the service's relay:

1. ComputeBudget ``SetComputeUnitLimit`` (at most MAX_COMPUTE_UNIT_LIMIT)
2. ComputeBudget ``SetComputeUnitPrice`` (at most MAX_COMPUTE_UNIT_PRICE micro-lamports)
3. only when the merchant's USDC account does not exist yet: Associated Token ``CreateIdempotent``
   of exactly that account (owner ``payTo``, the requirement's mint), **funded by the buyer**
4. SPL Token ``TransferChecked`` of exactly the amount, from the buyer's associated token account
   to the merchant's, with the buyer as authority
5. Memo (no accounts) carrying the intent id

Signers are exactly [relay (fee payer), buyer]; the relay appears in no instruction's accounts,
so its signature pays the fee and authorises nothing else. The account list is exactly the
accounts these instructions use, each once, and only the two USDC accounts are writable
non-signers. The relay therefore never pays an account's rent: the buyer does, when a payment
opens the merchant's account (the buyer is then a writable signer; otherwise read-only). The fee the relay pays is
``transaction_fee(message)``, at most MAX_TRANSACTION_FEE lamports.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from dataclasses import dataclass
from typing import Any

from solders.compute_budget import set_compute_unit_limit, set_compute_unit_price
from solders.hash import Hash
from solders.instruction import AccountMeta, Instruction
from solders.message import Message, MessageV0, MessageV1, to_bytes_versioned
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.transaction import VersionedTransaction

TOKEN_PROGRAM = Pubkey.from_string("TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA")
ASSOCIATED_TOKEN_PROGRAM = Pubkey.from_string("ATokenGPvbdGVxr1b2hvZbsiqW5xWH25efTNsLJA8knL")
COMPUTE_BUDGET_PROGRAM = Pubkey.from_string("ComputeBudget111111111111111111111111111111")
MEMO_PROGRAM = Pubkey.from_string("MemoSq4gqABAXKb96qnH8TysNcWxMyWCqXgDLGmfcHr")
SYSTEM_PROGRAM = Pubkey.from_string("11111111111111111111111111111111")

COMPUTE_UNIT_LIMIT = 40_000
COMPUTE_UNIT_LIMIT_WITH_ACCOUNT = 80_000  # the same plus CreateIdempotent (about 25,000 units on mainnet)
MAX_COMPUTE_UNIT_LIMIT = 100_000
COMPUTE_UNIT_PRICE = 1_000  # micro-lamports per unit
# The relay pays the priority fee (price x limit), so the buyer may not raise it far: at these caps it
# is at most 500 lamports, 5% over the 10,000 lamports of the two signatures (it was up to 20,000).
MAX_COMPUTE_UNIT_PRICE = 5_000
LAMPORTS_PER_SIGNATURE = 5_000
MAX_PRIORITY_FEE = (MAX_COMPUTE_UNIT_PRICE * MAX_COMPUTE_UNIT_LIMIT + 999_999) // 1_000_000  # lamports: 500
MAX_TRANSACTION_FEE = 2 * LAMPORTS_PER_SIGNATURE + MAX_PRIORITY_FEE
TOKEN_ACCOUNT_SIZE = 165  # bytes of an SPL token account: its rent is what opening one costs
# Lamports that rent is on the Solana clusters: (165 + 128 bytes) x 3,480 lamports a byte-year x 2 years.
TOKEN_ACCOUNT_RENT = 2_039_280
MAX_TRANSACTION_BYTES = 1232
_TRANSFER_CHECKED = 12
_CREATE_IDEMPOTENT = bytes([1])
_SET_LIMIT = 2
_SET_PRICE = 3


class SolanaTransactionError(ValueError):
    """The transaction breaks a rule; ``code`` is the API error code, the message says which rule."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def associated_token_address(owner: Pubkey, mint: Pubkey) -> Pubkey:
    seeds = [bytes(owner), bytes(TOKEN_PROGRAM), bytes(mint)]
    return Pubkey.find_program_address(seeds, ASSOCIATED_TOKEN_PROGRAM)[0]


def transfer_checked(source: Pubkey, mint: Pubkey, destination: Pubkey, authority: Pubkey, amount: int) -> Instruction:
    data = struct.pack("<BQB", _TRANSFER_CHECKED, amount, 6)
    accounts = [
        AccountMeta(source, is_signer=False, is_writable=True),
        AccountMeta(mint, is_signer=False, is_writable=False),
        AccountMeta(destination, is_signer=False, is_writable=True),
        AccountMeta(authority, is_signer=True, is_writable=False),
    ]
    return Instruction(TOKEN_PROGRAM, data, accounts)


def memo(text: str) -> Instruction:
    return Instruction(MEMO_PROGRAM, text.encode("utf-8"), [])


def create_token_account(funder: Pubkey, owner: Pubkey, mint: Pubkey) -> Instruction:
    """Associated Token ``CreateIdempotent``: ``owner``'s account of ``mint``, rent paid by ``funder``
    (a no-op if it exists)."""
    accounts = [
        AccountMeta(funder, is_signer=True, is_writable=True),
        AccountMeta(associated_token_address(owner, mint), is_signer=False, is_writable=True),
        AccountMeta(owner, is_signer=False, is_writable=False),
        AccountMeta(mint, is_signer=False, is_writable=False),
        AccountMeta(SYSTEM_PROGRAM, is_signer=False, is_writable=False),
        AccountMeta(TOKEN_PROGRAM, is_signer=False, is_writable=False),
    ]
    return Instruction(ASSOCIATED_TOKEN_PROGRAM, _CREATE_IDEMPOTENT, accounts)


def build_payment(
    *,
    fee_payer: str,
    payer: str,
    mint: str,
    pay_to: str,
    amount_atomic: int,
    intent_id: str,
    recent_blockhash: str,
    unit_price: int = COMPUTE_UNIT_PRICE,
    create_payee_account: bool = False,
    unit_limit: int | None = None,
) -> VersionedTransaction:
    """The unsigned payment transaction (both signature slots empty).

    ``create_payee_account``: the merchant's USDC account does not exist yet, so the transaction
    opens it first, the buyer paying its rent.
    """
    payer_key, mint_key, pay_to_key = Pubkey.from_string(payer), Pubkey.from_string(mint), Pubkey.from_string(pay_to)
    if unit_limit is None:
        unit_limit = COMPUTE_UNIT_LIMIT_WITH_ACCOUNT if create_payee_account else COMPUTE_UNIT_LIMIT
    instructions = [set_compute_unit_limit(unit_limit), set_compute_unit_price(unit_price)]
    if create_payee_account:
        instructions.append(create_token_account(payer_key, pay_to_key, mint_key))
    instructions += [
        transfer_checked(
            associated_token_address(payer_key, mint_key),
            mint_key,
            associated_token_address(pay_to_key, mint_key),
            payer_key,
            amount_atomic,
        ),
        memo(intent_id),
    ]
    message = MessageV0.try_compile(Pubkey.from_string(fee_payer), instructions, [], Hash.from_string(recent_blockhash))
    return VersionedTransaction.populate(message, [Signature.default()] * message.header.num_required_signatures)


def encode(tx: VersionedTransaction) -> str:
    return base64.b64encode(bytes(tx)).decode("ascii")


def decode(text: Any) -> VersionedTransaction:
    if not isinstance(text, str) or not text:
        raise SolanaTransactionError("INVALID_PAYLOAD", "payload.transaction must be a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise SolanaTransactionError("INVALID_PAYLOAD", "payload.transaction is not valid base64") from None
    if len(raw) > MAX_TRANSACTION_BYTES:
        raise SolanaTransactionError("INVALID_PAYLOAD", "the transaction is larger than a Solana packet")
    try:
        return VersionedTransaction.from_bytes(raw)
    except BaseException as exc:  # solders raises PanicException (a BaseException) on some malformed input
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise SolanaTransactionError("INVALID_PAYLOAD", "payload.transaction is not a Solana transaction") from None


def sign_as(tx: VersionedTransaction, keypair: Any) -> VersionedTransaction:
    """Fill ``keypair``'s signature slot (the buyer's, or the relay's) and keep the others."""
    message = tx.message
    keys = list(message.account_keys)[: message.header.num_required_signatures]
    index = keys.index(keypair.pubkey())
    signatures = list(tx.signatures)
    signatures[index] = keypair.sign_message(to_bytes_versioned(message))
    return VersionedTransaction.populate(message, signatures)


@dataclass(frozen=True)
class SolanaPayment:
    """What a checked buyer-signed transaction does."""

    payer: str
    buyer_signature: str  # base58
    message_hash: str  # hex sha256 of the signed message: one settlement per message
    recent_blockhash: str
    amount_atomic: int
    unit_limit: int
    unit_price: int
    creates_payee_account: bool = False  # the buyer opens (and funds) the merchant's USDC account
    fee_lamports: int = 0  # what the relay (fee payer) pays for it: ``transaction_fee``


def priority_fee(unit_limit: int, unit_price: int) -> int:
    """Lamports: price (micro-lamports per unit) times the requested limit, rounded up."""
    return (unit_price * unit_limit + 999_999) // 1_000_000


def transaction_fee(message: Message | MessageV0 | MessageV1) -> int:
    """The fee the fee payer pays for ``message`` once it lands (successful or not), in lamports:
    LAMPORTS_PER_SIGNATURE per signature plus the priority fee of its compute-budget instructions."""
    keys = list(message.account_keys)
    limit = price = 0
    for ix in message.instructions:
        data = bytes(ix.data)
        if ix.program_id_index < len(keys) and keys[ix.program_id_index] == COMPUTE_BUDGET_PROGRAM and data:
            if data[0] == _SET_LIMIT and len(data) == 5:
                limit = int(struct.unpack("<I", data[1:])[0])
            elif data[0] == _SET_PRICE and len(data) == 9:
                price = int(struct.unpack("<Q", data[1:])[0])
    return LAMPORTS_PER_SIGNATURE * message.header.num_required_signatures + priority_fee(limit, price)


def _u32(data: bytes, opcode: int, what: str) -> int:
    if len(data) != 5 or data[0] != opcode:
        raise SolanaTransactionError("INVALID_TRANSACTION", f"malformed compute budget instruction ({what})")
    return int(struct.unpack("<I", data[1:])[0])


def check_payment(
    tx: VersionedTransaction, requirement: dict[str, Any], intent_id: str, fee_payer: str
) -> SolanaPayment:
    """Check a buyer-signed transaction against the requirement, instruction by instruction."""
    message = tx.message
    try:
        tx.sanitize()  # indices in range, signer counts consistent
    except BaseException as exc:  # solders raises its own exceptions (some are BaseException)
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise SolanaTransactionError("INVALID_TRANSACTION", "the transaction is malformed") from None
    if not isinstance(message, MessageV0) or list(message.address_table_lookups):
        raise SolanaTransactionError("INVALID_TRANSACTION", "use a version-0 message without address lookup tables")
    keys = list(message.account_keys)
    header = message.header
    relay = Pubkey.from_string(fee_payer)
    if len(keys) < 2 or any(ix.program_id_index >= len(keys) for ix in message.instructions):
        raise SolanaTransactionError("INVALID_TRANSACTION", "the transaction is malformed")
    if any(i >= len(keys) for ix in message.instructions for i in bytes(ix.accounts)):
        raise SolanaTransactionError("INVALID_TRANSACTION", "the transaction is malformed")
    if keys[0] != relay:
        raise SolanaTransactionError("FEE_PAYER_MISMATCH", f"the fee payer must be the relay {fee_payer}")
    if header.num_required_signatures != 2 or len(tx.signatures) != 2:
        raise SolanaTransactionError("INVALID_TRANSACTION", "exactly two signers: the relay (fee payer) and the buyer")
    payer = keys[1]
    if payer == relay:
        raise SolanaTransactionError("INVALID_TRANSACTION", "the buyer cannot be the relay")
    instructions = list(message.instructions)
    if len(instructions) not in (4, 5):
        raise SolanaTransactionError(
            "INVALID_TRANSACTION",
            "expected exactly: compute unit limit, compute unit price, (the merchant's account created idempotently, "
            "only if missing), TransferChecked, memo",
        )
    creates = len(instructions) == 5
    programs = [keys[ix.program_id_index] for ix in instructions]
    expected = [COMPUTE_BUDGET_PROGRAM, COMPUTE_BUDGET_PROGRAM, *([ASSOCIATED_TOKEN_PROGRAM] if creates else []),
                TOKEN_PROGRAM, MEMO_PROGRAM]  # fmt: skip
    if programs != expected:
        raise SolanaTransactionError("DISALLOWED_INSTRUCTION", "an instruction calls a program other than expected")
    for ix in instructions:
        if 0 in bytes(ix.accounts):  # index 0 is the relay
            raise SolanaTransactionError(
                "FEE_PAYER_MISUSED", "the relay may only pay the fee, not appear in an instruction"
            )
    # Opening the merchant's account debits the buyer (the rent): only then is the buyer a writable signer.
    if header.num_readonly_signed_accounts != (0 if creates else 1):
        raise SolanaTransactionError(
            "INVALID_TRANSACTION",
            "the buyer signs read-only (writable only to fund the merchant's account); only the fee payer pays fees",
        )
    limit_ix, price_ix, *create_ix, transfer_ix, memo_ix = instructions
    unit_limit = _u32(bytes(limit_ix.data), _SET_LIMIT, "limit")
    price_data = bytes(price_ix.data)
    if len(price_data) != 9 or price_data[0] != _SET_PRICE:
        raise SolanaTransactionError("INVALID_TRANSACTION", "malformed compute budget instruction (price)")
    unit_price = int(struct.unpack("<Q", price_data[1:])[0])
    if unit_limit > MAX_COMPUTE_UNIT_LIMIT:
        raise SolanaTransactionError("COMPUTE_BUDGET_TOO_HIGH", f"compute unit limit above {MAX_COMPUTE_UNIT_LIMIT}")
    if unit_price > MAX_COMPUTE_UNIT_PRICE:
        raise SolanaTransactionError(
            "COMPUTE_BUDGET_TOO_HIGH", f"compute unit price above {MAX_COMPUTE_UNIT_PRICE} micro-lamports"
        )
    if list(bytes(limit_ix.accounts)) or list(bytes(price_ix.accounts)):
        raise SolanaTransactionError("INVALID_TRANSACTION", "compute budget instructions take no accounts")

    data = bytes(transfer_ix.data)
    if len(data) != 10 or data[0] != _TRANSFER_CHECKED:
        raise SolanaTransactionError("DISALLOWED_INSTRUCTION", "the token instruction must be TransferChecked")
    amount, decimals = struct.unpack("<QB", data[1:])
    accounts = [keys[i] for i in bytes(transfer_ix.accounts)]
    if len(accounts) != 4:
        raise SolanaTransactionError("INVALID_TRANSACTION", "TransferChecked takes source, mint, destination, owner")
    source, mint, destination, authority = accounts
    asset = Pubkey.from_string(requirement["asset"])
    if mint != asset or decimals != 6:
        raise SolanaTransactionError("ASSET_MISMATCH", "the transfer is not of the requirement's USDC mint")
    if amount != int(requirement["maxAmountRequired"]):
        raise SolanaTransactionError("AMOUNT_MISMATCH", f"the amount must be {requirement['maxAmountRequired']}")
    if destination != associated_token_address(Pubkey.from_string(requirement["payTo"]), asset):
        raise SolanaTransactionError("RECIPIENT_MISMATCH", "the destination is not the merchant's USDC account")
    if authority != payer:
        raise SolanaTransactionError("INVALID_TRANSACTION", "the transfer's authority must be the buyer (signer 2)")
    if str(payer) == requirement["payTo"]:
        raise SolanaTransactionError("PAYER_IS_RECIPIENT", "the payer is the merchant's own wallet")
    if source != associated_token_address(payer, asset):
        raise SolanaTransactionError("INVALID_TRANSACTION", "the source must be the buyer's USDC account")
    if list(bytes(memo_ix.accounts)) or bytes(memo_ix.data) != intent_id.encode():
        raise SolanaTransactionError("INVALID_TRANSACTION", "the memo must be the intent id, with no accounts")
    if create_ix:
        # Exactly CreateIdempotent of the destination (the merchant's account of this mint), funded by the buyer.
        needed = [payer, destination, Pubkey.from_string(requirement["payTo"]), asset, SYSTEM_PROGRAM, TOKEN_PROGRAM]
        if bytes(create_ix[0].data) != _CREATE_IDEMPOTENT or [keys[i] for i in bytes(create_ix[0].accounts)] != needed:
            raise SolanaTransactionError(
                "DISALLOWED_INSTRUCTION",
                "the only account instruction allowed is CreateIdempotent of the merchant's USDC account, "
                "funded by the buyer",
            )

    # Exactly the payment's accounts, each once, writable only where the payment writes. Defence in depth: a
    # duplicate fails on chain (AccountLoadedTwice) and an unreferenced account costs the relay nothing today,
    # but the relay signs nothing it has not read in full.
    wanted = {relay, payer, source, destination, asset, TOKEN_PROGRAM, MEMO_PROGRAM, COMPUTE_BUDGET_PROGRAM}
    if create_ix:
        wanted |= {Pubkey.from_string(requirement["payTo"]), SYSTEM_PROGRAM, ASSOCIATED_TOKEN_PROGRAM}
    if len(set(keys)) != len(keys):
        raise SolanaTransactionError("INVALID_TRANSACTION", "an account is listed twice")
    if set(keys) != wanted:
        raise SolanaTransactionError("INVALID_TRANSACTION", "the transaction lists accounts the payment does not use")
    if set(keys[2 : len(keys) - header.num_readonly_unsigned_accounts]) != {source, destination}:
        raise SolanaTransactionError(
            "INVALID_TRANSACTION", "only the buyer's and the merchant's USDC accounts may be writable (besides signers)"
        )

    buyer_signature = tx.signatures[1]
    if buyer_signature == Signature.default() or not buyer_signature.verify(payer, to_bytes_versioned(message)):
        raise SolanaTransactionError("INVALID_SIGNATURE", "the buyer's signature is missing or invalid")
    return SolanaPayment(
        payer=str(payer),
        buyer_signature=str(buyer_signature),
        message_hash=hashlib.sha256(to_bytes_versioned(message)).hexdigest(),
        recent_blockhash=str(message.recent_blockhash),
        amount_atomic=int(amount),
        unit_limit=unit_limit,
        unit_price=unit_price,
        creates_payee_account=bool(create_ix),
        fee_lamports=transaction_fee(message),
    )
