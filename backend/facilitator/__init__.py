"""The x402 facilitator API (``/api/v1/x402/facilitator``): supported, verify, settle."""
