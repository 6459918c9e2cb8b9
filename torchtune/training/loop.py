"""Helpers for what every recipe's training loop repeats: the resumable loader and the
batches left in an epoch, the LR scheduler of a resumed run, the profiler, stopping
before a non-finite step, and showing and logging each step (:class:`StepLogger`).

The step itself (forward, loss, backward, ``optimizer.step()``, ``zero_grad``, the
scheduler and profiler steps) stays in each recipe, where a user edits it after
``tune cp``; these helpers take plain Python values, so they can be called and
tested without a config.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from tqdm import tqdm

from torchtune import utils
from torchtune.training._profiler import DummyProfiler, setup_torch_profiler
from torchtune.training.memory import get_memory_stats

log = utils.get_logger("DEBUG")


def setup_lr_scheduler(
    make_scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None,
    optimizer: torch.optim.Optimizer,
    *,
    num_training_steps: int,
    global_step: int = 0,
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """Build the LR scheduler, where a run that has taken ``global_step`` steps needs
    it (``last_epoch=global_step - 1``).

    A recipe builds it for a new run (``global_step`` 0) before the checkpoint
    manager's ``load()``, which saves its state with every step checkpoint and puts
    it back on resume. A scheduler built at ``last_epoch >= 0`` reads each group's
    ``initial_lr``; a group without one gets the optimizer's base ``lr``.

    Args:
        make_scheduler (Callable[..., LRScheduler] | None): builds the scheduler from
            ``(optimizer, num_training_steps=..., last_epoch=...)``, e.g.
            ``functools.partial(config.instantiate, cfg.lr_scheduler)``; ``None``
            keeps the LR constant.
        optimizer (torch.optim.Optimizer): the optimizer, plain or in-backward.
        num_training_steps (int): the run's optimizer steps, all epochs.
        global_step (int): the steps already taken. Default: ``0``

    Returns:
        LRScheduler | None: the scheduler, or ``None``.
    """
    if make_scheduler is None:
        return None
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", optimizer.defaults["lr"])
    return make_scheduler(
        optimizer, num_training_steps=num_training_steps, last_epoch=global_step - 1
    )


def setup_profiler(
    cfg_profiler: Mapping[str, Any] | None, *, device: torch.device
) -> torch.profiler.profile | DummyProfiler:
    """Build the torch profiler from the ``profiler`` options (the keywords of
    :func:`~torchtune.training.setup_torch_profiler`; ``_component_`` is ignored, as
    :class:`~torchtune.training.RecipeOptions` checked it), or a no-op one when they
    are absent or off. A recipe steps it once per optimizer step.

    With ``profile_memory`` on CUDA, rank 0's profiler also records the CUDA memory
    history over its first profiled (active) steps, which its trace handler saves as
    a memory snapshot at their end.

    Args:
        cfg_profiler (Mapping[str, Any] | None): the ``profiler`` options.
        device (torch.device): the training device.

    Returns:
        torch.profiler.profile | DummyProfiler: the profiler, with ``start``,
        ``step`` and ``stop``.
    """
    kwargs = {k: v for k, v in (cfg_profiler or {}).items() if k != "_component_"}
    profiler, profiler_cfg = setup_torch_profiler(**kwargs)
    utils.log_rank_zero(log, f"Profiler config after instantiation: {profiler_cfg}")
    memory = profiler_cfg["enabled"] and profiler_cfg.get("profile_memory", False)
    rank = utils.get_world_size_and_rank()[1]
    if not memory or device.type != "cuda" or rank != 0:
        return profiler
    first = profiler_cfg["wait_steps"] + profiler_cfg["warmup_steps"]
    return _MemoryHistoryProfiler(profiler, first, first + profiler_cfg["active_steps"])


class _MemoryHistoryProfiler:
    """The profiler, also recording the CUDA memory history from the start of step
    ``first`` (counted from 0) to the end of step ``last - 1``: the trace handler
    dumps the snapshot in the ``step()`` that ends the profiled steps."""

    def __init__(self, profiler: torch.profiler.profile, first: int, last: int):
        self._profiler, self._first, self._last = profiler, first, last
        self._steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._profiler, name)

    def start(self) -> None:
        self._profiler.start()
        self._record()

    def step(self) -> None:
        self._profiler.step()
        self._steps += 1
        self._record()

    def _record(self) -> None:
        if self._steps == self._first:
            torch.cuda.memory._record_memory_history()
        elif self._steps == self._last:
            torch.cuda.memory._record_memory_history(enabled=None)


def next_token_labels(
    labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The label each position predicts (the next token's; none, ``ignore_index``,
    for the last) and how many of them are targets.

    A batch without any target (with ``train_on_input: False``, prompts that fill
    ``max_seq_len``) would give a mean-reduced loss of 0/0 = NaN, and NaN gradients,
    which multiplying by its target count, 0, does not undo. Such a batch gets one
    placeholder target, token 0, at each sequence's first position: its loss is then
    finite, so multiplied by the returned count, 0, it adds exactly zero to the loss
    and to every gradient.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: the shifted labels and their target count.
    """
    shifted = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
    count = (shifted != ignore_index).sum()
    shifted[..., 0] = torch.where(count == 0, 0, shifted[..., 0])
    return shifted, count


def stop_if_not_finite(
    loss: torch.Tensor,
    grad_norm: torch.Tensor,
    *,
    step: int,
    epoch: int,
    batch: int,
    newest_checkpoint: Path | None,
) -> None:
    """Stop the run if the step about to be taken has a non-finite loss or gradient
    norm on any process: call it after backward and before ``optimizer.step()`` and
    the checkpoint manager's ``save()``, so that the weights a plain step would
    update and every checkpoint stay finite. In a distributed run call it on every
    rank: the ranks agree, so that all stop together.

    Args:
        loss (torch.Tensor): the step's loss (any scale: only its finiteness counts).
        grad_norm (torch.Tensor): the step's gradient norm, before clipping.
        step (int): the step about to be taken (``progress.global_step + 1``).
        epoch (int): the epoch it belongs to.
        batch (int): the position in the epoch of the step's last batch.
        newest_checkpoint (Path | None): the newest step checkpoint, saved before
            this step (``CheckpointManager.newest_checkpoint``), or ``None``.

    Raises:
        FloatingPointError: naming the step, the epoch, the batch and
            ``newest_checkpoint``.
    """
    finite = (torch.isfinite(loss) & torch.isfinite(grad_norm)).to(torch.int32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if finite:
        return
    resume = (
        "No step checkpoint is known to be from before the divergence: the newest "
        f"({newest_checkpoint}) holds finite weights, but a loss often grows for "
        "steps before it is not finite, and a resume brings back a checkpoint's "
        "optimizer state, its learning rate included. Start a new run "
        "(resume_from_checkpoint=False) once the cause is fixed"
        if newest_checkpoint is not None
        else "No step checkpoint was saved yet: start a new run "
        "(resume_from_checkpoint=False) once the cause is fixed"
    )
    raise FloatingPointError(
        f"Step {step} (epoch {epoch}, up to batch {batch} of the epoch) has a "
        f"non-finite loss ({float(loss)}) or gradient norm ({float(grad_norm)}) on at "
        "least one process: stopping before anything is saved, and before the "
        "optimizer steps (an in-backward update without clipping is applied as "
        "gradients arrive; with a non-finite loss, nothing is applied). "
        f"{resume}. The usual causes: a learning rate too high, an overflow in low "
        "precision, bad data in these batches."
    )


def epoch_batches(
    dataloader: Any,
    *,
    steps_done: int,
    steps_per_epoch: int,
    gradient_accumulation_steps: int = 1,
) -> Iterator[tuple[int, Any]]:
    """The ``(batch index, batch)`` pairs left to train on in an epoch of
    ``steps_per_epoch`` optimizer steps, ``steps_done`` of which are taken.

    Batches are numbered from where the epoch stands (a loader resumed mid-epoch by
    :meth:`CheckpointManager.load <torchtune.training.CheckpointManager.load>`
    continues from its saved position) and stop after the epoch's last full
    optimizer step: the batches past it are left unused.

    Args:
        dataloader (Any): the epoch's loader (its sampler's epoch already set).
        steps_done (int): optimizer steps of this epoch already taken.
        steps_per_epoch (int): optimizer steps in the epoch.
        gradient_accumulation_steps (int): batches per optimizer step. Default: ``1``

    Yields:
        tuple[int, Any]: the batch's index in the epoch and the batch.

    Example:
        >>> list(epoch_batches(["a", "b", "c", "d", "e"], steps_done=1,
        ...                    steps_per_epoch=2, gradient_accumulation_steps=2))
        [(2, 'a'), (3, 'b')]
    """
    first = steps_done * gradient_accumulation_steps
    for idx, batch in enumerate(dataloader, start=first):
        if idx // gradient_accumulation_steps == steps_per_epoch:
            return
        yield idx, batch


def stateful_dataloader(
    dataset: Any,
    *,
    batch_size: int,
    shuffle: bool,
    collate_fn: Callable[..., Any],
    num_replicas: int = 1,
    rank: int = 0,
) -> StatefulDataLoader:
    """A loader that a step checkpoint can save and resume mid-epoch, over this
    rank's share of a map-style dataset.

    The order depends only on the epoch (``sampler.set_epoch``; the sampler's seed is
    fixed), so a run resumed at an epoch boundary sees the batches the uninterrupted
    run saw. Only full batches are drawn (``drop_last``), so every batch has one
    shape (``torch.compile``, flex attention).

    Args:
        dataset (Any): a map-style dataset.
        batch_size (int): samples per batch and rank.
        shuffle (bool): shuffle each epoch.
        collate_fn (Callable[..., Any]): turns a list of samples into a batch.
        num_replicas (int): the data parallel ranks. Default: ``1``
        rank (int): this rank among them. Default: ``0``

    Returns:
        StatefulDataLoader: the loader.
    """
    sampler = StatefulDistributedSampler(
        dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=0
    )
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=True,
        # Its own generator: iterating the loader then never draws from the global
        # RNG, whose state a mid-epoch resume restores (dropout's draws).
        generator=torch.Generator(),
    )


class StepLogger:
    """What a recipe shows and logs after every optimizer step: a progress bar per
    epoch (``epoch|step|Loss: loss``) and, every ``log_every_n_steps`` steps, the
    step's metrics through the metric logger, with the token throughput since the
    previous step and, when asked, the device's peak memory stats.

    In a distributed run give every rank one, with ``metric_logger=None`` on all
    but rank 0: those show and log nothing.

    Args:
        metric_logger (Any | None): a torchtune metric logger (``log_dict``,
            ``close``), or ``None`` to show and log nothing.
        log_every_n_steps (int): log every this many optimizer steps.
        device (torch.device): whose peak memory stats to log.
        log_peak_memory_stats (bool): add them to the logged metrics.
            Default: ``False``
        world_size (int): processes the tokens are counted over, for
            ``tokens_per_second_per_gpu``. Default: ``1``

    Example:
        >>> step_logger = StepLogger(None, log_every_n_steps=1, device="cpu")
        >>> step_logger.start_epoch(0, steps=2, steps_done=0)
        >>> step_logger.log(1, loss=2.5, num_tokens=8, lr=1e-3)
        >>> step_logger.close()
    """

    def __init__(
        self,
        metric_logger: Any | None,
        *,
        log_every_n_steps: int,
        device: torch.device | str,
        log_peak_memory_stats: bool = False,
        world_size: int = 1,
    ) -> None:
        self._metric_logger = metric_logger
        self._every_n_steps = log_every_n_steps
        self._device = torch.device(device)
        self._peak_memory_stats = log_peak_memory_stats
        self._world_size = world_size
        self._pbar = None
        self._epoch = 0
        self._t0 = time.perf_counter()

    @classmethod
    def from_options(
        cls, metric_logger: Any | None, options: Any, *, world_size: int = 1
    ) -> StepLogger:
        """A step logger with a recipe's ``log_every_n_steps``, device and
        ``log_peak_memory_stats`` (from its
        :class:`~torchtune.training.RecipeOptions`)."""
        return cls(
            metric_logger,
            log_every_n_steps=options.log_every_n_steps,
            device=options.device,
            log_peak_memory_stats=options.log_peak_memory_stats,
            world_size=world_size,
        )

    def start_epoch(self, epoch: int, *, steps: int, steps_done: int) -> None:
        """Start the progress bar of ``epoch``: ``steps`` steps, ``steps_done``
        already taken (a resumed run)."""
        self._close_pbar()
        self._epoch = epoch
        # Throughput counts training only, not the setup or the epoch's checkpoint.
        self._t0 = time.perf_counter()
        self._pbar = tqdm(
            total=steps, initial=steps_done, disable=self._metric_logger is None
        )

    def log(
        self,
        step: int,
        *,
        loss: float,
        num_tokens: int,
        **metrics: float | torch.Tensor,
    ) -> None:
        """Show optimizer step ``step`` and log its metrics if due.

        Args:
            step (int): the optimizer steps taken so far.
            loss (float): the step's loss.
            num_tokens (int): the tokens the step trained on (this rank's, or all
                ranks' in a distributed run: the throughput is per process).
            **metrics (float | torch.Tensor): more metrics, e.g. ``lr`` and
                ``grad_norm`` (a tensor is read only when logged).
        """
        if self._pbar is not None:
            self._pbar.update(1)
            self._pbar.set_description(f"{self._epoch + 1}|{step}|Loss: {loss}")
        if self._metric_logger is not None and step % self._every_n_steps == 0:
            elapsed = time.perf_counter() - self._t0
            log_dict = {
                "loss": loss,
                **{name: float(value) for name, value in metrics.items()},
                "tokens_per_second_per_gpu": num_tokens / (elapsed * self._world_size),
            }
            if self._peak_memory_stats:
                log_dict |= get_memory_stats(device=self._device)
            self._metric_logger.log_dict(log_dict, step=step)
        self._t0 = time.perf_counter()

    def _close_pbar(self) -> None:
        if self._pbar is not None:
            self._pbar.close()
            self._pbar = None

    def close(self) -> None:
        """Close the progress bar and the metric logger."""
        self._close_pbar()
        if self._metric_logger is not None:
            self._metric_logger.close()
