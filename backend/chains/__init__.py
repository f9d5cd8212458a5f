"""The chain registry: which networks this deployment settles on, and their USDC."""
