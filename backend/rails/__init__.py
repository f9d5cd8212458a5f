"""One rail per chain kind (EVM, Solana): ``rail_for(network)``; see ``backend.rails.base``."""
