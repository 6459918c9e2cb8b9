"""Tests for torchtune/training/loop.py: what every recipe's loop repeats.

Norms and clipped gradients are compared bitwise with torch's own functions: the
helpers must compute exactly what the recipes computed before them.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from torchtune import training

BITWISE = {"rtol": 0, "atol": 0}


def _params_with_grads(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(n, generator=g)) for n in (3, 7, 5)]
    for p in params[:2]:  # the last one has no gradient
        p.grad = torch.randn(p.shape, generator=g) * 10
    return params


def test_grad_norm_is_bitwise_get_total_norm_and_skips_missing_gradients() -> None:
    params = _params_with_grads()
    expected = nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.testing.assert_close(training.grad_norm(params), expected, **BITWISE)
    torch.testing.assert_close(
        training.grad_norm([nn.Parameter(torch.ones(2))]), torch.tensor(0.0)
    )


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clips", "never_clips"])
def test_clip_grads_with_norm_scales_as_clip_grad_norm_does(max_norm: float) -> None:
    ours, theirs = _params_with_grads(), _params_with_grads()
    total = training.grad_norm(ours)
    training.clip_grads_with_norm_(ours, max_norm, total)
    nn.utils.clip_grad_norm_(theirs, max_norm)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, **BITWISE)


@pytest.mark.parametrize(
    ("batches", "accumulation", "limit", "expected"),
    [(10, 1, None, 10), (10, 3, None, 3), (10, 1, 4, 4), (10, 4, 9, 2)],
)
def test_steps_per_epoch_counts_full_steps_up_to_the_limit(
    batches, accumulation, limit, expected
) -> None:
    assert training.steps_per_epoch(batches, accumulation, limit) == expected


def _loader(n: int = 12, batch_size: int = 2) -> StatefulDataLoader:
    data = list(range(n))
    sampler = StatefulDistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
    return StatefulDataLoader(data, batch_size=batch_size, sampler=sampler)


class _CountingProfiler:
    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        self.steps += 1


def test_epoch_batches_stop_after_the_epochs_last_full_step_stepping_the_profiler():
    profiler = _CountingProfiler()
    seen = list(
        training.epoch_batches(
            _loader(),
            0,
            steps_done=0,
            steps_per_epoch=2,
            gradient_accumulation_steps=2,
            profiler=profiler,
        )
    )
    # 6 batches in the epoch, 2 steps of 2 batches: the last 2 are left unused.
    assert [idx for idx, _ in seen] == [0, 1, 2, 3]
    assert profiler.steps == 2  # once per optimizer step


def test_epoch_batches_resume_mid_epoch_where_the_saved_loader_was() -> None:
    uninterrupted = [
        b.tolist()
        for _, b in training.epoch_batches(
            _loader(), 1, steps_done=0, steps_per_epoch=6
        )
    ]
    loader = _loader()
    batches = training.epoch_batches(loader, 1, steps_done=0, steps_per_epoch=6)
    first = [next(batches)[1].tolist() for _ in range(2)]
    state = loader.state_dict()
    # A loader resumed mid-epoch (as CheckpointClient.track does) continues there.
    resumed_loader = _loader()
    resumed_loader.load_state_dict(state)
    resumed = list(
        training.epoch_batches(resumed_loader, 1, steps_done=2, steps_per_epoch=6)
    )
    assert [idx for idx, _ in resumed] == [2, 3, 4, 5]
    assert first + [b.tolist() for _, b in resumed] == uninterrupted
    # The data order depends on the epoch only.
    epoch_0 = [
        b.tolist()
        for _, b in training.epoch_batches(
            _loader(), 0, steps_done=0, steps_per_epoch=6
        )
    ]
    assert epoch_0 != uninterrupted


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
    profiler, window = training.setup_profiler(None, device=torch.device("cpu"))
    assert isinstance(profiler, training.DummyProfiler) and window is None
    # A null _component_ means setup_torch_profiler, as in 0.6.1.
    profiler, window = training.setup_profiler(
        {"_component_": None, "enabled": True, "output_dir": str(tmp_path)},
        device=torch.device("cpu"),
    )
    assert isinstance(profiler, torch.profiler.profile)
    # The CUDA memory snapshot is for CUDA devices only.
    assert window is None


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


def _collate(batch, padding_idx, ignore_idx):
    return {"n": len(batch), "pad": padding_idx, "ignore": ignore_idx}


def test_sft_dataloader_concatenates_a_list_and_passes_the_padding_ids() -> None:
    loader = training.sft_dataloader(
        [list(range(3)), list(range(3))],
        collate_fn=_collate,
        padding_idx=0,
        ignore_idx=-100,
        batch_size=2,
        shuffle=False,
    )
    assert len(loader.dataset) == 6
    assert next(iter(loader)) == {"n": 2, "pad": 0, "ignore": -100}


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


class _ChunkedModel(nn.Module):
    def set_num_output_chunks(self, n: int) -> None:
        self.chunks = n


def test_setup_loss_returns_the_compiled_loss_and_sets_the_models_chunks(
    monkeypatch,
) -> None:
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "eager")
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    # A loss other than a chunked one is compiled as a new module: the recipes
    # must train with the returned one (some used to drop it, leaving it eager).
    loss = training.setup_loss(nn.CrossEntropyLoss(), _ChunkedModel(), compile=True)
    assert isinstance(loss, torch._dynamo.eval_frame.OptimizedModule)
    logits, labels = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    torch.testing.assert_close(
        loss(logits, labels), nn.functional.cross_entropy(logits, labels)
    )
    # A chunked loss is compiled in place and tells the model its chunk count.
    model = _ChunkedModel()
    chunked = CEWithChunkedOutputLoss(num_output_chunks=4)
    assert training.setup_loss(chunked, model) is chunked
    assert model.chunks == 4
    uncompiled = nn.CrossEntropyLoss()
    assert training.setup_loss(uncompiled, _ChunkedModel()) is uncompiled


def test_optimizer_step_updates_zeroes_and_schedules_in_both_modes() -> None:
    """The step tail every recipe shares: the plain optimizer updates and the
    in-backward one has nothing left to do; both end with no gradients and the
    scheduler one step on."""
    torch.manual_seed(0)
    start = torch.randn(3)
    plain_param = torch.nn.Parameter(start.clone())
    bwd_param = torch.nn.Parameter(start.clone())
    plain = torch.optim.SGD([plain_param], lr=0.1)
    in_bwd = training.OptimizerInBackward([bwd_param], torch.optim.SGD, lr=0.1)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in (plain, in_bwd)]
    for param, optimizer, scheduler in zip(
        (plain_param, bwd_param), (plain, in_bwd), schedulers, strict=True
    ):
        (param * param).sum().backward()
        training.optimizer_step(optimizer, scheduler)
        assert param.grad is None
        assert optimizer.param_groups[0]["lr"] == 0.05
    torch.testing.assert_close(plain_param, bwd_param, rtol=0, atol=0)
    assert not torch.equal(plain_param, start)
    training.optimizer_step(plain)  # no scheduler: fine
