"""The Solana payment transaction rules, checked on real solders transactions (no RPC needed)."""

from __future__ import annotations

import struct
import uuid

import pytest
from solders.compute_budget import set_compute_unit_limit, set_compute_unit_price
from solders.hash import Hash
from solders.instruction import AccountMeta, CompiledInstruction, Instruction
from solders.keypair import Keypair
from solders.message import MessageHeader, MessageV0
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.system_program import TransferParams, transfer
from solders.transaction import VersionedTransaction

from payintent import solana_tx as stx

RELAY = Keypair()
BUYER = Keypair()
MERCHANT = Keypair().pubkey()
MINT = Keypair().pubkey()
INTENT = str(uuid.uuid4())
REQUIREMENT = {"asset": str(MINT), "payTo": str(MERCHANT), "maxAmountRequired": "2500000"}
BLOCKHASH = str(Hash.new_unique())
SYSTEM_TRANSFER = transfer(TransferParams(from_pubkey=BUYER.pubkey(), to_pubkey=MERCHANT, lamports=1))


def unsigned(**overrides) -> VersionedTransaction:
    args = {
        "fee_payer": str(RELAY.pubkey()),
        "payer": str(BUYER.pubkey()),
        "mint": str(MINT),
        "pay_to": str(MERCHANT),
        "amount_atomic": 2_500_000,
        "intent_id": INTENT,
        "recent_blockhash": BLOCKHASH,
    }
    args.update(overrides)
    return stx.build_payment(**args)


def compile_signed(instructions, fee_payer=None) -> VersionedTransaction:
    message = MessageV0.try_compile(fee_payer or RELAY.pubkey(), instructions, [], Hash.from_string(BLOCKHASH))
    tx = VersionedTransaction.populate(message, [Signature.default()] * message.header.num_required_signatures)
    if BUYER.pubkey() in list(message.account_keys)[: message.header.num_required_signatures]:
        tx = stx.sign_as(tx, BUYER)
    return tx


def standard_instructions(amount=2_500_000, destination_owner=MERCHANT, mint=MINT, authority=None):
    authority = authority or BUYER.pubkey()
    return [
        set_compute_unit_limit(stx.COMPUTE_UNIT_LIMIT),
        set_compute_unit_price(stx.COMPUTE_UNIT_PRICE),
        stx.transfer_checked(
            stx.associated_token_address(BUYER.pubkey(), mint),
            mint,
            stx.associated_token_address(destination_owner, mint),
            authority,
            amount,
        ),
        stx.memo(INTENT),
    ]


def check(tx):
    return stx.check_payment(stx.decode(stx.encode(tx)), REQUIREMENT, INTENT, str(RELAY.pubkey()))


def test_a_buyer_signed_payment_passes_and_the_relay_can_cosign():
    tx = stx.sign_as(unsigned(), BUYER)
    payment = check(tx)
    assert payment.payer == str(BUYER.pubkey())
    assert payment.amount_atomic == 2_500_000
    assert payment.buyer_signature == str(tx.signatures[1])
    full = stx.sign_as(tx, RELAY)
    assert all(result for result in full.verify_with_results())  # both signatures valid over the same message


def test_the_unsigned_transaction_has_empty_signature_slots_and_the_relay_first():
    tx = unsigned()
    assert list(tx.signatures) == [Signature.default(), Signature.default()]
    assert tx.message.account_keys[0] == RELAY.pubkey() and tx.message.account_keys[1] == BUYER.pubkey()
    with pytest.raises(stx.SolanaTransactionError) as err:
        check(tx)
    assert err.value.code == "INVALID_SIGNATURE"


@pytest.mark.parametrize(
    ("tx_factory", "code"),
    [
        (lambda: compile_signed(standard_instructions(amount=2_400_000)), "AMOUNT_MISMATCH"),
        (lambda: compile_signed(standard_instructions(destination_owner=Keypair().pubkey())), "RECIPIENT_MISMATCH"),
        (lambda: compile_signed(standard_instructions(mint=Keypair().pubkey())), "ASSET_MISMATCH"),
        # Five instructions are allowed only with the account opened third: an extra memo is not that.
        (lambda: compile_signed([*standard_instructions(), stx.memo("extra")]), "DISALLOWED_INSTRUCTION"),
        (
            lambda: compile_signed(
                [
                    *standard_instructions()[:2],
                    transfer(TransferParams(from_pubkey=BUYER.pubkey(), to_pubkey=MERCHANT, lamports=1)),
                    standard_instructions()[3],
                ]
            ),
            "DISALLOWED_INSTRUCTION",
        ),
        (lambda: compile_signed(standard_instructions(authority=RELAY.pubkey())), "INVALID_TRANSACTION"),
        (
            lambda: compile_signed(
                [
                    set_compute_unit_limit(stx.COMPUTE_UNIT_LIMIT),
                    set_compute_unit_price(stx.MAX_COMPUTE_UNIT_PRICE + 1),
                    *standard_instructions()[2:],
                ]
            ),
            "COMPUTE_BUDGET_TOO_HIGH",
        ),
        (lambda: compile_signed(standard_instructions(), fee_payer=BUYER.pubkey()), "FEE_PAYER_MISMATCH"),
    ],
    ids=[
        "amount",
        "destination",
        "mint",
        "extra-instruction",
        "system-transfer",
        "relay-as-authority",
        "compute-price",
        "buyer-pays-fee",
    ],
)
def test_tampered_transactions_are_refused(tx_factory, code):
    with pytest.raises(stx.SolanaTransactionError) as err:
        check(tx_factory())
    assert err.value.code == code


def test_a_transaction_where_the_relay_moves_its_own_tokens_is_refused():
    relay_ata = stx.associated_token_address(RELAY.pubkey(), MINT)
    instructions = standard_instructions()
    instructions[2] = stx.transfer_checked(
        relay_ata, MINT, stx.associated_token_address(MERCHANT, MINT), RELAY.pubkey(), 2_500_000
    )
    message = MessageV0.try_compile(RELAY.pubkey(), instructions, [], Hash.from_string(BLOCKHASH))
    tx = VersionedTransaction.populate(message, [Signature.default()] * message.header.num_required_signatures)
    with pytest.raises(stx.SolanaTransactionError):
        check(tx)


def test_a_signature_over_another_message_is_refused():
    other = stx.sign_as(unsigned(amount_atomic=1), BUYER)
    tx = unsigned()
    forged = VersionedTransaction.populate(tx.message, [Signature.default(), other.signatures[1]])
    with pytest.raises(stx.SolanaTransactionError) as err:
        check(forged)
    assert err.value.code == "INVALID_SIGNATURE"


@pytest.mark.parametrize("text", ["", "not base64!", "AAAA", 42, "A" * 4000])
def test_garbage_is_an_invalid_payload_not_a_crash(text):
    with pytest.raises(stx.SolanaTransactionError) as err:
        stx.decode(text)
    assert err.value.code == "INVALID_PAYLOAD"


def test_memo_must_be_the_intent():
    instructions = standard_instructions()
    instructions[3] = stx.memo(str(uuid.uuid4()))
    with pytest.raises(stx.SolanaTransactionError):
        check(compile_signed(instructions))
    assert struct.calcsize("<BQB") == 10
    assert isinstance(Pubkey.default(), Pubkey)


def test_out_of_range_indices_are_invalid_not_a_crash():
    from solders.instruction import CompiledInstruction
    from solders.message import MessageHeader

    good = stx.sign_as(unsigned(), BUYER).message
    bad_ix = CompiledInstruction(99, bytes(good.instructions[3].data), bytes([]))
    message = MessageV0(MessageHeader(2, 1, 4), list(good.account_keys), good.recent_blockhash,
                        [*list(good.instructions)[:3], bad_ix], [])  # fmt: skip
    tx = VersionedTransaction.populate(message, [Signature.default(), Signature.default()])
    with pytest.raises(stx.SolanaTransactionError) as err:
        check(tx)
    assert err.value.code in {"INVALID_TRANSACTION", "INVALID_PAYLOAD"}


def test_paying_yourself_is_refused():
    requirement = {**REQUIREMENT, "payTo": str(BUYER.pubkey())}
    tx = stx.sign_as(unsigned(pay_to=str(BUYER.pubkey())), BUYER)
    with pytest.raises(stx.SolanaTransactionError) as err:
        stx.check_payment(tx, requirement, INTENT, str(RELAY.pubkey()))
    assert err.value.code == "PAYER_IS_RECIPIENT"


def test_one_message_is_one_settlement_whatever_its_signature():
    tx = stx.sign_as(unsigned(), BUYER)
    payment = check(tx)
    again = check(stx.sign_as(unsigned(), BUYER))  # the same message, signed again
    assert payment.message_hash == again.message_hash


# --- the merchant's account, opened by the buyer's own transaction ---------------------------------


def with_account_instructions(funder=None, owner=MERCHANT, data=None):
    """The five instructions of a first payment: the merchant's account is opened, the buyer paying its rent."""
    create = stx.create_token_account(funder or BUYER.pubkey(), owner, MINT)
    if data is not None:
        create = Instruction(create.program_id, data, list(create.accounts))
    _limit, price, transfer_ix, memo_ix = standard_instructions()
    return [set_compute_unit_limit(stx.COMPUTE_UNIT_LIMIT_WITH_ACCOUNT), price, create, transfer_ix, memo_ix]


def test_a_first_payment_opens_the_merchants_account_with_the_buyer_paying():
    tx = stx.sign_as(unsigned(create_payee_account=True), BUYER)
    payment = check(tx)
    assert payment.creates_payee_account and payment.unit_limit == stx.COMPUTE_UNIT_LIMIT_WITH_ACCOUNT
    create = tx.message.instructions[2]
    keys = list(tx.message.account_keys)
    assert keys[create.program_id_index] == stx.ASSOCIATED_TOKEN_PROGRAM and bytes(create.data) == b"\x01"
    assert keys[bytes(create.accounts)[0]] == BUYER.pubkey()  # the funder: the buyer, never the relay
    assert tx.message.header.num_readonly_signed_accounts == 0  # the buyer is debited the rent
    assert not check(stx.sign_as(unsigned(), BUYER)).creates_payee_account


@pytest.mark.parametrize(
    ("instructions", "code"),
    [
        (lambda: with_account_instructions(funder=RELAY.pubkey()), "FEE_PAYER_MISUSED"),
        (lambda: with_account_instructions(owner=Keypair().pubkey()), "DISALLOWED_INSTRUCTION"),
        (lambda: with_account_instructions(owner=BUYER.pubkey()), "DISALLOWED_INSTRUCTION"),
        (lambda: with_account_instructions(data=b""), "DISALLOWED_INSTRUCTION"),  # Create: fails if it exists
        (lambda: with_account_instructions(data=b"\x02"), "DISALLOWED_INSTRUCTION"),  # RecoverNested
        (
            lambda: [*with_account_instructions()[:2], SYSTEM_TRANSFER, *with_account_instructions()[3:]],
            "DISALLOWED_INSTRUCTION",
        ),
        (
            lambda: [*standard_instructions()[:2], with_account_instructions()[2], *standard_instructions()],
            "INVALID_TRANSACTION",
        ),
    ],
    ids=[
        "relay-funds-rent",
        "someone-elses-account",
        "buyers-account",
        "create",
        "recover-nested",
        "system-transfer-instead",
        "six-instructions",
    ],
)
def test_only_the_merchants_account_may_be_opened_and_only_at_the_buyers_cost(instructions, code):
    with pytest.raises(stx.SolanaTransactionError) as err:
        check(compile_signed(instructions()))
    assert err.value.code == code


def test_the_buyer_signs_writable_only_to_fund_the_account():
    instructions = standard_instructions()
    transfer_ix = instructions[2]
    accounts = list(transfer_ix.accounts)
    accounts[3] = AccountMeta(BUYER.pubkey(), is_signer=True, is_writable=True)
    instructions[2] = Instruction(transfer_ix.program_id, bytes(transfer_ix.data), accounts)
    with pytest.raises(stx.SolanaTransactionError) as err:
        check(compile_signed(instructions))
    assert err.value.code == "INVALID_TRANSACTION"


# --- the fee the relay pays -------------------------------------------------------------------------


def test_the_relay_fee_is_two_signatures_and_a_small_priority_fee():
    assert check(stx.sign_as(unsigned(), BUYER)).fee_lamports == 10_000 + 40
    assert check(stx.sign_as(unsigned(create_payee_account=True), BUYER)).fee_lamports == 10_000 + 80
    at_caps = unsigned(unit_price=stx.MAX_COMPUTE_UNIT_PRICE, unit_limit=stx.MAX_COMPUTE_UNIT_LIMIT)
    assert check(stx.sign_as(at_caps, BUYER)).fee_lamports == stx.MAX_TRANSACTION_FEE == 10_500


@pytest.mark.parametrize(
    "overrides",
    [
        {"unit_price": 100_000},  # accepted before: with a 200,000 limit the relay paid 20,000 lamports of priority
        {"unit_price": stx.MAX_COMPUTE_UNIT_PRICE + 1},
        {"unit_limit": 200_000},
        {"unit_limit": stx.MAX_COMPUTE_UNIT_LIMIT + 1},
    ],
    ids=["old-max-price", "price", "old-max-limit", "limit"],
)
def test_the_buyer_cannot_raise_the_priority_fee_the_relay_pays(overrides):
    with pytest.raises(stx.SolanaTransactionError) as err:
        check(stx.sign_as(unsigned(**overrides), BUYER))
    assert err.value.code == "COMPUTE_BUDGET_TOO_HIGH"


# --- exactly the payment's accounts ----------------------------------------------------------------------


def with_key(tx: VersionedTransaction, key: Pubkey, writable: bool) -> VersionedTransaction:
    """``tx`` re-signed by the buyer with ``key`` added to its account list (unreferenced), at the end of the
    writable or the read-only non-signers; the instructions keep naming the same accounts."""
    message = tx.message
    header = message.header
    keys = list(message.account_keys)
    at = len(keys) - header.num_readonly_unsigned_accounts if writable else len(keys)
    keys.insert(at, key)

    def moved(index: int) -> int:
        return index + 1 if index >= at else index

    instructions = [
        CompiledInstruction(moved(ix.program_id_index), bytes(ix.data), bytes(moved(i) for i in bytes(ix.accounts)))
        for ix in message.instructions
    ]
    counts = (header.num_required_signatures, header.num_readonly_signed_accounts,
              header.num_readonly_unsigned_accounts + (0 if writable else 1))  # fmt: skip
    rebuilt = MessageV0(MessageHeader(*counts), keys, message.recent_blockhash, instructions, [])
    return stx.sign_as(VersionedTransaction.populate(rebuilt, [Signature.default()] * 2), BUYER)


def with_writable_readonly_key(tx: VersionedTransaction) -> VersionedTransaction:
    """``tx`` re-signed with its first read-only non-signer (the mint or a program) made writable."""
    message = tx.message
    header = message.header
    counts = (header.num_required_signatures, header.num_readonly_signed_accounts,
              header.num_readonly_unsigned_accounts - 1)  # fmt: skip
    rebuilt = MessageV0(MessageHeader(*counts), list(message.account_keys), message.recent_blockhash,
                        list(message.instructions), [])  # fmt: skip
    return stx.sign_as(VersionedTransaction.populate(rebuilt, [Signature.default()] * 2), BUYER)


@pytest.mark.parametrize("create", [False, True], ids=["payment", "payment-opening-the-account"])
@pytest.mark.parametrize(
    "variant",
    [
        lambda tx: with_key(tx, RELAY.pubkey(), writable=True),
        lambda tx: with_key(tx, BUYER.pubkey(), writable=False),
        lambda tx: with_key(tx, MINT, writable=False),
        lambda tx: with_key(tx, Keypair().pubkey(), writable=True),
        lambda tx: with_key(tx, Keypair().pubkey(), writable=False),
        with_writable_readonly_key,
    ],
    ids=["relay-twice", "buyer-twice", "mint-twice", "extra-writable", "extra-readonly", "read-only-made-writable"],
)
def test_the_transaction_lists_exactly_the_payments_accounts(variant, create):
    """Second review, Low (defence in depth): duplicate account keys and unreferenced extra accounts were
    accepted. Harmless on chain today (AccountLoadedTwice; the relay pays only the fee), but the relay signs
    only the exact account set of the payment, each once, writable only where the payment writes."""
    tx = stx.sign_as(unsigned(create_payee_account=create), BUYER)
    check(tx)  # the original is fine
    with pytest.raises(stx.SolanaTransactionError) as err:
        check(variant(tx))
    assert err.value.code == "INVALID_TRANSACTION"
