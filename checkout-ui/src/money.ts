// USDC amounts stay integers of atomic units (6 decimals) until they are shown.

export const USDC_DECIMALS = 6;

/** "12500000" -> "12.50"; at least two decimals, trailing zeros beyond them dropped. */
export function formatUsdc(atomic: string | bigint): string {
  const value = BigInt(atomic);
  const negative = value < 0n;
  const digits = (negative ? -value : value).toString().padStart(USDC_DECIMALS + 1, "0");
  const whole = digits.slice(0, -USDC_DECIMALS).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  let fraction = digits.slice(-USDC_DECIMALS).replace(/0+$/, "");
  if (fraction.length < 2) fraction = fraction.padEnd(2, "0");
  return `${negative ? "-" : ""}${whole}.${fraction}`;
}

/** Lamports -> SOL, exact: 2039280 -> "0.00203928". */
export function formatSol(lamports: number | bigint): string {
  const digits = BigInt(lamports).toString().padStart(10, "0");
  const fraction = digits.slice(-9).replace(/0+$/, "");
  return fraction ? `${digits.slice(0, -9)}.${fraction}` : digits.slice(0, -9);
}
