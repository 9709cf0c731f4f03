"""Where a NaN starts: :class:`ActivationWatch` hooks the model's modules, records their activations' (and, in the
backward, their gradients') sum of squares, max |x| and NaN/Inf counts with the library's op on the device, and its
:meth:`~ActivationWatch.report` names the module that produced the first non-finite value (docs/activations.md).

``_watch.py`` holds the hooks and the step's bookkeeping, ``_modules.py`` the model tree it watches, ``_reads.py`` the
device buffers, ``_report.py`` the host-side report and the origin rule.
"""

from torch_gradstats.monitors.activations._modules import ModuleSelection
from torch_gradstats.monitors.activations._report import ActivationReport, ModuleFigures
from torch_gradstats.monitors.activations._watch import ActivationWatch

__all__ = ["ActivationReport", "ActivationWatch", "ModuleFigures", "ModuleSelection"]
