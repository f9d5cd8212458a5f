"""payintent client package: sign and pay x402 requirements, call the payintent API."""

from payintent.client import NoFundedNetworkError, PayIntentClient, PayIntentError, choose_requirement
from payintent.eip3009 import sign_authorization

__all__ = ["NoFundedNetworkError", "PayIntentClient", "PayIntentError", "choose_requirement", "sign_authorization"]
