"""Tests for torchtune/training/loop.py: what every recipe's loop repeats."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from torchtune import training
from torchtune.training import loop


def _loader(n: int = 12, batch_size: int = 2) -> StatefulDataLoader:
    data = list(range(n))
    sampler = StatefulDistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
    return StatefulDataLoader(data, batch_size=batch_size, sampler=sampler)


def test_epoch_batches_stop_after_the_epochs_last_full_step() -> None:
    seen = training.epoch_batches(
        _loader(), steps_done=0, steps_per_epoch=2, gradient_accumulation_steps=2
    )
    # 6 batches in the epoch, 2 steps of 2 batches: the last 2 are left unused.
    assert [idx for idx, _ in seen] == [0, 1, 2, 3]


def test_epoch_batches_resume_mid_epoch_where_the_saved_loader_was() -> None:
    def epoch(loader: StatefulDataLoader, steps_done: int = 0):
        return training.epoch_batches(loader, steps_done=steps_done, steps_per_epoch=6)

    uninterrupted = [b.tolist() for _, b in epoch(_loader())]
    loader = _loader()
    batches = epoch(loader)
    first = [next(batches)[1].tolist() for _ in range(2)]
    # A loader resumed mid-epoch (as CheckpointManager.load does) continues there.
    resumed_loader = _loader()
    resumed_loader.load_state_dict(loader.state_dict())
    resumed = list(epoch(resumed_loader, steps_done=2))
    assert [idx for idx, _ in resumed] == [2, 3, 4, 5]
    assert first + [b.tolist() for _, b in resumed] == uninterrupted
    # It leaves the sampler's epoch to the recipe: the order depends on it only.
    loader = _loader()
    loader.sampler.set_epoch(1)
    assert [b.tolist() for _, b in epoch(loader)] != uninterrupted


def _scheduler_lrs(global_step: int) -> list[float]:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = training.setup_lr_scheduler(
        partial(training.get_cosine_schedule_with_warmup, num_warmup_steps=2),
        optimizer,
        num_training_steps=8,
        global_step=global_step,
    )
    lrs = []
    for _ in range(global_step, 8):
        lrs.append(training.get_lr(optimizer))
        optimizer.step()
        scheduler.step()
    return lrs


def test_setup_lr_scheduler_puts_a_resumed_run_where_the_interrupted_one_was() -> None:
    # A fresh optimizer has no initial_lr (a sharded checkpoint cannot restore it):
    # the helper gives each group the optimizer's base lr.
    assert _scheduler_lrs(3) == _scheduler_lrs(0)[3:]
    assert (
        training.setup_lr_scheduler(
            None,
            torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1),
            num_training_steps=8,
            global_step=0,
        )
        is None
    )


def test_setup_profiler_is_a_no_op_without_a_section_and_torchs_with_one(
    tmp_path: Path,
) -> None:
    profiler = training.setup_profiler(None, device=torch.device("cpu"))
    assert isinstance(profiler, training.DummyProfiler)
    # A null _component_ means setup_torch_profiler, as in 0.6.1; with
    # profile_memory on CPU there is no CUDA memory history to record.
    profiler = training.setup_profiler(
        {"_component_": None, "enabled": True, "output_dir": str(tmp_path)},
        device=torch.device("cpu"),
    )
    assert isinstance(profiler, torch.profiler.profile)


class _CountingProfiler:
    def __init__(self) -> None:
        self.steps = 0
        self.stopped = False

    def start(self) -> None:
        pass

    def step(self) -> None:
        self.steps += 1

    def stop(self) -> None:
        self.stopped = True


@pytest.mark.parametrize("wait_and_warmup", [0, 2], ids=["from_start", "later"])
def test_setup_profiler_records_cuda_memory_over_the_first_profiled_steps(
    monkeypatch, wait_and_warmup: int
) -> None:
    """With profile_memory on CUDA the recipe's profiler.step() also starts the CUDA
    memory history as the profiled (active) steps start, and stops it right after
    the step() that ends them, in which the trace handler dumps the snapshot."""
    inner = _CountingProfiler()
    settings = {"enabled": True, "profile_memory": True, "active_steps": 2}
    settings |= {
        "wait_steps": wait_and_warmup // 2,
        "warmup_steps": wait_and_warmup // 2,
    }
    monkeypatch.setattr(loop, "setup_torch_profiler", lambda **_: (inner, settings))
    calls = []
    monkeypatch.setattr(
        torch.cuda.memory,
        "_record_memory_history",
        lambda **kwargs: calls.append((inner.steps, kwargs)),
    )
    profiler = training.setup_profiler({}, device=torch.device("cuda"))
    profiler.start()
    for _ in range(8):  # past the window: it is recorded once
        profiler.step()
    profiler.stop()
    first = wait_and_warmup
    assert calls == [(first, {}), (first + 2, {"enabled": None})]
    assert inner.steps == 8 and inner.stopped
    # Off CUDA nothing is recorded, and the profiler is torch's own.
    assert training.setup_profiler({}, device=torch.device("cpu")) is inner


def test_stateful_dataloader_draws_full_batches_in_an_order_set_by_the_epoch() -> None:
    loader = training.stateful_dataloader(
        list(range(7)), batch_size=2, shuffle=True, collate_fn=torch.tensor
    )
    loader.sampler.set_epoch(3)
    first = [b.tolist() for b in loader]
    assert [len(b) for b in first] == [2, 2, 2]  # the 7th sample is dropped
    loader.sampler.set_epoch(3)
    assert [b.tolist() for b in loader] == first
    # Two ranks split an epoch between them.
    halves = [
        training.stateful_dataloader(
            list(range(8)),
            batch_size=2,
            shuffle=False,
            collate_fn=torch.tensor,
            num_replicas=2,
            rank=rank,
        )
        for rank in (0, 1)
    ]
    seen = sorted(x for half in halves for b in half for x in b.tolist())
    assert seen == list(range(8))


class _RecordingLogger:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.closed = False

    def log_dict(self, payload: dict, step: int) -> None:
        self.logged.append((step, payload))

    def close(self) -> None:
        self.closed = True


def test_step_logger_logs_every_n_steps_with_throughput_and_reads_tensors() -> None:
    metric_logger = _RecordingLogger()
    step_logger = training.StepLogger(
        metric_logger, log_every_n_steps=2, device="cpu", world_size=2
    )
    step_logger.start_epoch(0, steps=4, steps_done=0)
    for step in range(1, 5):
        step_logger.log(
            step, loss=1.0 / step, num_tokens=10, grad_norm=torch.tensor(3.0)
        )
    step_logger.close()
    assert [step for step, _ in metric_logger.logged] == [2, 4]
    payload = metric_logger.logged[0][1]
    assert payload["loss"] == 0.5 and payload["grad_norm"] == 3.0
    assert isinstance(payload["grad_norm"], float)
    assert payload["tokens_per_second_per_gpu"] > 0
    assert metric_logger.closed
    # Ranks other than 0 get no metric logger: nothing is shown or logged.
    silent = training.StepLogger(None, log_every_n_steps=1, device="cpu")
    silent.start_epoch(0, steps=1, steps_done=0)
    silent.log(1, loss=1.0, num_tokens=1)
    silent.close()


@pytest.mark.parametrize("in_backward", [False, True])
def test_build_optimizer_builds_either_kind_over_every_parameter(
    in_backward: bool,
) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[0].requires_grad_(False)
    optimizer = training.build_optimizer(
        model.parameters(),
        partial(torch.optim.AdamW, lr=0.1),
        in_backward=in_backward,
        bucket_cap_mb=0,
    )
    assert isinstance(optimizer, training.OptimizerInBackward) == in_backward
    # Frozen parameters are in the group too, as in 0.6.1.
    assert len(optimizer.param_groups[0]["params"]) == 4
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_next_token_labels_shift_left_and_count_the_targets() -> None:
    labels = torch.tensor([[-100, -100, 5, 6], [-100, 7, 8, -100]])
    shifted, count = training.next_token_labels(labels, ignore_index=-100)
    torch.testing.assert_close(
        shifted, torch.tensor([[-100, 5, 6, -100], [7, 8, -100, -100]]), rtol=0, atol=0
    )
    assert count.item() == 4


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_batch_without_targets_adds_zero_loss_and_zero_gradients(chunks: int) -> None:
    # Every answer cut off: the mean loss would be 0/0 = NaN, and NaN * 0 is NaN.
    # With the placeholder target and the count 0, loss and gradients are zero
    # (and a step of such batches divides them by 1, not 0: no inf * 0 either).
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    torch.manual_seed(0)
    head = nn.Linear(4, 11)
    hidden = torch.randn(2, 6, 4)
    labels = torch.full((2, 6), -100)
    shifted, count = training.next_token_labels(labels, ignore_index=-100)
    assert count.item() == 0
    logits = head(hidden)
    if chunks == 1:
        loss = nn.CrossEntropyLoss(ignore_index=-100)(
            logits.reshape(-1, 11), shifted.reshape(-1)
        )
    else:
        loss_fn = CEWithChunkedOutputLoss(num_output_chunks=chunks)
        loss = loss_fn(list(logits.chunk(chunks, dim=1)), shifted)
    (loss * count).backward()
    assert (loss * count).item() == 0.0
    for param in head.parameters():
        torch.testing.assert_close(param.grad, torch.zeros_like(param), rtol=0, atol=0)
    # Without the placeholder, the same batch's loss is NaN (0/0) through the
    # shipped configs' loss, and multiplying by the count, 0, keeps it NaN.
    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=2)
    unguarded = loss_fn(list(head(hidden).chunk(2, dim=1)), labels)
    assert torch.isnan(unguarded * count)


def test_stop_if_not_finite_goes_on_when_finite_and_names_where_it_stopped() -> None:
    finite, nan, inf = (
        torch.tensor(0.5),
        torch.tensor(float("nan")),
        torch.tensor(float("inf")),
    )
    where = {"step": 6, "epoch": 1, "batch": 1}
    newest = Path("out/step_4")
    training.stop_if_not_finite(finite, finite, **where, newest_checkpoint=newest)
    for loss, grad_norm in ((nan, finite), (finite, inf)):
        with pytest.raises(FloatingPointError) as stopped:
            training.stop_if_not_finite(
                loss, grad_norm, **where, newest_checkpoint=newest
            )
        message = str(stopped.value)
        # The step, its epoch and batch, the two values and the checkpoint to resume.
        for carried in (
            "Step 6",
            "epoch 1",
            "batch 1",
            "(nan)" if loss is nan else "(inf)",
        ):
            assert carried in message
        # No checkpoint is offered as good (its weights may be diverging already,
        # and a resume brings its learning rate back): a new run is.
        assert f"({newest})" in message and "No step checkpoint is known" in message
        assert "resume_from_checkpoint=False" in message
        assert "resume_from_checkpoint=True" not in message
    with pytest.raises(FloatingPointError, match="No step checkpoint was saved yet"):
        training.stop_if_not_finite(nan, finite, **where, newest_checkpoint=None)
