"""payintent client package: sign and pay x402 requirements, call the payintent API."""
