// Human messages for what can go wrong while paying; each says what happened and what to do next.
import { ApiError } from "./api";
import { UnknownChainError, WrongChainError, providerErrorCode } from "./evm";

export interface Problem {
  title: string;
  detail: string;
  /** The intent itself changed (paid, expired, cancelled): reload it instead of offering a retry. */
  reload?: boolean;
  /** A payment is settling: follow the intent until it is paid or payable again. */
  wait?: boolean;
}

const NOTHING_PAID = "No money has moved.";

/** The service's message as a sentence (they do not all end with a full stop). */
const sentence = (text: string) => (/[.!?]$/.test(text.trim()) ? text.trim() : `${text.trim()}.`);

export function isRejection(error: unknown): boolean {
  if (providerErrorCode(error) === 4001) return true;
  const text = String((error as { message?: unknown })?.message ?? error).toLowerCase();
  return /reject|denied|declined|cancel+ed by (the )?user/.test(text);
}

export function describe(error: unknown, networkName: string): Problem {
  if (isRejection(error)) {
    return { title: "You declined the request in your wallet", detail: `${NOTHING_PAID} Try again when you are ready.` };
  }
  if (providerErrorCode(error) === 4100) {
    return { title: "Your wallet did not allow this page", detail: "Connect the wallet again and approve access." };
  }
  if (error instanceof UnknownChainError) {
    return { title: `Add ${networkName} to your wallet`, detail: `Your wallet does not know ${networkName}. Add it, then try again.` };
  }
  if (error instanceof WrongChainError || providerErrorCode(error) === 4901) {
    return { title: `Switch your wallet to ${networkName}`, detail: `Your wallet is on another network. ${NOTHING_PAID}` };
  }
  if (error instanceof ApiError) return describeApi(error, networkName);
  const message = String((error as { message?: unknown })?.message ?? "").slice(0, 200);
  return {
    title: "Your wallet reported a problem",
    detail: message ? `${message} ${NOTHING_PAID}` : `${NOTHING_PAID} Try again.`,
  };
}

function describeApi(error: ApiError, networkName: string): Problem {
  switch (error.code) {
    case "ALREADY_PAID":
    case "INTENT_CANCELLED":
    case "INTENT_EXPIRED":
      return { title: "This payment changed", detail: error.message, reload: true };
    case "PAYMENT_IN_PROGRESS":
      return { title: "A payment is already being settled", detail: "Wait a moment; this page updates by itself.", reload: true, wait: true };
    case "SETTLEMENT_PENDING":
      return { title: "Still settling", detail: `${networkName} is slow to confirm. This page updates when it does.`, reload: true, wait: true };
    case "SETTLEMENT_FAILED":
      return { title: "The payment did not go through", detail: `${sentence(error.message)} ${NOTHING_PAID}` };
    case "INVALID_SIGNATURE":
      return {
        title: "Your wallet's signature was not accepted",
        detail: `It does not match the account you connected. ${NOTHING_PAID} Try again, or reconnect the wallet.`,
      };
    case "AMOUNT_MISMATCH":
    case "RECIPIENT_MISMATCH":
    case "ASSET_MISMATCH":
    case "REQUIREMENT_OUTDATED":
      return { title: "The payment details changed", detail: `${NOTHING_PAID} Reload this page and try again.` };
    case "NONCE_ALREADY_USED":
    case "AUTHORIZATION_EXPIRED":
    case "BLOCKHASH_EXPIRED":
      return { title: "That signature can no longer be used", detail: `${NOTHING_PAID} Press Pay to sign a fresh one.` };
    case "PAYEE_ACCOUNT_MISSING":
      return { title: "The payment details changed", detail: `${NOTHING_PAID} Press Pay to sign a fresh one.` };
    case "PAYEE_ACCOUNT_CLOSED":
      return {
        title: `This shop cannot be paid on ${networkName} right now`,
        detail: `Its USDC account there is closed. ${NOTHING_PAID} Choose another network, or try again later.`,
      };
    case "CHAIN_UNAVAILABLE":
    case "SETTLEMENT_UNAVAILABLE":
      return { title: `${networkName} is busy or unreachable`, detail: `${NOTHING_PAID} Try again in a moment.` };
    case "RELAY_BUDGET_EXHAUSTED":
      return {
        title: `This shop cannot take more payments on ${networkName} right now`,
        detail: `${NOTHING_PAID} Choose another network, or try again later.`,
      };
    case "TOO_MANY_OPEN_SETTLEMENTS":
      return {
        title: `This shop has many payments on ${networkName} still settling`,
        detail: `${NOTHING_PAID} Try again in ${error.retryAfter ?? 30} seconds, or choose another network.`,
      };
    case "PAYER_NEEDS_SOL":
      return { title: "Not enough SOL in your wallet", detail: `${sentence(error.message)} ${NOTHING_PAID}` };
    case "RATE_LIMITED":
      return {
        title: "Too many attempts",
        detail: `Wait ${error.retryAfter ?? 60} seconds, then try again.`,
      };
    case "NETWORK_ERROR":
      return { title: "You seem to be offline", detail: error.message };
    case "NOT_FOUND":
      return { title: "Payment not found", detail: "Check the link you were given.", reload: true };
    default:
      return { title: "The payment was refused", detail: `${sentence(error.message)} ${NOTHING_PAID}` };
  }
}
