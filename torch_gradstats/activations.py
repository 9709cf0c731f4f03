"""``torch_gradstats.activations``, the documented path of :mod:`torch_gradstats.monitors.activations`
(``ActivationWatch``).
"""

from torch_gradstats.monitors.activations import (
    ActivationReport,
    ActivationWatch,
    ModuleFigures,
    ModuleSelection,
)

__all__ = [
    "ActivationReport",
    "ActivationWatch",
    "ModuleFigures",
    "ModuleSelection",
]
