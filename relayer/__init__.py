"""The relayer: the only process that holds relay keys (arrives with issue 2/7)."""
