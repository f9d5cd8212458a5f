"""The local devnet for a tool's run: three Anvil chains with the test USDC (and the Solana devnet), under the
run's own var dir and on free ports, stopped with the run."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class LocalChains:
    """A devnet a run started: ``info`` is ``devnet.up``'s answer (chains_file, networks, buyers...), ``state``
    its state file (the deployer's key, Anvil's pids), ``doc`` the chains file it wrote."""

    info: dict[str, Any]
    state: dict[str, Any]
    doc: dict[str, Any]

    @property
    def chains_file(self) -> Path:
        return Path(self.info["chains_file"])

    def evm_doc(self) -> dict[str, Any]:
        """A copy of the chains file with the EVM networks only (the drills and the settlement benchmarks)."""
        doc = copy.deepcopy(self.doc)
        doc["networks"] = [n for n in doc["networks"] if n.get("kind", "evm") == "evm"]
        return doc


def start_devnet(var_dir: Path, on_stop: list[Callable[[], None]]) -> LocalChains:
    """``devnet up`` on free ports with PAYINTENT_VAR_DIR=``var_dir`` (set in this process's environment: the
    services started later inherit it); ``devnet.down`` is appended to ``on_stop`` first, so that a devnet that
    fails half-way is stopped too."""
    import devnet

    def stop() -> None:
        devnet.down()

    os.environ["PAYINTENT_VAR_DIR"] = str(var_dir)
    on_stop.append(stop)
    info, _ = devnet.up(devnet.free_port_base())
    state = json.loads((var_dir / "devnet" / "state.json").read_text())
    doc = json.loads(Path(info["chains_file"]).read_text())
    return LocalChains(info, state, doc)
