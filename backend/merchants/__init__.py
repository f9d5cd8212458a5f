"""Merchants, their API keys and their payout wallets."""
