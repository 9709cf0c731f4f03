"""Graceful load of the compiled library.

Importing ``torch_gradstats._C`` runs the C++ static initialisers that register the fused CPU (and, in a CUDA build,
CUDA) kernels of ``torch_gradstats::multi_tensor_stats`` with the dispatcher. If it is missing or fails to load, the
package still works: the pure-PyTorch kernel in :mod:`torch_gradstats.ops.op` serves every device.

Set ``TORCH_GRADSTATS_FORCE_FALLBACK=1`` to skip the compiled library even where it is built.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

import torch  # noqa: F401  (loads torch's shared libraries, which the compiled library links against)

logger = logging.getLogger("torch_gradstats")

FORCE_FALLBACK_ENV = "TORCH_GRADSTATS_FORCE_FALLBACK"


def _fallback_forced() -> bool:
    return os.environ.get(FORCE_FALLBACK_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _load() -> tuple[bool, str | None]:
    """Import the compiled library; return (loaded, reason it is not)."""
    if _fallback_forced():
        return False, f"{FORCE_FALLBACK_ENV} is set"
    try:
        importlib.import_module("torch_gradstats._C")  # the import registers the kernels
    except ImportError as exc:
        logger.warning(
            "torch_gradstats: compiled extension not available (%s); using the pure-PyTorch kernel. "
            "Build it with `pip install --no-build-isolation -e .`.",
            exc,
        )
        return False, str(exc)
    return True, None


HAS_EXTENSION, EXTENSION_ERROR = _load()


def native_function(name: str) -> Any:
    """A function of the compiled module ``torch_gradstats._C`` (csrc/python_module.cpp), or None when the module is
    not loaded or has no such function (an older build)."""
    if not HAS_EXTENSION:
        return None
    return getattr(importlib.import_module("torch_gradstats._C"), name, None)
