"""payintent: a self-hostable stablecoin payment-intent service (API, worker, relayer)."""
