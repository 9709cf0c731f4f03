"""MLflowSink against a real local MLflow file store, read back with MlflowClient: values (NaN/Inf included), steps,
keys (kept, or changed only where MLflow refuses them), tags, one log_batch per step, which run is logged to and
which is ended; from Trainer(log_to=...) and beside the Lightning callback (Lightning's own MLFlowLogger)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

mlflow = pytest.importorskip("mlflow")
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import _validate_metric_name

import torch_gradstats as tg
from torch_gradstats.integrations import GradSink, JSONLSink, MLflowSink, metrics
from torch_gradstats.integrations.mlflow import mlflow_key
from torch_gradstats.training import Trainer


@pytest.fixture(autouse=True)
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A local file store of this test's own, and no run left active after it."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # A URI set in code (mlflow.set_tracking_uri, as Lightning's MLFlowLogger does) outranks the environment for the
    # rest of the process: none before this test, and none left after it.
    monkeypatch.setattr("mlflow.tracking._tracking_service.utils._tracking_uri", None)
    yield uri
    while mlflow.active_run() is not None:
        mlflow.end_run()


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    m(torch.randn(5, 3)).sum().backward()
    return m


def _history(run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in MlflowClient().get_metric_history(run_id, key)]


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _accepted(key: str) -> bool:
    """MLflow's own check of a metric key (characters, file-path rule) and its length limit. Its pattern ends in
    ``$``, which also matches before a final newline, so it lets ``"a\n"`` through; mlflow_key replaces a newline
    like any other character outside the pattern, and so does this check."""
    if "\n" in key:
        return False
    try:
        _validate_metric_name(key)
    except MlflowException:
        return False
    return len(key) <= 250


OURS = ["grad/total_norm", "grad/norm/net.0.weight", "group/encoder.layer/norm", "grad_2.0_norm/net.0.weight",
        "grad_2.0_norm_total", "grad/lr_update_ratio/blocks.3.attn.q_proj.bias", "grad-norm", "num-zeros",
        "grad/group/layer 1/norm", "act/origin_index", "grad/norm/ünïcode.weight"]


def test_our_keys_are_kept_and_rejected_ones_changed_as_documented() -> None:
    for key in OURS:
        assert _accepted(key) and mlflow_key(key) == key
    cases = {
        "grad/norm/embed[0].weight": "grad/norm/embed_0_.weight",  # a character MLflow refuses
        "group//norm": "group/_/norm",  # an empty group name
        "grad/": "grad/_",
        "/x": "_/x",
        "group/./norm": "group/_/norm",
        "group/../norm": "group/__/norm",
        "..x/y": "_.x/y",
        "": "_",
    }
    for key, expected in cases.items():
        assert not _accepted(key), key  # each is one MLflow refuses
        assert mlflow_key(key) == expected and _accepted(expected)
    assert mlflow_key("group/a:b/norm") == "group/a_b/norm"  # ":" is refused on Windows: changed everywhere
    long = "grad/norm/" + "m" * 300 + ".weight"
    short = mlflow_key(long)
    assert len(short) == 250 and short.startswith("grad/norm/mmm") and short.endswith("mm.weight") and "--" in short
    with pytest.raises(TypeError, match="key must be a str"):
        mlflow_key(3)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=300)
       | st.text(st.sampled_from("ab./ :_-()"), max_size=12))
def test_every_key_becomes_one_mlflow_accepts_and_accepted_keys_stay(key: str) -> None:
    out = mlflow_key(key)
    assert _accepted(out), (key, out)
    if _accepted(key) and ":" not in key:
        assert out == key


def _reports() -> tuple[tg.GradReport, tg.GradReport, tg.GradReport]:
    m = _model()
    stats = tg.grad_stats(m.named_parameters())
    plain = stats.report(groups=stats.grouped(lambda n: "first(in)" if n.startswith("0.") else "last"))
    clipped = tg.clip_grad_norm_(m.named_parameters(), max_norm=0.1).report()
    m[2].weight.grad[0, 0] = math.nan
    m[2].bias.grad[0] = math.inf
    m[0].bias.grad[0] = -math.inf
    bad = tg.grad_stats(m.named_parameters()).report()
    return plain, clipped, bad


def test_values_steps_keys_nonfinite_and_one_batch_per_step(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []
    real = MlflowClient.log_batch

    def counted(self: Any, run_id: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(kwargs["metrics"]))
        return real(self, run_id, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", counted)
    plain, clipped, bad = _reports()
    with mlflow.start_run() as run:
        sink = MLflowSink()
        assert isinstance(sink, GradSink)
        with caplog.at_level("WARNING", logger="torch_gradstats"):
            sink.log(plain, 0)
            sink.log(bad, 5)
            sink.log(clipped, 7)
        sink.close()
        assert mlflow.active_run() is not None  # a run the sink did not start stays open
    rid = run.info.run_id
    sent = [metrics(r) for r in (plain, bad, clipped)]
    assert calls == [len(s) for s in sent]  # one call per step, every figure in it
    logged = MlflowClient().get_run(rid).data.metrics
    # Every key kept but those of the group whose name MLflow refuses; each change is named once.
    renamed = {k: k.replace("first(in)", "first_in_") for s in sent for k in s if "(" in k}
    assert "grad/group/first(in)/norm" in renamed
    assert set(logged) == {renamed.get(k, k) for s in sent for k in s} and "grad/norm/2.weight" in logged
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == len(renamed) and all(any(repr(k) in w for w in warned) for k in renamed)
    for step, s in zip((0, 5, 7), sent):
        for key, value in s.items():
            hist = dict(_history(rid, renamed.get(key, key)))
            assert _same(hist[step], value), (key, step, hist[step], value)
    # NaN and +-Inf read back as they were logged (the file store keeps them exactly).
    assert math.isnan(dict(_history(rid, "grad/total_norm"))[5])
    assert dict(_history(rid, "grad/norm/2.bias"))[5] == math.inf
    assert dict(_history(rid, "grad/norm/0.bias"))[5] == math.inf  # a -Inf gradient: an infinite norm
    assert dict(_history(rid, "grad/nan_count"))[5] == 1.0 and dict(_history(rid, "grad/inf_count"))[5] == 2.0
    assert dict(_history(rid, "grad/first_nonfinite_index"))[0] == -1.0
    assert dict(_history(rid, "grad/first_nonfinite_index"))[5] == 1.0  # 0.bias, in model order
    tags = MlflowClient().get_run(rid).data.tags
    assert tags["grad/first_nonfinite"] == "0.bias" and tags["grad/first_nonfinite_step"] == "5"


def test_options_reach_the_keys() -> None:
    plain, _, _ = _reports()
    with mlflow.start_run() as run:
        with MLflowSink(prefix="g.", per_param=False) as sink:
            sink.log(plain, 1)
        with MLflowSink(prefix="", key_style="megatron") as sink:
            sink.log(plain, 2)
    logged = MlflowClient().get_run(run.info.run_id).data.metrics
    assert "g.total_norm" in logged and not any(k.startswith("g.norm/") for k in logged)
    assert logged["grad-norm"] == plain.total_norm and logged["num-zeros"] == plain.zero_count


def test_the_sink_ends_only_a_run_it_started() -> None:
    plain, _, _ = _reports()
    client = MlflowClient()
    # No run given, none active: the sink starts one, and close() ends it.
    sink = MLflowSink()
    sink.log(plain, 0)
    own = sink.own_run_id
    assert own is not None and mlflow.active_run().info.run_id == own
    sink.close()
    assert mlflow.active_run() is None and client.get_run(own).info.status == "FINISHED"
    assert _history(own, "grad/total_norm") == [(0, plain.total_norm)]
    # run_id given: that run is logged to, not the active one, and neither is ended.
    given_run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    with mlflow.start_run() as active:
        sink = MLflowSink(run_id=given_run.info.run_id)
        sink.log(plain, 3)
        sink.close()
        sink.close()  # a second close does nothing
        assert mlflow.active_run().info.run_id == active.info.run_id
    assert _history(given_run.info.run_id, "grad/total_norm") == [(3, plain.total_norm)]
    assert "grad/total_norm" not in client.get_run(active.info.run_id).data.metrics
    assert client.get_run(given_run.info.run_id).info.status == "RUNNING"
    # The sink's own run no longer active at close (the user started another): it is ended by id, the other stays.
    sink = MLflowSink()
    sink.log(plain, 0)
    own = sink.own_run_id
    mlflow.end_run()
    with mlflow.start_run() as other:
        sink.close()
        assert mlflow.active_run().info.run_id == other.info.run_id
    assert client.get_run(own).info.status == "FINISHED"


def test_asynchronous_batches_are_written_by_close() -> None:
    plain, _, _ = _reports()
    with mlflow.start_run() as run:
        sink = MLflowSink(synchronous=False)
        for step in range(5):
            sink.log(plain, step)
        sink.close()
        assert sink._pending == []
        # (the asynchronous queue may write the batches in another order)
        assert sorted(_history(run.info.run_id, "grad/total_norm")) == [(s, plain.total_norm) for s in range(5)]


def test_bad_arguments() -> None:
    plain, _, _ = _reports()
    with pytest.raises(TypeError, match="run_id must be a str or None"):
        MLflowSink(run_id=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="run_id must be a run's id"):
        MLflowSink(run_id="")
    with pytest.raises(TypeError, match="per_param must be a bool"):
        MLflowSink(per_param=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key_style must be one of"):
        MLflowSink(key_style="keras")
    with pytest.raises(TypeError, match="synchronous must be a bool or None"):
        MLflowSink(synchronous="yes")  # type: ignore[arg-type]
    with mlflow.start_run():
        sink = MLflowSink()
        with pytest.raises(TypeError, match="step must be an int"):
            sink.log(plain, 1.5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="report must be a GradReport"):
            sink.log({"total_norm": 1.0}, 1)  # type: ignore[arg-type]
        sink.close()
        with pytest.raises(ValueError, match="closed"):
            sink.log(plain, 1)


def test_trainer_log_to(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(TensorDataset(torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)),
                        batch_size=8)
    reference = JSONLSink(tmp_path / "ref.jsonl", prefix="grad/")
    with mlflow.start_run() as run:
        sink = MLflowSink()
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                log_to=[sink, reference], log_every=2, progress=False).train_epoch(loader)
        sink.close()
    reference.close()
    rows = [json.loads(line) for line in (tmp_path / "ref.jsonl").read_text().splitlines()]
    rid = run.info.run_id
    assert [s for s, _ in _history(rid, "grad/total_norm")] == [0, 2, 4] == [r["step"] for r in rows]
    for key in ("grad/total_norm", "grad/norm/0.weight", "grad/norm/2.bias", "grad/zero_count", "grad/health"):
        assert _history(rid, key) == [(r["step"], float(r[key])) for r in rows]


def test_beside_the_lightning_callback(store: str) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import MLFlowLogger

    from torch_gradstats.integrations.lightning import GradStatsCallback

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class ToSink(L.Callback):
        """Sends each report the callback logged to an MLflowSink too, at the callback's logger step."""

        def __init__(self, stats: GradStatsCallback) -> None:
            self.stats, self.sink, self.seen = stats, None, None
            self.steps: list[int] = []

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self.sink is None:  # the run Lightning's logger made (not the active run: there is none)
                self.sink = MLflowSink(run_id=trainer.logger.run_id, prefix="sink/")
            report = self.stats.last_report
            if report is not None and report is not self.seen:
                self.seen = report
                step = trainer.fit_loop.epoch_loop._batches_that_stepped
                self.sink.log(report, step)
                self.steps.append(step)

    stats = GradStatsCallback(every_n_steps=2)
    bridge = ToSink(stats)
    logger = MLFlowLogger(experiment_name="lightning", tracking_uri=store)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[stats, bridge], logger=logger,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        log_every_n_steps=2)
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)),
                      batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(), data)
    bridge.sink.close()
    rid = logger.run_id
    assert mlflow.active_run() is None
    assert MlflowClient().get_run(rid).info.status == "FINISHED"  # ended by Lightning's logger, not the sink
    logged = MlflowClient().get_run(rid).data.metrics
    # The callback's keys, through Lightning's logger: Lightning's names and ours, unchanged, at steps 1, 3, 5.
    lightning_keys = [k for k in logged if not k.startswith("sink/")]
    assert {"grad_2.0_norm/net.0.weight", "grad_2.0_norm_total", "grad_stats/total_norm"} <= set(lightning_keys)
    assert all(mlflow_key(k) == k for k in lightning_keys)  # the sink would log them under the same names
    assert [s for s, _ in _history(rid, "grad_2.0_norm_total")] == [1, 3, 5]
    # The sink's figures, in the same run: the same numbers at the same steps.
    assert bridge.steps == [1, 3, 5]
    assert _history(rid, "sink/total_norm") == _history(rid, "grad_2.0_norm_total")
    assert _history(rid, "sink/norm/net.2.bias") == _history(rid, "grad_2.0_norm/net.2.bias")
    assert stats.last_report is not None and logged["sink/total_norm"] == stats.last_report.total_norm


def test_the_documented_example_runs_and_prints_what_it_says(tmp_path: Path) -> None:
    """docs/integrations.md fences its MLflow example no-run (mlflow is optional): it is run here instead."""
    page = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
    if not page.is_file():
        pytest.skip("not in a checkout of the repository: the documentation is not here")
    from test_doc_examples import code_blocks

    [code] = [c for _, info, c in code_blocks(page.read_text(encoding="utf-8"))
              if info.split()[:1] == ["python"] and "MLflowSink()" in c]
    said = [line[2:] for line in code.splitlines() if line.startswith("# [")]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(page.parents[1]), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("MLFLOW_TRACKING_URI")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == said and said
    assert (tmp_path / "mlruns").is_dir()


def test_a_key_mlflow_takes_keeps_its_name_beside_one_changed_onto_it() -> None:
    model = nn.ModuleDict({"a:b": nn.Linear(1, 1, bias=False), "a_b": nn.Linear(1, 1, bias=False)})
    model["a:b"](torch.ones(1, 1)).sum().backward()
    model["a_b"](2 * torch.ones(1, 1)).sum().backward()
    report = tg.grad_stats(model.named_parameters()).report()
    with mlflow.start_run() as run, MLflowSink() as sink:
        sink.log(report, 0)
    assert _history(run.info.run_id, "grad/norm/a_b.weight") == [(0, 2.0)]  # its own name, though it comes second
    assert _history(run.info.run_id, "grad/norm/a_b.weight_2") == [(0, 1.0)]
    assert sink.key("grad/norm/a:b.weight") == "grad/norm/a_b.weight_2"


def test_a_run_the_sink_started_ends_failed_when_its_with_block_raises() -> None:
    plain, _, _ = _reports()
    with pytest.raises(RuntimeError, match="the user's step"), MLflowSink() as sink:
        sink.log(plain, 0)
        raise RuntimeError("the user's step failed")
    assert mlflow.active_run() is None
    assert MlflowClient().get_run(sink.own_run_id).info.status == "FAILED"
    with MLflowSink() as sink:
        sink.log(plain, 0)
    assert MlflowClient().get_run(sink.own_run_id).info.status == "FINISHED"
