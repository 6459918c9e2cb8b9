"""What every recipe's training loop repeats, once: the batches of an epoch (with
the profiler and the CUDA memory snapshot), the LR scheduler of a resumed run, the
profiler's setup, and showing and logging each step (:class:`StepLogger`). The
gradient norm and clipping are in :mod:`torchtune.training.gradients`.

The forward, loss and backward of a step stay in each recipe, where a user edits
them after ``tune cp``; these helpers take plain Python values, so they can be
called and tested without a config.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from tqdm import tqdm

from torchtune import utils
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset, PackedDataset
from torchtune.training._compile import compile_loss
from torchtune.training._profiler import DummyProfiler, setup_torch_profiler
from torchtune.training.memory import get_memory_stats

log = utils.get_logger("DEBUG")


# (first, last) batch index of the profiler's active steps in epoch 0, or None.
MemoryWindow = tuple[int, int] | None


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> None:
    """End a training step: ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=
    True)`` and, if there is one, ``lr_scheduler.step()``, in both modes.

    After an in-backward backward the step has nothing left to do (every parameter
    was updated inside backward); with a plain optimizer it is the update.

    Args:
        optimizer (torch.optim.Optimizer): the training optimizer.
        lr_scheduler (LRScheduler | None): the LR scheduler, if any. Default: ``None``

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> optimizer = torch.optim.SGD([p], lr=0.5)
        >>> scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        >>> p.grad = torch.ones(2)
        >>> optimizer_step(optimizer, scheduler)
        >>> p.detach(), p.grad, optimizer.param_groups[0]["lr"]
        (tensor([0.5000, 0.5000]), None, 0.05)
    """
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if lr_scheduler is not None:
        lr_scheduler.step()


def steps_per_epoch(
    num_batches: int, gradient_accumulation_steps: int, max_steps_per_epoch: int | None
) -> int:
    """Optimizer steps in an epoch of ``num_batches`` batches: one per
    ``gradient_accumulation_steps`` batches, at most ``max_steps_per_epoch``."""
    steps = num_batches // gradient_accumulation_steps
    return steps if max_steps_per_epoch is None else min(steps, max_steps_per_epoch)


def setup_lr_scheduler(
    make_scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None,
    optimizer: torch.optim.Optimizer,
    *,
    num_training_steps: int,
    global_step: int,
    compile_step: bool = False,
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """Build the LR scheduler where a run that has taken ``global_step`` steps needs
    it.

    The scheduler is not checkpointed: ``last_epoch=global_step - 1`` puts it where
    the interrupted run was. A scheduler built at ``last_epoch >= 0`` reads each
    group's ``initial_lr``, which the optimizer state of an epoch checkpoint brings
    back but a sharded one cannot (it loads only the entries a new optimizer has),
    so a group without one gets the optimizer's base ``lr``.

    Args:
        make_scheduler (Callable[..., LRScheduler] | None): builds the scheduler from
            ``(optimizer, num_training_steps=..., last_epoch=...)``, e.g.
            ``functools.partial(config.instantiate, cfg.lr_scheduler)``; ``None``
            keeps the LR constant.
        optimizer (torch.optim.Optimizer): the optimizer, plain or in-backward.
        num_training_steps (int): the run's optimizer steps, all epochs.
        global_step (int): the steps already taken (0 for a new run).
        compile_step (bool): then compile the optimizer's ``step``
            (``compile.optimizer_step``; see :func:`compile_optimizer_step`), which
            must come after the scheduler. Default: ``False``

    Returns:
        LRScheduler | None: the scheduler, or ``None``.
    """
    scheduler = None
    if make_scheduler is not None:
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", optimizer.defaults["lr"])
        scheduler = make_scheduler(
            optimizer,
            num_training_steps=num_training_steps,
            last_epoch=global_step - 1,
        )
    if compile_step:
        compile_optimizer_step(optimizer)
    return scheduler


def setup_loss(
    loss_fn: nn.Module, model: nn.Module, *, compile: bool = False
) -> nn.Module:
    """The loss as a recipe trains with it: compiled if asked, and, for a chunked
    output loss, the model set to return its logits in as many chunks.

    Use the returned loss: :func:`~torchtune.training.compile_loss` compiles a
    chunked loss in place but returns a new module for any other.

    Args:
        loss_fn (nn.Module): the loss, as built from the config.
        model (nn.Module): the model whose logits it takes.
        compile (bool): compile it (``compile.loss``). Default: ``False``

    Returns:
        nn.Module: the loss to train with.
    """
    if compile:
        loss_fn = compile_loss(loss_fn, verbose=utils.get_world_size_and_rank()[1] == 0)
    if hasattr(loss_fn, "num_output_chunks"):
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    return loss_fn


def compile_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Compile the optimizer's ``step`` (``compile.optimizer_step``), with the
    backend ``TORCH_COMPILE_BACKEND`` names (default ``inductor``).

    .. warning::
        Call it after building the LR scheduler, which wraps ``step`` to check the
        order of calls.

    Args:
        optimizer (torch.optim.Optimizer): a plain optimizer (an in-backward one
            refuses ``compile.optimizer_step``).
    """
    optimizer.step = torch.compile(
        optimizer.step, backend=os.environ.get("TORCH_COMPILE_BACKEND", "inductor")
    )


def setup_profiler(
    cfg_profiler: Mapping[str, Any] | None, *, device: torch.device
) -> tuple[torch.profiler.profile | DummyProfiler, MemoryWindow]:
    """Build the torch profiler from the ``profiler`` options (the keywords of
    :func:`~torchtune.training.setup_torch_profiler`; ``_component_`` is ignored,
    :func:`~torchtune.training.recipe_options.check_profiler_component` checked it),
    or a no-op one when they are absent or off.

    Args:
        cfg_profiler (Mapping[str, Any] | None): the ``profiler`` options.
        device (torch.device): the training device.

    Returns:
        tuple: the profiler, and the memory window: with ``profile_memory`` on CUDA,
        the first and last batch index of the profiled (active) steps of epoch 0,
        over which :func:`epoch_batches` records a CUDA memory snapshot; else
        ``None``.
    """
    kwargs = {k: v for k, v in (cfg_profiler or {}).items() if k != "_component_"}
    profiler, profiler_cfg = setup_torch_profiler(**kwargs)
    utils.log_rank_zero(log, f"Profiler config after instantiation: {profiler_cfg}")
    window = None
    if (
        profiler_cfg["enabled"]
        and profiler_cfg.get("profile_memory", False)
        and device.type == "cuda"
    ):
        first = profiler_cfg["wait_steps"] + profiler_cfg["warmup_steps"]
        window = (first, first + profiler_cfg["active_steps"])
    return profiler, window


def epoch_batches(
    dataloader: Any,
    epoch: int,
    *,
    steps_done: int,
    steps_per_epoch: int,
    gradient_accumulation_steps: int = 1,
    profiler: torch.profiler.profile | DummyProfiler | None = None,
    memory_window: MemoryWindow = None,
    step_logger: StepLogger | None = None,
) -> Iterator[tuple[int, Any]]:
    """The ``(batch index, batch)`` pairs of one epoch that are left to train on.

    It sets the sampler's epoch (the data order depends only on the seed and the
    epoch), numbers batches from where the epoch stands (a loader resumed mid-epoch,
    e.g. by :meth:`CheckpointClient.track <torchtune.training.CheckpointClient.track>`,
    continues from its saved position), and stops after the epoch's last full
    optimizer step (batches past it are left unused). After each optimizer step's
    last batch it steps the profiler; in epoch 0 it records a CUDA memory snapshot
    over ``memory_window``.

    Args:
        dataloader (Any): a ``StatefulDataLoader`` whose sampler has ``set_epoch``.
        epoch (int): the epoch, counted from 0.
        steps_done (int): optimizer steps of this epoch already taken.
        steps_per_epoch (int): optimizer steps in the epoch.
        gradient_accumulation_steps (int): batches per optimizer step. Default: ``1``
        profiler (torch.profiler.profile | DummyProfiler | None): stepped once per
            optimizer step. Default: ``None``
        memory_window (MemoryWindow): from :func:`setup_profiler`. Default: ``None``
        step_logger (StepLogger | None): starts the epoch's progress bar.
            Default: ``None``

    Yields:
        tuple[int, Any]: the batch's index in the epoch and the batch.
    """
    dataloader.sampler.set_epoch(epoch)
    if step_logger is not None:
        step_logger.start_epoch(epoch, steps=steps_per_epoch, steps_done=steps_done)
    record = epoch == 0 and memory_window is not None
    first_batch = steps_done * gradient_accumulation_steps
    for idx, batch in enumerate(dataloader, start=first_batch):
        if idx // gradient_accumulation_steps == steps_per_epoch:
            break
        if record and idx == memory_window[0]:
            torch.cuda.memory._record_memory_history()
        yield idx, batch
        if record and idx == memory_window[1]:
            torch.cuda.memory._record_memory_history(enabled=None)
        if profiler is not None and (idx + 1) % gradient_accumulation_steps == 0:
            profiler.step()


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


def sft_dataloader(
    dataset: Any,
    *,
    collate_fn: Callable[..., Any],
    padding_idx: int,
    ignore_idx: int,
    batch_size: int,
    shuffle: bool,
    num_replicas: int = 1,
    rank: int = 0,
) -> StatefulDataLoader:
    """:func:`stateful_dataloader` over a fine-tuning dataset, or the concatenation of
    a list of them, batched as torchtune's SFT recipes batch: packed datasets with
    ``padded_collate_packed``, others with ``collate_fn(padding_idx=...,
    ignore_idx=...)`` (``padded_collate_sft``, say).

    Args:
        dataset (Any): a map-style dataset, or a list of them.
        collate_fn (Callable[..., Any]): the collate function for unpacked data.
        padding_idx (int): the tokenizer's pad id.
        ignore_idx (int): the label the loss ignores.
        batch_size (int): samples per batch and rank.
        shuffle (bool): shuffle each epoch.
        num_replicas (int): the data parallel ranks. Default: ``1``
        rank (int): this rank among them. Default: ``0``

    Returns:
        StatefulDataLoader: the loader.
    """
    if isinstance(dataset, list):
        dataset = ConcatDataset(dataset)
    packed = isinstance(dataset, PackedDataset) or getattr(dataset, "packed", False)
    return stateful_dataloader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=(
            padded_collate_packed
            if packed
            else partial(collate_fn, padding_idx=padding_idx, ignore_idx=ignore_idx)
        ),
        num_replicas=num_replicas,
        rank=rank,
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
