"""The Hugging Face callback's per_example and flight_recorder under a real transformers Trainer: one corrupted
target at one optimizer step is skipped by the spike guard, named by its batch position, and the flight recorder
is dumped as strict JSON lines."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")  # transformers.Trainer needs it
transformers = pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2ForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

from torch_gradstats import FlightRecorder, SpikeGuard  # noqa: E402
from torch_gradstats.integrations.transformers import GradStatsCallback, add_to_trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

T, MICRO, ACCUMULATION, STEPS = 8, 4, 2, 10
BAD_STEP, BAD_MICRO, BAD_POS = 7, 1, 2  # the second micro-batch of step 7, its third example
BAD_INDEX = BAD_MICRO * MICRO + BAD_POS  # 0-based position among the step's MICRO * ACCUMULATION examples



def _model() -> GPT2ForSequenceClassification:
    """A tiny GPT-2 regression model (one output, MSELoss over the batch's examples)."""
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, num_labels=1,
                     problem_type="regression", pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return GPT2ForSequenceClassification(cfg)


def _data(n: int = 128) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (n, T), generator=g)  # no pad token: each example is pooled at its last position
    labels = torch.randn(n, generator=g)
    # position_ids per example ([B, T] once collated): the position embedding's per-example gradients stay apart
    return [{"input_ids": x, "position_ids": torch.arange(T), "labels": y} for x, y in zip(ids, labels)]


class _Corrupting:
    """The default collator, corrupting one example's target in the one micro-batch of the run that is step
    BAD_STEP's micro-batch BAD_MICRO (micro-batches are collated in the order they are trained on)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = transformers.default_data_collator(features)
        if self.calls == BAD_STEP * ACCUMULATION + BAD_MICRO:
            batch["labels"] = batch["labels"].clone()
            batch["labels"][BAD_POS] = 1e4
        self.calls += 1
        return batch


def test_warning_names_the_corrupted_example_and_the_dump_parses(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    recorder = FlightRecorder(32, dump_dir=tmp_path / "flight")
    cb = GradStatsCallback(spike_guard=SpikeGuard(window=16, sigma=6.0, min_history=4), per_example=True,
                           flight_recorder=recorder)
    opt = cb.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
                             max_grad_norm=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=_data(), data_collator=_Corrupting(),
                      optimizers=(opt, None))
    add_to_trainer(trainer, cb)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()

    skipped = [r.getMessage() for r in caplog.records if r.name == "torch_gradstats" and "skipped (" in r.getMessage()]
    assert len(skipped) == 1, skipped
    (message,) = skipped
    assert f"optimizer step {BAD_STEP} skipped (gradient spike)" in message
    n = MICRO * ACCUMULATION
    assert f"largest per-example gradient norms of its {n} examples (0-based batch positions): #{BAD_INDEX} norm" \
        in message  # fmt: skip
    path = tmp_path / "flight" / f"flight-{BAD_STEP}.jsonl"
    assert f"flight recorder dumped to {path}" in message
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"

    def refuse(token: str) -> None:
        raise ValueError(f"{path.name} is not strict JSON: {token}")

    rows = [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps[-1] >= BAD_STEP and steps == list(range(steps[0], steps[-1] + 1))  # oldest first, none missing
    bad = rows[steps.index(BAD_STEP)]
    assert bad["guard/skipped"] == 1 and bad["guard/consecutive"] == 1
    others = [r["total_norm"] for r in rows if r["step"] != BAD_STEP]
    assert bad["total_norm"] > 100 * max(others)  # the corrupted example's gradient made the step's spike
    assert bad["loss"] > 100 * max(r["loss"] for r in rows if r["step"] != BAD_STEP)


def _train(tmp_path: Path, cb: GradStatsCallback, collator: Any, callbacks: list[Any] = ()) -> None:
    model = _model()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
                             max_grad_norm=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=_data(), data_collator=collator,
                      optimizers=(torch.optim.SGD(model.parameters(), lr=1e-3), None))
    for other in callbacks:
        trainer.add_callback(other)
    add_to_trainer(trainer, cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()


def test_a_process_that_does_not_log_keeps_no_rows(tmp_path: Path) -> None:
    """On a process that does not log (a DDP rank other than 0: the Trainer's state says so), the per-step rows of
    per_example and the flight recorder are let go at each logging step, as the logging rank's report tells those
    steps; they piled up there, one per optimizer step for the whole run. One process stands in for that rank: a
    callback before ours marks the state as not the world's process zero."""
    from transformers import TrainerCallback

    class NotProcessZero(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            state.is_world_process_zero = False

    class Pending(TrainerCallback):
        def __init__(self, watched: GradStatsCallback) -> None:
            self.watched, self.pending = watched, []

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            incidents = self.watched.taker.incidents
            assert incidents is not None
            self.pending.append(incidents.pending() is not None)

    cb = GradStatsCallback(per_example=True, flight_recorder=FlightRecorder(8, dump_dir=tmp_path / "flight"))
    pending = Pending(cb)
    _train(tmp_path, cb, transformers.default_data_collator, [NotProcessZero(), pending])
    assert len(pending.pending) >= STEPS and not any(pending.pending), pending.pending
    assert not (tmp_path / "flight").exists()  # that process reports nothing, so it dumps nothing either


def test_the_flight_recorder_holds_the_groups_the_callback_logs(tmp_path: Path) -> None:
    """``group_by=`` with ``flight_recorder=``: each recorded step holds the per-group figures that the logging step
    of the same optimizer step logged (the Trainer logs step ``s`` under ``s + 1``, its count after the step)."""
    model = _model()
    recorder = FlightRecorder(32, dump_dir=tmp_path / "flight")
    cb = GradStatsCallback(group_by="layer", flight_recorder=recorder)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=ACCUMULATION, max_steps=4, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=_data())
    add_to_trainer(trainer, cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()

    logged = {h["step"]: h for h in trainer.state.log_history if "grad/total_norm" in h}
    rows = recorder.to_dicts()
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and sorted(logged) == [1, 2, 3, 4]
    groups = [k[len("grad/"):] for k in logged[1] if k.startswith("grad/group/")]
    assert "group/transformer.h.0/norm" in groups and "group/score/norm" in groups
    for row in rows:
        assert row["total_norm"] == pytest.approx(logged[row["step"] + 1]["grad/total_norm"], rel=1e-12)
        for key in groups:
            assert row[key] == pytest.approx(logged[row["step"] + 1]["grad/" + key], rel=1e-12), (row["step"], key)


class _NaNLabel(_Corrupting):
    """One example's target NaN at step BAD_STEP: the step's loss and every gradient go NaN."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = transformers.default_data_collator(features)
        if self.calls == BAD_STEP * ACCUMULATION + BAD_MICRO:
            batch["labels"] = batch["labels"].clone()
            batch["labels"][BAD_POS] = float("nan")
        self.calls += 1
        return batch


def test_a_step_on_nonfinite_skips_is_not_called_taken_by_the_flight_recorders_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``on_nonfinite="skip"`` with a flight recorder: the callback skips the NaN step and says so, and the dump's
    warning called the same step ``(step taken)``."""
    model = _model()
    recorder = FlightRecorder(32, dump_dir=tmp_path / "flight")
    cb = GradStatsCallback(on_nonfinite="skip", flight_recorder=recorder)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, logging_steps=5,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=_data(), data_collator=_NaNLabel())
    add_to_trainer(trainer, cb)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()

    said = [r.getMessage() for r in caplog.records if r.name == "torch_gradstats"]
    assert cb.skipped_steps == [BAD_STEP] and all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert not [m for m in said if "step taken" in m], said
    path = tmp_path / "flight" / f"flight-{BAD_STEP}.jsonl"
    assert [m for m in said if f"optimizer step {BAD_STEP} skipped (non-finite gradient)" in m
            and f"flight recorder dumped to {path}" in m], said
