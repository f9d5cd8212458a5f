"""A local Solana JSON-RPC 2.0 server over LiteSVM, for development and tests (not a validator).

Run it as its own process::

    python -m devnet.solana_rpc --host 127.0.0.1 --port 8899 [--setup setup.json] [--slot-ms 400]

It answers the standard HTTP methods with the standard request and response shapes, so the same
client code talks to it, to ``solana-test-validator`` or to Solana devnet: getLatestBlockhash,
isBlockhashValid, getAccountInfo, getMultipleAccounts, getBalance, getTokenAccountBalance,
getTokenAccountsByOwner, getMinimumBalanceForRentExemption, getFeeForMessage,
getRecentPrioritizationFees, simulateTransaction, sendTransaction, getSignatureStatuses,
getTransaction, requestAirdrop, getSlot, getBlockHeight, getEpochInfo, getHealth, getVersion,
getGenesisHash (Solana devnet's first 32 characters, so the CAIP-2 id
``solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1`` matches, and a tail new at each start: a ledger started
again is a new chain), also ``GET /health``. Batches and CORS (for browser wallets) are supported.

Non-standard, for tests only: ``devnet_expireBlockhashes`` makes every blockhash handed out so
far stale and returns a fresh ``{blockhash, lastValidBlockHeight, slot}``.

What it is not: there is one "node", no votes, forks or leader schedule; every executed
transaction is ``finalized`` at once; slot = block height; ``jsonParsed`` covers token accounts
and mints only (not transactions); no websockets (subscriptions), durable nonces or zstd.
See :mod:`devnet.solana_ledger` for how blockhashes and history are emulated.
"""

from __future__ import annotations

import argparse
import base64
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from solders.message import Message, from_bytes_versioned
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.transaction import VersionedTransaction

from devnet.jsonrpc_http import (
    INTERNAL_ERROR,
    METHOD_NOT_FOUND,
    JsonRpcServer,
    RpcError,
    invalid_params,
    make_server,
)
from devnet.solana_encoding import (
    decode_transaction,
    encode_account,
    encode_transaction,
    status_json,
    transaction_encoding,
    transaction_meta,
)
from devnet.solana_ledger import (
    LAMPORTS_PER_SIGNATURE,
    Execution,
    Ledger,
    SignatureVerificationFailed,
    TransactionRejected,
    describe_error,
)
from devnet.solana_token import TOKEN_PROGRAMS, parse_token_account, ui_token_amount

API_VERSION = "2.2.0"  # the Agave RPC whose shapes this follows
MAX_SIGNATURE_STATUSES = 256
MAX_MULTIPLE_ACCOUNTS = 100
DEFAULT_COMPUTE_UNITS_PER_INSTRUCTION = 200_000
MAX_COMPUTE_UNITS = 1_400_000
COMPUTE_BUDGET_PROGRAM = Pubkey.from_string("ComputeBudget111111111111111111111111111111")
COMMITMENTS = {"processed", "confirmed", "finalized", "recent", "single", "singleGossip", "root", "max"}

# The node's own JSON-RPC error codes
PREFLIGHT_FAILURE = -32002
SIGNATURE_VERIFICATION_FAILURE = -32003
UNSUPPORTED_TRANSACTION_VERSION = -32015
MIN_CONTEXT_SLOT_NOT_REACHED = -32016


# --- parameters ------------------------------------------------------------------------------------------


class Params:
    """Positional JSON-RPC params with the node's error messages."""

    def __init__(self, raw: Any) -> None:
        if raw is None:
            raw = []
        if not isinstance(raw, list):
            raise invalid_params("Invalid params: expected an array of parameters")
        self.raw = raw

    def get(self, index: int, default: Any = None) -> Any:
        return self.raw[index] if index < len(self.raw) and self.raw[index] is not None else default

    def required(self, index: int, what: str) -> Any:
        if index >= len(self.raw):
            raise invalid_params(f"Invalid params: missing {what}")
        return self.raw[index]

    def pubkey(self, index: int) -> Pubkey:
        return parse_pubkey(self.required(index, "a base-58 encoded address"))

    def config(self, index: int) -> dict[str, Any]:
        value = self.get(index, {})
        if not isinstance(value, dict):
            raise invalid_params("Invalid params: the configuration must be an object")
        return value


def parse_pubkey(value: Any) -> Pubkey:
    if not isinstance(value, str):
        raise invalid_params("Invalid param: Invalid")
    try:
        return Pubkey.from_string(value)
    except BaseException as exc:  # solders raises ValueError, or a pyo3 PanicException on odd input
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise invalid_params(f"Invalid param: {'WrongSize' if len(value) > 44 else 'Invalid'}") from None


def parse_signature(value: Any) -> Signature:
    if not isinstance(value, str):
        raise invalid_params("Invalid param: Invalid")
    try:
        return Signature.from_string(value)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise invalid_params("Invalid param: Invalid") from None


def flag(config: dict[str, Any], name: str, default: bool = False) -> bool:
    value = config.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_params(f"Invalid params: {name} must be a boolean")
    return value


def check_commitment(ledger: Ledger, config: dict[str, Any]) -> None:
    commitment = config.get("commitment", config.get("preflightCommitment"))
    if commitment is not None and commitment not in COMMITMENTS:
        raise invalid_params(f"Invalid params: unknown variant `{commitment}`")
    min_slot = config.get("minContextSlot")
    if min_slot is not None:
        if not isinstance(min_slot, int) or isinstance(min_slot, bool):
            raise invalid_params("Invalid params: minContextSlot must be an integer")
        if min_slot > ledger.slot:
            raise RpcError(
                MIN_CONTEXT_SLOT_NOT_REACHED, "Minimum context slot has not been reached", {"contextSlot": ledger.slot}
            )


def with_context(ledger: Ledger, value: Any) -> dict[str, Any]:
    return {"context": {"apiVersion": API_VERSION, "slot": ledger.slot}, "value": value}


# --- methods -------------------------------------------------------------------------------------------

Method = Callable[[Ledger, Params], Any]
METHODS: dict[str, Method] = {}


def method(name: str) -> Callable[[Method], Method]:
    def register(fn: Method) -> Method:
        METHODS[name] = fn
        return fn

    return register


@method("getHealth")
def get_health(ledger: Ledger, params: Params) -> Any:
    return "ok"


@method("getVersion")
def get_version(ledger: Ledger, params: Params) -> Any:
    return {"solana-core": API_VERSION, "feature-set": 0}


@method("getGenesisHash")
def get_genesis_hash(ledger: Ledger, params: Params) -> Any:
    return ledger.genesis_hash


@method("getSlot")
def get_slot(ledger: Ledger, params: Params) -> Any:
    check_commitment(ledger, params.config(0))
    return ledger.slot


@method("getBlockHeight")
def get_block_height(ledger: Ledger, params: Params) -> Any:
    check_commitment(ledger, params.config(0))
    return ledger.block_height


@method("getEpochInfo")
def get_epoch_info(ledger: Ledger, params: Params) -> Any:
    check_commitment(ledger, params.config(0))
    slot = ledger.slot
    return {
        "absoluteSlot": slot,
        "blockHeight": ledger.block_height,
        "epoch": 0,
        "slotIndex": slot,
        "slotsInEpoch": 432_000,
        "transactionCount": ledger.transaction_count,
    }


@method("getLatestBlockhash")
def get_latest_blockhash(ledger: Ledger, params: Params) -> Any:
    check_commitment(ledger, params.config(0))
    blockhash, last_valid = ledger.latest_blockhash()
    return with_context(ledger, {"blockhash": blockhash, "lastValidBlockHeight": last_valid})


@method("isBlockhashValid")
def is_blockhash_valid(ledger: Ledger, params: Params) -> Any:
    blockhash = params.required(0, "a blockhash")
    if not isinstance(blockhash, str):
        raise invalid_params("Invalid param: Invalid")
    check_commitment(ledger, params.config(1))
    return with_context(ledger, ledger.last_valid_block_height(blockhash) is not None)


@method("getBalance")
def get_balance(ledger: Ledger, params: Params) -> Any:
    address = params.pubkey(0)
    check_commitment(ledger, params.config(1))
    account = ledger.account(address)
    return with_context(ledger, account.lamports if account else 0)


@method("getAccountInfo")
def get_account_info(ledger: Ledger, params: Params) -> Any:
    address = params.pubkey(0)
    config = params.config(1)
    check_commitment(ledger, config)
    return with_context(ledger, encode_account(ledger, ledger.account(address), config, "binary"))


@method("getMultipleAccounts")
def get_multiple_accounts(ledger: Ledger, params: Params) -> Any:
    addresses = params.required(0, "an array of addresses")
    if not isinstance(addresses, list):
        raise invalid_params("Invalid params: expected an array of addresses")
    if len(addresses) > MAX_MULTIPLE_ACCOUNTS:
        raise invalid_params(f"Too many inputs provided; max {MAX_MULTIPLE_ACCOUNTS}")
    keys = [parse_pubkey(a) for a in addresses]
    config = params.config(1)
    check_commitment(ledger, config)
    return with_context(ledger, [encode_account(ledger, ledger.account(k), config, "base64") for k in keys])


@method("getMinimumBalanceForRentExemption")
def get_minimum_balance_for_rent_exemption(ledger: Ledger, params: Params) -> Any:
    size = params.required(0, "a data length")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= 10 * 1024 * 1024:
        raise invalid_params("Invalid params: the data length must be an integer between 0 and 10 MiB")
    return ledger.minimum_balance_for_rent_exemption(size)


@method("getTokenAccountBalance")
def get_token_account_balance(ledger: Ledger, params: Params) -> Any:
    address = params.pubkey(0)
    check_commitment(ledger, params.config(1))
    account = ledger.account(address)
    if account is None:
        raise invalid_params("Invalid param: could not find account")
    parsed = parse_token_account(account.owner, bytes(account.data))
    decimals = ledger.mint_decimals(parsed.mint) if parsed else None
    if parsed is None or decimals is None:
        raise invalid_params("Invalid param: not a Token account")
    return with_context(ledger, ui_token_amount(parsed.amount, decimals))


@method("getTokenAccountsByOwner")
def get_token_accounts_by_owner(ledger: Ledger, params: Params) -> Any:
    owner = params.pubkey(0)
    token_filter = params.required(1, "a filter: {mint} or {programId}")
    config = params.config(2)
    check_commitment(ledger, config)
    if not isinstance(token_filter, dict) or len(token_filter) != 1:
        raise invalid_params("Invalid params: the filter must be {mint} or {programId}")
    mint: Pubkey | None = None
    if "mint" in token_filter:
        mint = parse_pubkey(token_filter["mint"])
        mint_account = ledger.account(mint)
        if mint_account is None or mint_account.owner not in TOKEN_PROGRAMS:
            raise invalid_params("Invalid param: could not find mint")
        program = mint_account.owner
    elif "programId" in token_filter:
        program = parse_pubkey(token_filter["programId"])
        if program not in TOKEN_PROGRAMS:
            raise invalid_params("Invalid param: unrecognized Token program id")
    else:
        raise invalid_params("Invalid params: the filter must be {mint} or {programId}")
    found = []
    for address, account in ledger.program_accounts(program):
        parsed = parse_token_account(account.owner, bytes(account.data))
        if parsed is not None and parsed.owner == owner and (mint is None or parsed.mint == mint):
            found.append({"pubkey": str(address), "account": encode_account(ledger, account, config, "binary")})
    return with_context(ledger, found)


@method("getFeeForMessage")
def get_fee_for_message(ledger: Ledger, params: Params) -> Any:
    encoded = params.required(0, "a base-64 encoded message")
    check_commitment(ledger, params.config(1))
    try:
        message = from_bytes_versioned(base64.b64decode(encoded, validate=True))
        if not isinstance(message, Message):  # a legacy message has no sanitize(); real RPCs price it too
            message.sanitize()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise invalid_params("Invalid params: the message must be a base-64 encoded, well-formed message") from None
    if ledger.last_valid_block_height(str(message.recent_blockhash)) is None:
        return with_context(ledger, None)
    return with_context(ledger, message_fee(message))


def message_fee(message: Any) -> int:
    """5,000 lamports a signature plus the compute-unit price times the compute-unit limit."""
    keys = message.account_keys
    limit: int | None = None
    price = 0
    other_instructions = 0
    for ix in message.instructions:
        data = bytes(ix.data)
        if keys[ix.program_id_index] == COMPUTE_BUDGET_PROGRAM and data:
            if data[0] == 2 and len(data) >= 5:
                limit = int.from_bytes(data[1:5], "little")
            elif data[0] == 3 and len(data) >= 9:
                price = int.from_bytes(data[1:9], "little")
        else:
            other_instructions += 1
    if limit is None:
        limit = DEFAULT_COMPUTE_UNITS_PER_INSTRUCTION * other_instructions
    limit = min(limit, MAX_COMPUTE_UNITS)
    priority = (price * limit + 999_999) // 1_000_000
    return LAMPORTS_PER_SIGNATURE * int(message.header.num_required_signatures) + priority


@method("getRecentPrioritizationFees")
def get_recent_prioritization_fees(ledger: Ledger, params: Params) -> Any:
    addresses = params.get(0, [])
    if not isinstance(addresses, list) or len(addresses) > 128:
        raise invalid_params("Invalid params: expected an array of at most 128 addresses")
    for address in addresses:
        parse_pubkey(address)
    newest = ledger.slot
    return [{"slot": slot, "prioritizationFee": 0} for slot in range(max(1, newest - 149), newest + 1)]


@method("requestAirdrop")
def request_airdrop(ledger: Ledger, params: Params) -> Any:
    to = params.pubkey(0)
    lamports = params.required(1, "an amount of lamports")
    if not isinstance(lamports, int) or isinstance(lamports, bool) or not 0 < lamports < 2**64:
        raise invalid_params("Invalid params: lamports must be a positive u64")
    try:
        return ledger.airdrop(to, lamports)
    except (TransactionRejected, SignatureVerificationFailed):
        raise RpcError(INTERNAL_ERROR, "airdrop request failed: the faucet cannot pay it") from None


@method("sendTransaction")
def send_transaction(ledger: Ledger, params: Params) -> Any:
    config = params.config(1)
    tx = decode_transaction(params.required(0, "an encoded transaction"), transaction_encoding(config, "base58"))
    check_commitment(ledger, config)
    try:
        return ledger.send(tx, preflight=not flag(config, "skipPreflight"))
    except SignatureVerificationFailed:
        raise RpcError(SIGNATURE_VERIFICATION_FAILURE, "Transaction signature verification failure") from None
    except TransactionRejected as exc:
        data = simulation_value(ledger, tx, Execution(exc.err, exc.logs, exc.units, 0, [], None), None, {}, False)
        raise RpcError(PREFLIGHT_FAILURE, f"Transaction simulation failed: {describe_error(exc.err)}", data) from None


@method("simulateTransaction")
def simulate_transaction(ledger: Ledger, params: Params) -> Any:
    config = params.config(1)
    tx = decode_transaction(params.required(0, "an encoded transaction"), transaction_encoding(config, "base58"))
    check_commitment(ledger, config)
    sig_verify = flag(config, "sigVerify")
    replace = flag(config, "replaceRecentBlockhash")
    if sig_verify and replace:
        raise invalid_params("sigVerify may not be used with replaceRecentBlockhash")
    accounts = config.get("accounts")
    if accounts is not None and not (isinstance(accounts, dict) and isinstance(accounts.get("addresses"), list)):
        raise invalid_params("Invalid params: accounts must be {addresses: [...], encoding}")
    if accounts is not None and accounts.get("encoding", "base64") not in ("base64", "jsonParsed"):
        raise invalid_params("Invalid params: the accounts encoding must be base64 or jsonParsed")
    try:
        execution, replacement = ledger.simulate(tx, sig_verify=sig_verify, replace_blockhash=replace)
    except SignatureVerificationFailed:
        raise RpcError(SIGNATURE_VERIFICATION_FAILURE, "Transaction signature verification failure") from None
    inner = flag(config, "innerInstructions")
    return with_context(ledger, simulation_value(ledger, tx, execution, replacement, accounts or {}, inner))


def simulation_value(
    ledger: Ledger,
    tx: VersionedTransaction,
    execution: Execution,
    replacement: tuple[str, int] | None,
    accounts: dict[str, Any],
    inner: bool,
) -> dict[str, Any]:
    returned = None
    if "addresses" in accounts:
        keys = [parse_pubkey(a) for a in accounts["addresses"]]
        returned = [
            encode_account(ledger, execution.post_accounts.get(k) or ledger.account(k), accounts, "base64")
            for k in keys
        ]
    value: dict[str, Any] = {
        "err": execution.err,
        "logs": execution.logs,
        "accounts": returned,
        "unitsConsumed": execution.units_consumed,
        "returnData": execution.return_data,
        "innerInstructions": execution.inner_instructions if inner else None,
        "replacementBlockhash": (
            {"blockhash": replacement[0], "lastValidBlockHeight": replacement[1]} if replacement else None
        ),
        "fee": execution.fee if execution.err is None else None,
    }
    if execution.err is None:
        keys = list(tx.message.account_keys)
        value["preBalances"] = [(account.lamports if (account := ledger.account(k)) else 0) for k in keys]
        value["postBalances"] = [
            (execution.post_accounts[k].lamports if k in execution.post_accounts else value["preBalances"][i])
            for i, k in enumerate(keys)
        ]
    return value


@method("getSignatureStatuses")
def get_signature_statuses(ledger: Ledger, params: Params) -> Any:
    signatures = params.required(0, "an array of signatures")
    if not isinstance(signatures, list):
        raise invalid_params("Invalid params: expected an array of signatures")
    if len(signatures) > MAX_SIGNATURE_STATUSES:
        raise invalid_params(f"Too many inputs provided; max {MAX_SIGNATURE_STATUSES}")
    wanted = [str(parse_signature(s)) for s in signatures]
    search = flag(params.config(1), "searchTransactionHistory")
    return with_context(ledger, [status_json(r) for r in ledger.statuses(wanted, search_history=search)])


@method("getTransaction")
def get_transaction(ledger: Ledger, params: Params) -> Any:
    signature = str(parse_signature(params.required(0, "a signature")))
    config = params.get(1, {})
    if isinstance(config, str):  # the deprecated form: the encoding alone
        config = {"encoding": config}
    if not isinstance(config, dict):
        raise invalid_params("Invalid params: the configuration must be an object")
    check_commitment(ledger, config)
    if config.get("commitment") == "processed":
        raise invalid_params("Method does not support commitment below `confirmed`")
    encoding = config.get("encoding") or "json"
    if encoding not in ("json", "base64", "base58"):
        raise invalid_params(f"Invalid params: unsupported encoding {encoding!r} here (json, base64, base58)")
    max_version = config.get("maxSupportedTransactionVersion")
    if max_version is not None and (not isinstance(max_version, int) or isinstance(max_version, bool)):
        raise invalid_params("Invalid params: maxSupportedTransactionVersion must be an integer")
    record = ledger.record(signature)
    if record is None:
        return None
    version = record.transaction.version()
    numeric_version = version if isinstance(version, int) else None
    if numeric_version is not None and (max_version is None or numeric_version > max_version):
        raise RpcError(
            UNSUPPORTED_TRANSACTION_VERSION,
            f"Transaction version ({numeric_version}) is not supported by the requesting client. Please try the "
            f'request again with the following configuration parameter: "maxSupportedTransactionVersion": '
            f"{numeric_version}",
        )
    result = {
        "slot": record.slot,
        "blockTime": record.block_time,
        "meta": transaction_meta(record),
        "transaction": encode_transaction(record.transaction, encoding),
    }
    if max_version is not None:
        result["version"] = "legacy" if numeric_version is None else numeric_version
    return result


@method("devnet_expireBlockhashes")
def devnet_expire_blockhashes(ledger: Ledger, params: Params) -> Any:
    """Non-standard (tests only): every blockhash handed out so far becomes stale."""
    blockhash, last_valid = ledger.expire_blockhashes()
    return {"blockhash": blockhash, "lastValidBlockHeight": last_valid, "slot": ledger.slot}


def dispatch(ledger: Ledger) -> Callable[[str, Any], Any]:
    """``(method, params) -> result`` for the JSON-RPC server; raises RpcError."""

    def call(name: str, params: Any) -> Any:
        fn = METHODS.get(name)
        if fn is None:
            raise RpcError(METHOD_NOT_FOUND, "Method not found")
        return fn(ledger, Params(params))

    return call


def serve(ledger: Ledger, host: str, port: int) -> JsonRpcServer:
    return make_server(dispatch(ledger), host, port, name="solana-rpc")


def run_slots(ledger: Ledger, stop: threading.Event) -> None:
    """A new slot and blockhash every ``slot_seconds`` until ``stop`` is set."""
    while not stop.wait(ledger.slot_seconds):
        ledger.tick()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Local Solana JSON-RPC over LiteSVM (development and tests only).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8899)
    parser.add_argument("--setup", type=Path, help="JSON: a USDC-like mint and accounts to fund (devnet.solana_setup)")
    parser.add_argument("--slot-ms", type=int, default=400, help="milliseconds per slot (default 400)")
    args = parser.parse_args(argv)
    ledger = Ledger(slot_seconds=args.slot_ms / 1000)
    mint = None
    if args.setup is not None:
        from devnet.solana_setup import apply_setup, read_setup

        mint = apply_setup(ledger, read_setup(args.setup))
    server = serve(ledger, args.host, args.port)
    stop = threading.Event()
    threading.Thread(target=run_slots, args=(ledger, stop), name="slots", daemon=True).start()
    print(f"solana-rpc: listening on http://{args.host}:{args.port}" + (f" (USDC mint {mint})" if mint else ""))
    sys.stdout.flush()
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
