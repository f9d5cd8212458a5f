"""The Solana RPC's wire forms: decoding transactions, encoding accounts, statuses and transactions.

Shapes and error messages follow the Agave node, so clients cannot tell this server from a real one.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from solders.account import Account
from solders.message import MessageV0
from solders.transaction import VersionedTransaction

from devnet.base58 import b58decode, b58encode
from devnet.jsonrpc_http import INVALID_REQUEST, RpcError, invalid_params
from devnet.solana_ledger import Ledger, TxRecord
from devnet.solana_token import parsed_account_data

PACKET_DATA_SIZE = 1232  # the largest serialized transaction
MAX_BASE64_TX = 1644
MAX_BASE58_TX = 1683
MAX_BASE58_ACCOUNT_BYTES = 128
RENT_EXEMPT_EPOCH = 2**64 - 1


def decode_transaction(data: Any, encoding: str) -> VersionedTransaction:
    """Decode a wire transaction as the node does, with its size limits and error messages."""
    if not isinstance(data, str):
        raise invalid_params("Invalid params: the transaction must be an encoded string")
    name = "solana_transaction::versioned::VersionedTransaction"
    limits = f"(max: encoded/raw {MAX_BASE58_TX if encoding == 'base58' else MAX_BASE64_TX}/{PACKET_DATA_SIZE})"
    if encoding == "base58":
        if len(data) > MAX_BASE58_TX:
            raise invalid_params(f"base58 encoded {name} too large: {len(data)} bytes {limits}")
        try:
            raw = b58decode(data)
        except ValueError:
            raise invalid_params("invalid base58 encoding: InvalidCharacter") from None
    elif encoding == "base64":
        if len(data) > MAX_BASE64_TX:
            raise invalid_params(f"base64 encoded {name} too large: {len(data)} bytes {limits}")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise invalid_params("invalid base64 encoding: InvalidByte") from None
    else:
        raise invalid_params(f"Invalid params: unsupported encoding: {encoding}. Supported encodings: base58, base64")
    if len(raw) > PACKET_DATA_SIZE:
        raise invalid_params(f"decoded {name} too large: {len(raw)} bytes (max: {PACKET_DATA_SIZE} bytes)")
    try:
        tx = VersionedTransaction.from_bytes(raw)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise invalid_params(f"failed to deserialize {name}: {exc}") from None
    try:
        tx.sanitize()
        if not tx.signatures or len(tx.signatures) != tx.message.header.num_required_signatures:
            raise ValueError
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise invalid_params("invalid transaction: Transaction failed to sanitize accounts offsets correctly") from None
    return tx


def transaction_encoding(config: dict[str, Any], default: str) -> str:
    encoding = config.get("encoding") or default
    if not isinstance(encoding, str):
        raise invalid_params("Invalid params: encoding must be a string")
    return encoding


def encode_account(ledger: Ledger, account: Account | None, config: dict[str, Any], default: str) -> Any:
    if account is None:
        return None
    encoding = config.get("encoding") or default
    data = bytes(account.data)
    data_slice = config.get("dataSlice")
    if data_slice is not None and encoding != "jsonParsed":
        try:
            offset, length = int(data_slice["offset"]), int(data_slice["length"])
            if offset < 0 or length < 0:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise invalid_params("Invalid params: dataSlice needs a non-negative offset and length") from None
        data = data[offset : offset + length]
    encoded: Any
    if encoding in ("binary", "base58"):
        if len(data) > MAX_BASE58_ACCOUNT_BYTES:
            raise RpcError(
                INVALID_REQUEST,
                f"Encoded binary (base 58) data should be less than {MAX_BASE58_ACCOUNT_BYTES} bytes, "
                "please use Base64 encoding.",
            )
        encoded = b58encode(data) if encoding == "binary" else [b58encode(data), "base58"]
    elif encoding == "base64":
        encoded = [base64.b64encode(data).decode(), "base64"]
    elif encoding == "jsonParsed":
        encoded = parsed_account_data(account.owner, data, ledger.mint_decimals)
        if encoded is None:
            encoded = [base64.b64encode(data).decode(), "base64"]
    else:
        raise invalid_params(f"Invalid params: unsupported encoding {encoding!r} (base58, base64, jsonParsed)")
    return {
        "data": encoded,
        "executable": account.executable,
        "lamports": account.lamports,
        "owner": str(account.owner),
        "rentEpoch": RENT_EXEMPT_EPOCH,  # as the node reports every account since rent collection ended
        "space": len(bytes(account.data)),
    }


def status_json(record: TxRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    err = record.execution.err
    return {
        "slot": record.slot,
        "confirmations": None,
        "err": err,
        "status": {"Ok": None} if err is None else {"Err": err},
        "confirmationStatus": "finalized",
    }


def transaction_meta(record: TxRecord) -> dict[str, Any]:
    execution = record.execution
    return {
        "err": execution.err,
        "status": {"Ok": None} if execution.err is None else {"Err": execution.err},
        "fee": execution.fee,
        "preBalances": record.pre_balances,
        "postBalances": record.post_balances,
        "innerInstructions": execution.inner_instructions,
        "logMessages": execution.logs,
        "preTokenBalances": [b.to_json() for b in record.pre_token_balances],
        "postTokenBalances": [b.to_json() for b in record.post_token_balances],
        "rewards": [],
        "loadedAddresses": {
            "writable": [str(k) for k in record.loaded_writable],
            "readonly": [str(k) for k in record.loaded_readonly],
        },
        "computeUnitsConsumed": execution.units_consumed,
        **({"returnData": execution.return_data} if execution.return_data else {}),
    }


def encode_transaction(tx: VersionedTransaction, encoding: str) -> Any:
    if encoding == "base64":
        return [base64.b64encode(bytes(tx)).decode(), "base64"]
    if encoding == "base58":
        return [b58encode(bytes(tx)), "base58"]
    message = tx.message
    header = message.header
    body: dict[str, Any] = {
        "accountKeys": [str(k) for k in message.account_keys],
        "header": {
            "numReadonlySignedAccounts": header.num_readonly_signed_accounts,
            "numReadonlyUnsignedAccounts": header.num_readonly_unsigned_accounts,
            "numRequiredSignatures": header.num_required_signatures,
        },
        "instructions": [
            {
                "accounts": list(bytes(ix.accounts)),
                "data": b58encode(bytes(ix.data)),
                "programIdIndex": ix.program_id_index,
                "stackHeight": None,
            }
            for ix in message.instructions
        ],
        "recentBlockhash": str(message.recent_blockhash),
    }
    if isinstance(message, MessageV0):
        body["addressTableLookups"] = [
            {
                "accountKey": str(lookup.account_key),
                "writableIndexes": list(bytes(lookup.writable_indexes)),
                "readonlyIndexes": list(bytes(lookup.readonly_indexes)),
            }
            for lookup in message.address_table_lookups
        ]
    return {"message": body, "signatures": [str(s) for s in tx.signatures]}
