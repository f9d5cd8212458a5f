"""The EVM rail (EIP-3009 USDC): ``terms`` (offline checks) and ``rail`` (the Rail)."""
