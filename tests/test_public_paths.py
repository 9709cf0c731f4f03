"""Every module path and name that README.md and docs/ import from keeps working, whatever folder the code lives in:
the import lines are read from the documents themselves, so a path a page starts to use is checked too."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import torch_gradstats

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FROM_IMPORT = re.compile(r"^\s*from (torch_gradstats[\w.]*) import \(?([\w, ]+)\)?\s*$", re.MULTILINE)
PLAIN_IMPORT = re.compile(r"^\s*import (torch_gradstats[\w.]*)(?: as \w+)?\s*$", re.MULTILINE)


def _documented() -> set[tuple[str, str | None]]:
    found: set[tuple[str, str | None]] = set()
    for doc in DOCUMENTS:
        text = doc.read_text()
        for module, names in FROM_IMPORT.findall(text):
            for name in names.split(","):
                name = name.strip().split(" as ")[0].strip()
                if name:
                    found.add((module, name))
        for module in PLAIN_IMPORT.findall(text):
            found.add((module, None))
    return found


def _import(path: str):
    """Import ``path``; skip where it needs an optional framework that is not installed (the wheel check installs
    none of the integrations' frameworks)."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name and not exc.name.startswith("torch_gradstats"):
            pytest.skip(f"{path} needs {exc.name}, which is not installed")
        raise


DOCUMENTED = sorted(_documented(), key=lambda pair: (pair[0], pair[1] or ""))


def test_the_documents_import_from_several_paths():
    """The reader of the documents is not vacuous: it finds the paths the pages are known to use."""
    modules = {module for module, _ in DOCUMENTED}
    assert {"torch_gradstats", "torch_gradstats.collector", "torch_gradstats.updates"} <= modules
    assert ("torch_gradstats.compat", "megatron") in DOCUMENTED
    assert ("torch_gradstats", "demo") in DOCUMENTED


@pytest.mark.parametrize(("module", "name"), DOCUMENTED, ids=lambda v: str(v))
def test_documented_import_works(module: str, name: str | None):
    mod = _import(module)
    if name is not None:
        # `from package import module` imports the submodule when it is not an attribute yet
        if not hasattr(mod, name):
            _import(f"{module}.{name}")
        assert hasattr(mod, name), f"from {module} import {name} fails"


@pytest.mark.parametrize("path", ["torch_gradstats.activations", "torch_gradstats.collector", "torch_gradstats.updates",
                                  "torch_gradstats.demo", "torch_gradstats.distributed", "torch_gradstats.training",
                                  "torch_gradstats.compat.torchtitan", "torch_gradstats.compat.megatron",
                                  "torch_gradstats.compat.deepspeed", "torch_gradstats.integrations.lightning"])
def test_kept_module_paths_export_what_their_modules_define(path: str):
    """A kept path exports every public name of the module it stands for, as the same objects."""
    mod = _import(path)
    assert getattr(mod, "__all__", None), f"{path} has no __all__"
    for name in mod.__all__:
        assert getattr(mod, name) is not None


def test_every_public_name_resolves():
    for name in torch_gradstats.__all__:
        assert getattr(torch_gradstats, name) is not None, name
    assert torch_gradstats.collector.SeedGradientCollector is importlib.import_module(
        "torch_gradstats.compat.collector"
    ).SeedGradientCollector
    assert importlib.import_module("torch_gradstats.activations").ActivationWatch is torch_gradstats.ActivationWatch
