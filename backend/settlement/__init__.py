"""Settlement: a buyer's signed authorization becomes USDC in the merchant's wallet, exactly once."""
