"""MLflow sink: log gradient reports to an MLflow run, one batched call per logged step.

Example (any tracking URI: a server, a database, or a local directory)::

    import mlflow
    from torch_gradstats.integrations import MLflowSink

    with mlflow.start_run():
        sink = MLflowSink()
        ...
        sink.log(tg.grad_stats(model.named_parameters()).report(), step)
        sink.close()

Each :meth:`MLflowSink.log` is one ``MlflowClient().log_batch(run_id, metrics, tags)`` call with the figures of
:func:`torch_gradstats.integrations.metrics` (``grad/total_norm``, ``grad/health``, ..., ``grad/norm/<parameter>``)
as metrics at ``step=step``, all with the same timestamp (MLflow's client splits a batch of more than 1000 metrics
into several requests itself). The first parameter whose gradient went non-finite is a name, not a number: it goes to
the run's tags ``grad/first_nonfinite`` and ``grad/first_nonfinite_step``, once.

Which run (the ownership rule): ``run_id`` when given; else the run active when ``log`` is called
(``mlflow.active_run()``); else, with no run active, the sink starts one (``mlflow.start_run()``, as
``mlflow.log_metrics`` would) and owns it. :meth:`MLflowSink.close` waits for any asynchronous batch still pending and
ends only a run the sink started; a run given by ``run_id`` or started by you stays open. Used as a context manager,
the sink ends its own run ``FAILED`` when the block raised (as ``with mlflow.start_run():`` does), else
``FINISHED``.

Non-finite values: NaN and +-Inf are logged as they are; MLflow accepts them. The local file store reads them back
exactly; a database store (``sqlite:///...``, a server backed by one) reads NaN back as NaN and +-Inf as
+-1.7976931348623157e308 (MLflow's rule: SQL has no infinity). ``grad/nan_count``, ``grad/inf_count`` and
``grad/first_nonfinite_index`` say which it was either way.

Keys: MLflow takes letters, digits, ``_ - . /``, spaces and (except on Windows) ``:``, up to 250 characters, and no
key that reads as a different file path (an empty, ``.`` or ``..`` part between slashes, a leading ``/`` or ``..``).
Our keys (``grad/norm/<name>``, ``group/<g>/norm``, Lightning's ``grad_2.0_norm/<name>``, names with dots) are kept
as they are; only what MLflow rejects is changed, by :func:`mlflow_key`: another character (``:`` included, so a
key is the same on every platform) becomes ``_``, an empty / ``.`` / ``..`` part becomes ``_`` / ``_`` / ``__``
(and a leading ``..`` becomes ``_.``), and a key over 250 characters keeps its first 124 and last 124 joined by
``--``. Should two keys of a sink end up the same, the later one gets ``_2``, ``_3``...; within one report, a key
MLflow takes as it is comes first (it keeps its name beside a changed key that precedes it). Each changed key is
named once in a warning on the ``torch_gradstats`` logger.

``mlflow`` (``pip install mlflow-skinny``, or ``torch_gradstats[integrations]``) is imported at the first ``log``,
not when this module is imported.
"""

from __future__ import annotations

import logging
import numbers
import re
import time
from typing import Any

from torch_gradstats.integrations._logging_rank import writes_here
from torch_gradstats.integrations.sinks import AnyReport, check_style, grad_report, metrics

__all__ = ["MLflowSink", "mlflow_key"]

logger = logging.getLogger("torch_gradstats")

MAX_KEY_LENGTH = 250  # MLflow's limit on a metric or tag key
_REJECTED = re.compile(r"[^\w\-. /]")  # MLflow's accepted characters, less ":" (refused on Windows)


def mlflow_key(key: str) -> str:
    """``key`` as MLflow accepts it: unchanged when MLflow takes it, else changed as the module docstring says."""
    if not isinstance(key, str):
        raise TypeError(f"mlflow_key: key must be a str, got a {type(key).__name__}")
    out = _REJECTED.sub("_", key)
    out = "/".join("_" * max(len(part), 1) if part in ("", ".", "..") else part for part in out.split("/"))
    if out.startswith(".."):
        out = "_" + out[1:]
    if len(out) > MAX_KEY_LENGTH:
        half = (MAX_KEY_LENGTH - 2) // 2
        out = out[:half] + "--" + out[-half:]
    return out


class MLflowSink:
    """Log reports to an MLflow run (see the module docstring for the run, the keys and NaN/Inf).

    Args:
        run_id: the run to log to; None: the active run at each ``log``, or one the sink starts (and ends at
            :meth:`close`) when none is active.
        prefix: key prefix (default ``"grad/"``).
        per_param: log one value per parameter and figure.
        key_style: the keys of ``GradReport.to_dict(style=...)`` (default: ours).
        synchronous: passed to ``log_batch``: True waits for each batch, False returns at once (the next ``log``,
            :meth:`flush` and :meth:`close` wait for it), None follows MLflow's ``MLFLOW_ENABLE_ASYNC_LOGGING``.
        stage_group, group, log_rank: which process writes, as for every sink (docs/integrations.md, "One rank
            writes"): none given, this one; else only the logging rank logs, and on the others ``log`` does
            nothing, needs no run and never imports mlflow.
    """

    def __init__(self, run_id: str | None = None, prefix: str = "grad/", per_param: bool = True,
                 key_style: str = "default", synchronous: bool | None = None, *, stage_group: Any = None,
                 group: Any = None, log_rank: int | None = None) -> None:
        if run_id is not None and not isinstance(run_id, str):
            raise TypeError(f"MLflowSink: run_id must be a str or None, got a {type(run_id).__name__}")
        if run_id is not None and not run_id:
            raise ValueError("MLflowSink: run_id must be a run's id or None, got ''")
        if not isinstance(prefix, str):
            raise TypeError(f"MLflowSink: prefix must be a str, got a {type(prefix).__name__}")
        if not isinstance(per_param, bool):
            raise TypeError(f"MLflowSink: per_param must be a bool, got a {type(per_param).__name__}")
        check_style("MLflowSink", "key_style", key_style)
        if synchronous is not None and not isinstance(synchronous, bool):
            raise TypeError(f"MLflowSink: synchronous must be a bool or None, got a {type(synchronous).__name__}")
        self.run_id = run_id
        self.prefix = prefix
        self.per_param = per_param
        self.key_style = key_style
        self.synchronous = synchronous
        self.own_run_id: str | None = None  #: the run this sink started (no run_id, none active), ended by close()
        self._client: Any = None
        self._keys: dict[str, str] = {}  # our key -> the key logged
        self._taken: set[str] = set()  # keys logged
        self._pending: list[Any] = []  # asynchronous batches not yet waited for
        self._first_recorded = False
        self._closed = False
        #: whether this process writes (False on the ranks other than the logging rank)
        self.writes = writes_here("MLflowSink", stage_group, group, log_rank)

    def key(self, key: str) -> str:
        """The MLflow key this sink logs ``key`` under (:func:`mlflow_key`, made unique within the sink)."""
        if key in self._keys:
            return self._keys[key]
        out = base = mlflow_key(key)
        n = 1
        while out in self._taken:
            n += 1
            suffix = f"_{n}"
            out = base[:MAX_KEY_LENGTH - len(suffix)] + suffix
        if out != key:
            logger.warning("torch_gradstats: MLflowSink logs %r as %r (a key MLflow accepts)", key, out)
        self._keys[key] = out
        self._taken.add(out)
        return out

    def _run(self) -> str:
        if self.run_id is not None:
            return self.run_id
        import mlflow

        active = mlflow.active_run()
        if active is not None:
            return str(active.info.run_id)
        run = mlflow.start_run()
        self.own_run_id = str(run.info.run_id)
        logger.info("torch_gradstats: MLflowSink started MLflow run %s (no run was active)", self.own_run_id)
        return self.own_run_id

    def log(self, report: AnyReport, step: int) -> None:
        """One ``log_batch`` call: the report's figures at ``step`` (and the first non-finite parameter's tags)."""
        if self._closed:
            raise ValueError("MLflowSink: the sink is closed")
        # MLflow stores steps as 64-bit integers: a float step would be refused or truncated there.
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"MLflowSink.log: step must be an int, got {step!r} ({type(step).__name__})")
        if not self.writes:
            return
        if not hasattr(report, "to_dict"):
            raise TypeError(f"MLflowSink.log: report must be a GradReport or an UpdateReport, got a "
                            f"{type(report).__name__}")
        from mlflow.entities import Metric, RunTag
        from mlflow.tracking import MlflowClient

        values = metrics(report, self.prefix, self.per_param, self.key_style)
        run_id = self._run()
        if self._client is None:
            self._client = MlflowClient()
        stamp = int(time.time() * 1000)
        for k in values:  # the keys MLflow takes as they are keep them, whichever comes first
            if k not in self._keys and mlflow_key(k) == k and k not in self._taken:
                self.key(k)
        batch = [Metric(self.key(k), v, stamp, int(step)) for k, v in values.items()]
        tags = []
        g = grad_report(report)
        if g.first_nonfinite is not None and not self._first_recorded:
            self._first_recorded = True
            tags = [RunTag(self.key(self.prefix + "first_nonfinite"), g.first_nonfinite),
                    RunTag(self.key(self.prefix + "first_nonfinite_step"), str(int(step)))]
        # At most one batch of this sink in flight: the previous one (a training step old, so normally written) is
        # waited for first. MLflow's asynchronous writers may run two batches at once, and its file store then races
        # to make the same metric directories ("[Errno 17] File exists").
        self.flush()
        op = self._client.log_batch(run_id, metrics=batch, tags=tags, synchronous=self.synchronous)
        if op is not None:  # asynchronous: waited for by the next log, flush() or close()
            self._pending.append(op)

    def flush(self) -> None:
        """Wait until every batch logged asynchronously is written."""
        pending, self._pending = self._pending, []
        for op in pending:
            op.wait()

    def close(self) -> None:
        """Flush, and end the run only if this sink started it (a second call does nothing)."""
        self._close("FINISHED")

    def _close(self, status: str) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        if self.own_run_id is not None:
            import mlflow

            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.own_run_id:
                mlflow.end_run(status)
            else:  # no longer the active run: end it by id, leaving the active one alone
                from mlflow.tracking import MlflowClient

                (self._client or MlflowClient()).set_terminated(self.own_run_id, status)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # As mlflow.start_run() as a context manager: a run this sink started ends FAILED when the block raised.
        self._close("FINISHED" if exc_type is None else "FAILED")
