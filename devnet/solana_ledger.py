"""A local Solana ledger over LiteSVM: slots, a window of valid blockhashes, executed transactions.

LiteSVM (``solders.litesvm``) is a real SVM with the SPL Token, Associated Token Account, Memo and
Compute Budget programs, but it has no blocks: it accepts only its single latest blockhash and keeps a
bounded history of transaction results. :class:`Ledger` adds what a cluster's RPC node shows:

- a slot (= block height; no slot is skipped) that advances with a fresh blockhash every
  ``slot_seconds`` (400 ms, like the cluster) when :meth:`tick` is called;
- the last :data:`MAX_PROCESSING_AGE` + 1 blockhashes stay valid, as on the cluster: a transaction
  whose blockhash is older (or unknown) fails with ``BlockhashNotFound``; ``lastValidBlockHeight``
  is the blockhash's height + 150 (LiteSVM's own one-blockhash check is turned off);
- every executed transaction (with its slot, time, balances before and after, logs) for
  ``getSignatureStatuses`` and ``getTransaction``; a signature executes at most once
  (``AlreadyProcessed``); a transaction the cluster would drop (bad signature, stale blockhash,
  fee payer unable to pay) leaves no record;
- every executed transaction is final at once (``finalized``).

One lock guards the SVM and all of this: every method that reads or changes it takes the lock.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from solders.account import Account
from solders.clock import Clock
from solders.keypair import Keypair
from solders.litesvm import LiteSVM
from solders.message import Message
from solders.pubkey import Pubkey
from solders.system_program import TransferParams, transfer
from solders.transaction import VersionedTransaction
from solders.transaction_metadata import (
    FailedTransactionMetadata,
    SimulatedTransactionInfo,
    TransactionMetadata,
)

from devnet.base58 import b58encode
from devnet.solana_network import ledger_genesis_hash
from devnet.solana_token import parse_mint, parse_token_account, ui_token_amount

MAX_PROCESSING_AGE = 150  # a blockhash is valid for this many blocks after its own (Agave's constant)
STATUS_CACHE_SLOTS = 300  # getSignatureStatuses without searchTransactionHistory looks this far back
SLOT_SECONDS = 0.4
LAMPORTS_PER_SIGNATURE = 5_000
FAUCET_LAMPORTS = 500_000 * 10**9  # requestAirdrop pays from here
ADDRESS_LOOKUP_TABLE_PROGRAM = Pubkey.from_string("AddressLookupTab1e1111111111111111111111111")
_LOOKUP_TABLE_META_SIZE = 56


class TransactionRejected(Exception):
    """The transaction cannot be simulated or sent; ``err`` is the node's TransactionError JSON."""

    def __init__(self, err: Any, logs: list[str] | None = None, units: int = 0) -> None:
        super().__init__(describe_error(err))
        self.err = err
        self.logs = logs or []
        self.units = units


class SignatureVerificationFailed(Exception):
    """A signature does not verify (the node's -32003 before simulating)."""


@dataclass(frozen=True)
class TokenBalance:
    account_index: int
    mint: str
    owner: str
    program_id: str
    amount: int
    decimals: int

    def to_json(self) -> dict[str, Any]:
        return {
            "accountIndex": self.account_index,
            "mint": self.mint,
            "owner": self.owner,
            "programId": self.program_id,
            "uiTokenAmount": ui_token_amount(self.amount, self.decimals),
        }


@dataclass
class Execution:
    """What running a transaction (or simulating it) produced."""

    err: Any  # None or the TransactionError JSON
    logs: list[str]
    units_consumed: int
    fee: int
    inner_instructions: list[dict[str, Any]]
    return_data: dict[str, Any] | None
    post_accounts: dict[Pubkey, Account] = field(default_factory=dict)


@dataclass
class TxRecord:
    """An executed transaction, as getTransaction and getSignatureStatuses report it."""

    signature: str
    slot: int
    block_time: int
    transaction: VersionedTransaction
    loaded_writable: list[Pubkey]
    loaded_readonly: list[Pubkey]
    execution: Execution
    pre_balances: list[int]
    post_balances: list[int]
    pre_token_balances: list[TokenBalance]
    post_token_balances: list[TokenBalance]


class Ledger:
    def __init__(self, *, slot_seconds: float = SLOT_SECONDS) -> None:
        self.slot_seconds = slot_seconds
        self.faucet = Keypair()
        self.genesis_hash = ledger_genesis_hash(os.urandom(32))  # this ledger's: a new one is a new chain
        self._lock = threading.RLock()
        self._svm = LiteSVM().with_blockhash_check(False)
        self._started = int(time.time())
        self._slot = 0
        self._slot_time = self._started  # unix time the current slot began (blockTime)
        self._blockhashes: OrderedDict[str, int] = OrderedDict()  # blockhash -> block height it was made at
        self._history: dict[str, TxRecord] = {}
        self._advance()
        self._svm.airdrop(self.faucet.pubkey(), FAUCET_LAMPORTS)

    # --- slots and blockhashes ----------------------------------------------------------------------

    @property
    def slot(self) -> int:
        return self._slot

    @property
    def block_height(self) -> int:
        return self._slot

    @property
    def transaction_count(self) -> int:
        return len(self._history)

    def tick(self) -> None:
        """One more slot with a fresh blockhash (the server calls this every ``slot_seconds``)."""
        with self._lock:
            self._advance()

    def expire_blockhashes(self) -> tuple[str, int]:
        """Make every blockhash handed out so far stale (a dev-only aid for tests); returns the new one."""
        with self._lock:
            self._blockhashes.clear()
            self._advance()
            return self.latest_blockhash()

    def latest_blockhash(self) -> tuple[str, int]:
        """(blockhash, lastValidBlockHeight)."""
        with self._lock:
            blockhash, height = next(reversed(self._blockhashes.items()))
            return blockhash, height + MAX_PROCESSING_AGE

    def last_valid_block_height(self, blockhash: str) -> int | None:
        with self._lock:
            height = self._blockhashes.get(blockhash)
            return None if height is None else height + MAX_PROCESSING_AGE

    def _advance(self) -> None:
        self._slot += 1
        now = int(time.time())
        self._slot_time = now
        self._svm.expire_blockhash()
        self._svm.set_clock(Clock(self._slot, self._started, 0, 1, now))
        self._blockhashes[str(self._svm.latest_blockhash())] = self._slot
        while len(self._blockhashes) > MAX_PROCESSING_AGE + 1:
            self._blockhashes.popitem(last=False)

    # --- accounts ---------------------------------------------------------------------------------------

    def account(self, address: Pubkey) -> Account | None:
        with self._lock:
            return self._svm.get_account(address)

    def program_accounts(self, program_id: Pubkey) -> list[tuple[Pubkey, Account]]:
        with self._lock:
            return self._svm.get_program_accounts(program_id)

    def minimum_balance_for_rent_exemption(self, data_len: int) -> int:
        with self._lock:
            return self._svm.minimum_balance_for_rent_exemption(data_len)

    def mint_decimals(self, mint: Pubkey) -> int | None:
        account = self.account(mint)
        parsed = parse_mint(account.owner, bytes(account.data)) if account else None
        return parsed.decimals if parsed else None

    # --- transactions -----------------------------------------------------------------------------------

    def send(self, tx: VersionedTransaction, *, preflight: bool) -> str:
        """Execute ``tx`` and return its signature.

        With ``preflight`` (the node's default), a bad signature raises :class:`SignatureVerificationFailed`
        and a failing simulation raises :class:`TransactionRejected`; nothing executes. Without it the
        signature is returned whatever happens, as the node does: a transaction the cluster would drop
        leaves no record, one that fails in a program is recorded with its error.
        """
        signature = str(tx.signatures[0])
        with self._lock:
            signatures_ok = all(tx.verify_with_results())
            if preflight:
                if not signatures_ok:
                    raise SignatureVerificationFailed
                rejected = self._check(tx, replace_blockhash=False)
                if rejected is not None:
                    raise TransactionRejected(rejected)
                simulated = self._simulate(tx, sig_verify=True)
                if simulated.err is not None:
                    raise TransactionRejected(simulated.err, simulated.logs, simulated.units_consumed)
            elif not signatures_ok or self._check(tx, replace_blockhash=False) is not None:
                return signature  # dropped by the cluster: no status will ever appear
            self._execute(tx)
        return signature

    def simulate(
        self, tx: VersionedTransaction, *, sig_verify: bool, replace_blockhash: bool
    ) -> tuple[Execution, tuple[str, int] | None]:
        """Run ``tx`` without committing; returns what it did and the replacement blockhash if one was used."""
        with self._lock:
            if sig_verify and not all(tx.verify_with_results()):
                raise SignatureVerificationFailed
            rejected = self._check(tx, replace_blockhash=replace_blockhash)
            if rejected is not None:
                return Execution(rejected, [], 0, 0, [], None), None
            return self._simulate(tx, sig_verify=sig_verify), self.latest_blockhash() if replace_blockhash else None

    def airdrop(self, to: Pubkey, lamports: int) -> str:
        """A system transfer from the faucet, executed like any transaction."""
        instruction = transfer(TransferParams(from_pubkey=self.faucet.pubkey(), to_pubkey=to, lamports=lamports))
        with self._lock:
            while True:
                message = Message.new_with_blockhash([instruction], self.faucet.pubkey(), self._svm.latest_blockhash())
                tx = VersionedTransaction(message, [self.faucet])
                if str(tx.signatures[0]) not in self._history:
                    return self.send(tx, preflight=True)
                self._advance()  # the same airdrop twice in one slot: the same signature; make a new slot

    def record(self, signature: str) -> TxRecord | None:
        with self._lock:
            return self._history.get(signature)

    def statuses(self, signatures: list[str], *, search_history: bool) -> list[TxRecord | None]:
        with self._lock:
            found = [self._history.get(s) for s in signatures]
            if not search_history:
                oldest = self._slot - STATUS_CACHE_SLOTS
                found = [r if r is not None and r.slot >= oldest else None for r in found]
            return found

    # --- internals (lock held) --------------------------------------------------------------------------

    def _check(self, tx: VersionedTransaction, *, replace_blockhash: bool) -> Any:
        """The error the bank's age and status-cache checks give ``tx``, or None."""
        if not replace_blockhash and str(tx.message.recent_blockhash) not in self._blockhashes:
            return "BlockhashNotFound"
        if str(tx.signatures[0]) in self._history:
            return "AlreadyProcessed"
        return None

    def _simulate(self, tx: VersionedTransaction, *, sig_verify: bool) -> Execution:
        self._svm.with_sigverify(sig_verify)
        try:
            result = self._svm.simulate_transaction(tx)
        finally:
            self._svm.with_sigverify(True)
        if isinstance(result, SimulatedTransactionInfo):
            return _execution(result.meta(), None, dict(result.post_accounts()))
        return _execution(result.meta(), _error_json(result), {})

    def _execute(self, tx: VersionedTransaction) -> None:
        writable, readonly = self._loaded_addresses(tx)
        keys = [*tx.message.account_keys, *writable, *readonly]
        pre = self._balances(keys)
        pre_tokens = self._token_balances(keys)
        result = self._svm.send_transaction(tx)
        signature = tx.signatures[0]
        if isinstance(result, TransactionMetadata):
            execution = _execution(result, None, {})
        elif self._svm.get_transaction(signature) is not None:  # failed in a program: included, fee charged
            execution = _execution(result.meta(), _error_json(result), {})
        else:
            return  # refused before execution (e.g. the fee payer cannot pay): the cluster drops it
        self._history[str(signature)] = TxRecord(
            signature=str(signature),
            slot=self._slot,
            block_time=self._slot_time,
            transaction=tx,
            loaded_writable=writable,
            loaded_readonly=readonly,
            execution=execution,
            pre_balances=pre,
            post_balances=self._balances(keys),
            pre_token_balances=pre_tokens,
            post_token_balances=self._token_balances(keys),
        )

    def _balances(self, keys: list[Pubkey]) -> list[int]:
        return [self._svm.get_balance(k) or 0 for k in keys]

    def _token_balances(self, keys: list[Pubkey]) -> list[TokenBalance]:
        balances = []
        for index, key in enumerate(keys):
            account = self._svm.get_account(key)
            parsed = parse_token_account(account.owner, bytes(account.data)) if account else None
            if parsed is None or account is None:
                continue
            mint = self._svm.get_account(parsed.mint)
            mint_info = parse_mint(mint.owner, bytes(mint.data)) if mint else None
            if mint_info is None:
                continue
            balances.append(
                TokenBalance(
                    index, str(parsed.mint), str(parsed.owner), str(account.owner), parsed.amount, mint_info.decimals
                )
            )
        return balances

    def _loaded_addresses(self, tx: VersionedTransaction) -> tuple[list[Pubkey], list[Pubkey]]:
        """The addresses a v0 transaction loads from lookup tables (writable, readonly); empty if unresolvable."""
        lookups = getattr(tx.message, "address_table_lookups", None) or []
        writable: list[Pubkey] = []
        readonly: list[Pubkey] = []
        for lookup in lookups:
            table = self._svm.get_account(lookup.account_key)
            if table is None or table.owner != ADDRESS_LOOKUP_TABLE_PROGRAM:
                return [], []
            data = bytes(table.data)[_LOOKUP_TABLE_META_SIZE:]
            addresses = [Pubkey.from_bytes(data[i : i + 32]) for i in range(0, len(data) - 31, 32)]
            try:
                writable += [addresses[i] for i in bytes(lookup.writable_indexes)]
                readonly += [addresses[i] for i in bytes(lookup.readonly_indexes)]
            except IndexError:
                return [], []
        return writable, readonly


def _error_json(result: FailedTransactionMetadata) -> Any:
    return json.loads(result.to_json())["err"]


def _execution(meta: TransactionMetadata, err: Any, post_accounts: dict[Pubkey, Account]) -> Execution:
    inner = []
    for index, instructions in enumerate(meta.inner_instructions()):
        if instructions:
            inner.append(
                {
                    "index": index,
                    "instructions": [
                        {
                            "programIdIndex": ix.instruction().program_id_index,
                            "accounts": list(bytes(ix.instruction().accounts)),
                            "data": b58encode(bytes(ix.instruction().data)),
                            "stackHeight": ix.stack_height(),
                        }
                        for ix in instructions
                    ],
                }
            )
    returned = meta.return_data()
    return_data = None
    if returned is not None and bytes(returned.data):
        return_data = {
            "programId": str(returned.program_id),
            "data": [base64.b64encode(bytes(returned.data)).decode(), "base64"],
        }
    return Execution(
        err=err,
        logs=list(meta.logs()),
        units_consumed=meta.compute_units_consumed(),
        fee=meta.fee(),
        inner_instructions=inner,
        return_data=return_data,
        post_accounts=post_accounts,
    )


# --- TransactionError text, as the node formats it in "Transaction simulation failed: ..." -----------------

_TRANSACTION_ERRORS = {
    "AccountInUse": "Account in use",
    "AccountLoadedTwice": "Account loaded twice",
    "AccountNotFound": "Attempt to debit an account but found no record of a prior credit.",
    "ProgramAccountNotFound": "Attempt to load a program that does not exist",
    "InsufficientFundsForFee": "Insufficient funds for fee",
    "InvalidAccountForFee": "This account may not be used to pay transaction fees",
    "AlreadyProcessed": "This transaction has already been processed",
    "BlockhashNotFound": "Blockhash not found",
    "CallChainTooDeep": "Loader call chain is too deep",
    "MissingSignatureForFee": "Transaction requires a fee but has no signature present",
    "InvalidAccountIndex": "Transaction contains an invalid account reference",
    "SignatureFailure": "Transaction did not pass signature verification",
    "InvalidProgramForExecution": "This program may not be used for executing instructions",
    "SanitizeFailure": "Transaction failed to sanitize accounts offsets correctly",
    "AddressLookupTableNotFound": "Transaction loads an address table account that doesn't exist",
    "InvalidAddressLookupTableIndex": "Transaction address table lookup uses an invalid index",
    "WouldExceedMaxBlockCostLimit": "Transaction would exceed max Block Cost Limit",
    "WouldExceedAccountDataBlockLimit": "Transaction would exceed max account data limit within the block",
}
_INSTRUCTION_ERRORS = {
    "GenericError": "generic instruction error",
    "InvalidArgument": "invalid program argument",
    "InvalidInstructionData": "invalid instruction data",
    "InvalidAccountData": "invalid account data for instruction",
    "AccountDataTooSmall": "account data too small for instruction",
    "InsufficientFunds": "insufficient funds for instruction",
    "IncorrectProgramId": "incorrect program id for instruction",
    "MissingRequiredSignature": "missing required signature for instruction",
    "AccountAlreadyInitialized": "instruction requires an uninitialized account",
    "UninitializedAccount": "instruction requires an initialized account",
    "NotEnoughAccountKeys": "insufficient account keys for instruction",
    "AccountNotExecutable": "instruction expected an executable account",
    "ComputationalBudgetExceeded": "Computational budget exceeded",
    "ProgramFailedToComplete": "Program failed to complete",
    "InvalidSeeds": "Provided seeds do not result in a valid address",
    "IllegalOwner": "Provided owner is not allowed",
    "ReadonlyLamportChange": "instruction changed the balance of a read-only account",
    "ExternalAccountLamportSpend": "instruction spent from the balance of an account it does not own",
    "UnbalancedInstruction": "sum of account balances before and after instruction do not match",
    "PrivilegeEscalation": "Cross-program invocation with unauthorized signer or writable account",
}


def describe_error(err: Any) -> str:
    if isinstance(err, str):
        return _TRANSACTION_ERRORS.get(err, err)
    if isinstance(err, dict) and len(err) == 1:
        ((name, value),) = err.items()
        if name == "InstructionError" and isinstance(value, list) and len(value) == 2:
            index, inner = value
            if isinstance(inner, dict) and "Custom" in inner:
                text = f"custom program error: {int(inner['Custom']):#x}"
            elif isinstance(inner, str):
                text = _INSTRUCTION_ERRORS.get(inner, inner)
            else:
                text = json.dumps(inner)
            return f"Error processing Instruction {index}: {text}"
        if name == "InsufficientFundsForRent" and isinstance(value, dict):
            return f"Transaction results in an account ({value.get('account_index')}) with insufficient funds for rent"
        if name == "DuplicateInstruction":
            return f"Transaction contains a duplicate instruction ({value}) that is not allowed"
    return json.dumps(err)
