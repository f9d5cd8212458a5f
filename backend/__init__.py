"""payintent: a self-hostable stablecoin payment-intent service (API, worker, relayer)."""

# Every process of the service (api, worker, relayer, CLI) imports this package first: here py_ecc's
# recursion limit of 100,000 is undone, before eth-account or web3 is imported (see payintent.jsonlimits).
from payintent import jsonlimits as _jsonlimits  # noqa: F401
