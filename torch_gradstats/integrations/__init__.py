"""Integrations with the places people train and look at training: Lightning, the Hugging Face Trainer,
TensorBoard, Weights & Biases and MLflow.

Each lives in its own module and imports its framework only when that module is imported; the core package never
imports any of them:

* :mod:`torch_gradstats.integrations.lightning`: ``GradStatsCallback`` for ``lightning`` / ``pytorch_lightning``;
* :mod:`torch_gradstats.integrations.transformers`: ``GradStatsCallback`` for ``transformers.Trainer``;
* :mod:`torch_gradstats.integrations.tensorboard`: ``TensorBoardSink`` (a ``SummaryWriter``);
* :mod:`torch_gradstats.integrations.wandb`: ``WandbSink`` (a W&B run);
* :mod:`torch_gradstats.integrations.mlflow`: ``MLflowSink`` (an MLflow run; exported here, imports ``mlflow`` at its
  first ``log``);
* :mod:`torch_gradstats.integrations.files`: ``CSVSink`` and ``JSONLSink`` (standard library only; exported here);
* :mod:`torch_gradstats.integrations.sinks`: the sink protocol and the helpers every sink uses (exported here).

The sink protocol, for plain training loops (and for a trainer's ``log_to=[...]``): anything with a
``log(report, step)`` method, where ``report`` is a :class:`~torch_gradstats.GradReport` or an
:class:`~torch_gradstats.monitors.updates.UpdateReport` (host-side numbers, already transferred) and ``step`` the global
optimizer step. A sink never touches the device, so it never adds a host sync::

    report = tg.grad_stats(model.named_parameters()).report()     # the one transfer
    for sink in sinks:
        sink.log(report, step)

:func:`metrics` turns either report into the flat ``{key: float}`` dict every sink writes.
"""

from torch_gradstats.integrations.files import CSVSink, JSONLSink
from torch_gradstats.integrations.mlflow import MLflowSink
from torch_gradstats.integrations.sinks import AnyReport, GradSink, log_to, metrics, nonfinite_index

__all__ = ["AnyReport", "CSVSink", "GradSink", "JSONLSink", "MLflowSink", "log_to", "metrics", "nonfinite_index"]
