"""Checks and helpers shared by the OptimizerInBackward tests.

Single-process helpers (:data:`ADAMW`, :func:`reference_after_6_steps`, state dict
comparisons, ...) that ``test_optimizer_in_backward.py`` and the 0.6.1 compatibility
tests share, over ``tests/helpers.py``'s model and loop; and the
distributed checks of OptimizerInBackward and CheckpointManager, run on 2 CPU
processes with gloo by ``tests/torchtune/conftest.py`` (one launch for all of them:
starting processes costs more than every check together).

Each scenario runs on every rank and is reported per rank as ``"ok"`` or a traceback;
the tests in ``test_optimizer_in_backward.py`` and
``checkpointing/test_checkpoint_manager.py`` assert on those reports. Run by hand with
``torchrun --nproc-per-node 2 -m tests.torchtune.training.optimizer_in_backward_scenarios
OUT_DIR`` from the repo root.

Tolerances: the in-backward and plain runs call the same kernels on the same values,
in the same order per parameter, with the same reduce-scatter, and the in-backward
``grad_norm`` combines its per-parameter norms as the plain one does (in parameter
order, reduced across ranks by DTensor): parameters and norms must agree bitwise
(``rtol=0, atol=0``).
"""

from __future__ import annotations

import io
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import bitsandbytes as bnb
import torch
import torch.distributed as dist
import torchao.optim
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import default_collate

from tests.helpers import BITWISE, WeightAverage, make_model, train
from tests.torchtune.distributed_launcher import main_from_argv, write_report
from torchtune import training
from torchtune.training import OptimizerInBackward

ADAMW_KWARGS = {"lr": 0.01, "weight_decay": 0.1}

SCENARIOS: dict[str, Callable[[Path], None]] = {}

# -- single-process helpers -----------------------------------------------------------

#: The optimizer most single-process tests train with: (class, kwargs).
ADAMW: tuple[type[torch.optim.Optimizer], dict[str, Any]] = (
    torch.optim.AdamW,
    {"lr": 0.05, "weight_decay": 0.1},
)


def freeze_first_layer(model: nn.Module) -> nn.Module:
    model[0].requires_grad_(False)
    return model


def reference_after_6_steps(frozen_first_layer: bool = False) -> nn.Module:
    """:func:`make_model` after 6 steps of the plain :data:`ADAMW`."""
    reference = make_model()
    if frozen_first_layer:
        freeze_first_layer(reference)
    cls, kwargs = ADAMW
    train(reference, cls(reference.parameters(), **kwargs), range(6))
    return reference


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The plain tensors a state value is made of (a torchao quantized state is a
    tensor subclass holding codes, scales and a code book)."""
    if type(value) is torch.Tensor or isinstance(value, nn.Parameter):
        return [value]
    attrs, _ = value.__tensor_flatten__()
    return [t for attr in attrs for t in tensors_of(getattr(value, attr))]


def assert_same_state_dict(
    actual: Any, expected: Any, path: str = "", **tol: float
) -> None:
    """Same structure, same types and dtypes, same values (bitwise unless ``tol``)."""
    tol = tol or BITWISE
    assert type(actual) is type(expected), f"{path}: {type(actual)} vs {type(expected)}"
    if isinstance(expected, torch.Tensor):
        for a, e in zip(tensors_of(actual), tensors_of(expected), strict=True):
            torch.testing.assert_close(a, e, msg=lambda m: f"{path}: {m}", **tol)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{path}: keys differ"
        for key in expected:
            assert_same_state_dict(actual[key], expected[key], f"{path}/{key}", **tol)
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), f"{path}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_state_dict(a, e, f"{path}[{i}]", **tol)
    else:
        assert actual == expected, f"{path}: {actual!r} vs {expected!r}"


# -- distributed scenarios --------------------------------------------------------------


def scenario(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def rank() -> int:
    return dist.get_rank()


def build_model(
    kind: str, seed: int = 0, width: int = 8, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """A small MLP, identical on every rank; FSDP2-sharded (one unit per linear) or
    a plain replica on each rank. ``width=64`` gives 64x128 weights, whose local
    shards (4096 elements on 2 ranks) are big enough for 8-bit optimizer state."""
    torch.manual_seed(seed)
    hidden = 2 * width
    model = nn.Sequential(
        nn.Linear(width, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, width if width > 8 else 4),
    ).to(dtype)
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def rank_batch(step: int, kind: str, width: int = 8) -> torch.Tensor:
    # FSDP ranks see different data (data parallel). Plain replicas see the same data
    # on every rank, so they stay identical without a gradient all-reduce.
    seed = 1000 * step + (rank() if kind == "fsdp" else 0)
    return torch.randn(6, width, generator=torch.Generator().manual_seed(seed))


def train_ranks(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    kind: str,
    steps: range,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    grad_norms: list[torch.Tensor] | None = None,
) -> None:
    width = next(model.parameters()).shape[1]
    for step in steps:
        model(rank_batch(step, kind, width)).square().mean().backward()
        if grad_norms is not None:
            if isinstance(optimizer, OptimizerInBackward):
                grad_norms.append(optimizer.grad_norm)
            else:
                grad_norms.append(
                    torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each DTensor gathered into a full tensor."""
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in tensors.items()
    }


def assert_same_params(actual: nn.Module, expected: nn.Module, **tol: float) -> None:
    """Same parameters, by name (full tensors of DTensors); bitwise unless ``tol``."""
    torch.testing.assert_close(
        full_params(actual), full_params(expected), **(tol or BITWISE)
    )


# Optimizers the resume scenarios run with: name -> (class, kwargs, model width).
OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], dict, int]] = {
    "adamw": (torch.optim.AdamW, ADAMW_KWARGS, 8),
    # torchao's low-bit AdamW works on FSDP2's DTensor parameters...
    "torchao_adamw8bit": (torchao.optim.AdamW8bit, ADAMW_KWARGS, 64),
    # ...bitsandbytes' only on plain tensors (replicas, not FSDP).
    "bnb_adamw8bit": (bnb.optim.AdamW8bit, ADAMW_KWARGS, 64),
}


def make_optimizer(
    in_backward: bool, model: nn.Module, name: str = "adamw"
) -> torch.optim.Optimizer:
    cls, kwargs, _ = OPTIMIZERS[name]
    if in_backward:
        return OptimizerInBackward(model.parameters(), cls, **kwargs)
    return cls(model.parameters(), **kwargs)


# -- training --------------------------------------------------------------------


@scenario
def fsdp_training_with_steplr_matches_plain_bitwise(tmp: Path) -> None:
    """Every bucketing against the plain run: one parameter per bucket, one FSDP unit
    (a linear's weight and bias) per bucket, and the default cap, whose one bucket
    spans all units, so it waits across reduce-scatters."""
    reference = build_model("fsdp")
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW_KWARGS)
    plain_norms: list[torch.Tensor] = []
    train_ranks(
        reference,
        plain,
        "fsdp",
        range(4),
        torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5),
        plain_norms,
    )
    # clip_grad_norm_ returns a DTensor for DTensor grads: compare full values.
    plain_norms = [
        n.full_tensor() if isinstance(n, DTensor) else n for n in plain_norms
    ]
    # The largest unit's local bytes: each unit then fills one bucket.
    unit_mb = (
        max(
            sum(p.to_local().numel() * 4 for p in layer.parameters())
            for layer in build_model("fsdp")
            if isinstance(layer, nn.Linear)
        )
        / 2**20
    )
    for bucket_cap_mb in (0, unit_mb, None):
        model = build_model("fsdp")
        in_bwd = OptimizerInBackward(
            model.parameters(),
            torch.optim.AdamW,
            bucket_cap_mb=bucket_cap_mb,
            **ADAMW_KWARGS,
        )
        sizes = [len(b.params) for b in in_bwd._buckets]
        assert sizes == {0: [1] * 6, unit_mb: [2] * 3, None: [6]}[bucket_cap_mb]
        in_bwd_norms: list[torch.Tensor] = []
        train_ranks(
            model,
            in_bwd,
            "fsdp",
            range(4),
            torch.optim.lr_scheduler.StepLR(in_bwd, step_size=1, gamma=0.5),
            in_bwd_norms,
        )
        assert_same_params(model, reference)
        assert len(in_bwd_norms) == len(plain_norms) == 4
        torch.testing.assert_close(
            torch.stack(in_bwd_norms), torch.stack(plain_norms), **BITWISE
        )


def train_scaled_and_clipped(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    steps: range,
) -> list[torch.Tensor]:
    """A recipe's step: backward a token-sum loss, multiply the gradients by
    ``world_size / tokens``, clip them, update. Returns the grad norms."""
    norms = []
    width = next(model.parameters()).shape[1]
    for step in steps:
        x = rank_batch(step, "fsdp", width).to(next(model.parameters()).dtype)
        loss = model(x).float().square().sum()
        scale = dist.get_world_size() / torch.tensor(6 * 4 * 2)
        if isinstance(optimizer, OptimizerInBackward):
            optimizer.backward(loss, grad_scale=scale)
            norms.append(optimizer.grad_norm)
        else:
            loss.backward()
            norms.append(
                training.scale_and_clip_grads_(model.parameters(), scale, max_norm)
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


@scenario
def fsdp_clipped_training_matches_plain_bitwise(tmp: Path) -> None:
    """Clipping inside backward (measure, then update in a second pass) against
    plain scale + clip + step: in fp32 and bf16, with a max_norm that clips every
    step and one that never clips, per parameter and per unit buckets."""
    for dtype in (torch.float32, torch.bfloat16):
        for max_norm in (0.05, 1e6):
            reference = build_model("fsdp", dtype=dtype)
            plain = torch.optim.AdamW(reference.parameters(), **ADAMW_KWARGS)
            plain_norms = train_scaled_and_clipped(reference, plain, max_norm, range(3))
            for bucket_cap_mb in (0, None):
                model = build_model("fsdp", dtype=dtype)
                in_bwd = OptimizerInBackward(
                    model.parameters(),
                    torch.optim.AdamW,
                    bucket_cap_mb=bucket_cap_mb,
                    max_norm=max_norm,
                    **ADAMW_KWARGS,
                )
                norms = train_scaled_and_clipped(model, in_bwd, max_norm, range(3))
                assert_same_params(model, reference)
                torch.testing.assert_close(
                    torch.stack(norms), torch.stack(plain_norms), **BITWISE
                )
            clipped = torch.stack(plain_norms).float() > max_norm
            assert bool(clipped.all()) == (max_norm == 0.05), (max_norm, plain_norms)


@scenario
def fsdp_loss_not_finite_on_one_rank_updates_no_rank(tmp: Path) -> None:
    """A loss that is not finite on rank 1 only: no rank updates (the gradients,
    reduced over the ranks, are not finite on any), and every rank keeps the same
    weights, so the shards of one model never diverge."""
    model = build_model("fsdp")
    before = full_params(model)
    optimizer = OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, **ADAMW_KWARGS
    )
    loss = model(rank_batch(0, "fsdp")).square().mean()
    if rank() == 1:
        loss = loss * float("nan")
    optimizer.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.testing.assert_close(full_params(model), before, **BITWISE)


@scenario
def torchao_adamw8bit_fsdp_training_matches_plain_bitwise(tmp: Path) -> None:
    width = OPTIMIZERS["torchao_adamw8bit"][2]
    reference, model = (
        build_model("fsdp", width=width),
        build_model("fsdp", width=width),
    )
    plain = make_optimizer(False, reference, "torchao_adamw8bit")
    in_bwd = make_optimizer(True, model, "torchao_adamw8bit")
    train_ranks(reference, plain, "fsdp", range(3))
    train_ranks(model, in_bwd, "fsdp", range(3))
    assert type(
        in_bwd.state[next(model.parameters())]["exp_avg"].to_local()
    ).__name__ == ("OptimState8bit")
    assert_same_params(model, reference)


# -- state dict interchange --------------------------------------------------------


def check_resume(
    kind: str,
    save_in_backward: bool,
    save: Callable[[nn.Module, torch.optim.Optimizer], object],
    load: Callable[[nn.Module, torch.optim.Optimizer, object], None],
    optimizer_name: str = "adamw",
) -> None:
    """Train 2 steps, save the optimizer, load it into a fresh optimizer of the other
    kind over a model holding the same weights, train 2 more steps: must equal 4
    uninterrupted steps bitwise."""
    width = OPTIMIZERS[optimizer_name][2]
    reference = build_model(kind, width=width)
    train_ranks(
        reference, make_optimizer(False, reference, optimizer_name), kind, range(4)
    )

    model = build_model(kind, width=width)
    optimizer = make_optimizer(save_in_backward, model, optimizer_name)
    train_ranks(model, optimizer, kind, range(2))
    saved_keys = {k for s in optimizer.state.values() for k in s}
    # Sharded state dicts share tensors with the live optimizer: copy before reuse,
    # through torch.save as a checkpoint file would (torchao's quantized state
    # cannot be deep-copied).
    saved = round_trip(save(model, optimizer))
    weights = round_trip(get_model_state_dict(model))

    resumed = build_model(kind, seed=1, width=width)  # other weights, overwritten
    set_model_state_dict(resumed, weights)
    new_optimizer = make_optimizer(not save_in_backward, resumed, optimizer_name)
    load(resumed, new_optimizer, saved)
    # Every entry arrived: same state keys as the optimizer that saved it.
    assert {k for s in new_optimizer.state.values() for k in s} == saved_keys, (
        new_optimizer.state
    )
    train_ranks(resumed, new_optimizer, kind, range(2, 4))
    assert_same_params(resumed, reference)


def round_trip(state: object) -> object:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def dcp_sharded_save(model, optimizer):
    return get_optimizer_state_dict(model, optimizer)


def dcp_sharded_load(model, optimizer, state):
    set_optimizer_state_dict(model, optimizer, state)


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL_LOAD = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def dcp_full_save(model, optimizer):
    # With cpu_offload only rank 0 receives the state...
    return get_optimizer_state_dict(model, optimizer, options=FULL)


def dcp_full_load(model, optimizer, state):
    # ...so it is broadcast from rank 0 when loading.
    set_optimizer_state_dict(model, optimizer, state, options=FULL_LOAD)


def torchtune_full_save(model, optimizer):
    state = training.get_full_optimizer_state_dict(model, optimizer, rank() == 0)
    # Only rank 0 gets the state; recipes then read the saved file on every rank.
    shared = [state]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def torchtune_full_load(model, optimizer, state):
    training.load_from_full_optimizer_state_dict(
        model, optimizer, state, torch.device("cpu")
    )


APIS = {
    "dcp_sharded": (dcp_sharded_save, dcp_sharded_load),
    "dcp_full": (dcp_full_save, dcp_full_load),
    "torchtune_full": (torchtune_full_save, torchtune_full_load),
}


def _add_resume_scenarios() -> None:
    cases = [(kind, api, "adamw") for kind in ("fsdp", "plain") for api in APIS] + [
        # torchao's quantized state resumes through sharded checkpoints only: a full
        # state dict needs DTensor.full_tensor() of it, which torchao 0.13 does not
        # implement (plain optimizer or not).
        ("fsdp", "dcp_sharded", "torchao_adamw8bit"),
        ("plain", "torchtune_full", "bnb_adamw8bit"),
        ("plain", "dcp_full", "bnb_adamw8bit"),
    ]
    for kind, api, optimizer_name in cases:
        save, load = APIS[api]
        for direction, save_in_backward in (
            ("in_bwd_to_plain", True),
            ("plain_to_in_bwd", False),
        ):
            prefix = "" if optimizer_name == "adamw" else f"{optimizer_name}_"
            name = f"{prefix}{kind}_{api}_{direction}_resumes_bitwise"

            def run(
                tmp,
                kind=kind,
                save=save,
                load=load,
                sib=save_in_backward,
                o=optimizer_name,
            ):
                check_resume(kind, sib, save, load, o)

            SCENARIOS[name] = run


_add_resume_scenarios()


# -- the checkpoint manager --------------------------------------------------------


class Samples(torch.utils.data.Dataset):
    """16 map-style samples: 4 batches of 2 per rank, 4 optimizer steps an epoch."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(self.width, generator=torch.Generator().manual_seed(i))


def manager_config(
    tmp: Path, optimizer_name: str, *, asynchronous: bool, resume: bool = False
) -> DictConfig:
    """A recipe config: the base checkpoint (the unsharded model of seed 0) in
    ``tmp/base``, step checkpoints and exports in ``tmp/out``, a step checkpoint
    every 3 steps, 2 epochs."""
    cls, kwargs, width = OPTIMIZERS[optimizer_name]
    base = tmp / "base"
    if rank() == 0 and not base.exists():
        base.mkdir(parents=True)
        torch.save(build_model("plain", width=width).state_dict(), base / "model.pt")
    dist.barrier()
    return OmegaConf.create(
        {
            "device": "cpu",
            "output_dir": str(tmp / "out"),
            "epochs": 2,
            "batch_size": 2,
            "save_every_n_steps": 3,
            "resume_from_checkpoint": resume,
            "enable_async_checkpointing": asynchronous,
            "optimizer": {"_component_": f"{cls.__module__}.{cls.__qualname__}"},
            "checkpointer": {
                "_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
                "checkpoint_dir": str(base),
                "checkpoint_files": ["model.pt"],
                "output_dir": str(tmp / "out"),
                "model_type": "LLAMA2",
            },
        }
    )


def train_with_manager(
    cfg: DictConfig,
    in_backward: bool,
    optimizer_name: str,
    stop_after: int | None = None,
    dies: bool = False,
) -> tuple[nn.Module, int, WeightAverage]:
    """A distributed recipe's setup and loop, checkpointed by the CheckpointManager,
    with an average of the weights of its own; ``stop_after``: stop right after that
    step's ``save()`` (``close()`` then lets an asynchronous save in flight
    complete, as a run stopped by a signal does; with ``dies``, the save's files are
    all written but it is never completed, as when the run is killed). Returns the
    model, the step it started from and the average."""
    width = OPTIMIZERS[optimizer_name][2]
    manager = training.CheckpointManager(training.CheckpointOptions.from_config(cfg))
    state = manager.load_base_checkpoint()
    model = build_model("fsdp", seed=1, width=width)  # the base replaces its weights
    training.load_from_full_model_state_dict(
        model, state[training.MODEL_KEY], torch.device("cpu"), strict=True
    )
    optimizer = make_optimizer(in_backward, model, optimizer_name)
    loader = training.stateful_dataloader(
        Samples(width),
        batch_size=cfg.batch_size,
        shuffle=True,
        collate_fn=default_collate,
        num_replicas=dist.get_world_size(),
        rank=rank(),
    )
    steps_per_epoch = len(loader)
    progress = training.TrainingProgress(total_epochs=cfg.epochs)
    # A recipe's own state: an average of the sharded weights.
    average = WeightAverage(model)
    states = {"model": model, "optimizer": optimizer, "dataloader": loader}
    states |= {"progress": progress, "average": average}
    manager.load(states, steps_per_epoch=steps_per_epoch)
    started_at = progress.global_step
    try:
        for epoch in range(progress.epochs_run, progress.total_epochs):
            loader.sampler.set_epoch(epoch)
            for _, x in training.epoch_batches(
                loader,
                steps_done=progress.global_step - epoch * steps_per_epoch,
                steps_per_epoch=steps_per_epoch,
            ):
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                average.update()
                progress.global_step += 1
                manager.save()
                if progress.global_step == stop_after:
                    if dies and manager._pending is not None:
                        manager._pending[0].result()
                        manager._pending = None
                    return model, started_at, average
            progress.epochs_run += 1
            manager.save(epoch_end=True)
    finally:
        manager.close()
        # close() releases output_dir on rank 0 alone: the next run's ranks must not
        # see this run's lock.
        dist.barrier()
    return model, started_at, average


# The uninterrupted run's parameters, per optimizer (the same in every scenario).
_UNINTERRUPTED: dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}


def check_manager_resume(
    tmp: Path,
    *,
    asynchronous: bool = False,
    save_in_backward: bool,
    load_in_backward: bool,
    optimizer_name: str = "adamw",
    dies: bool = False,
) -> None:
    """A run stopped after step 7 resumes from its mid-epoch step_6 (sharded by DCP,
    each rank's data position under its rank) into the given optimizer, and ends
    exactly where the uninterrupted run (plain optimizer) ends; ``dies``: its
    asynchronous save of step_6 was written but never completed, and the resume
    publishes it."""
    if optimizer_name not in _UNINTERRUPTED:
        cfg = manager_config(
            tmp / "uninterrupted", optimizer_name, asynchronous=asynchronous
        )
        model, _, average = train_with_manager(cfg, False, optimizer_name)
        _UNINTERRUPTED[optimizer_name] = full_params(model), full(average.average)
    cfg = manager_config(tmp / "run", optimizer_name, asynchronous=asynchronous)
    train_with_manager(cfg, save_in_backward, optimizer_name, stop_after=7, dies=dies)
    cfg.resume_from_checkpoint = True
    resumed, started_at, average = train_with_manager(
        cfg, load_in_backward, optimizer_name
    )
    assert started_at == 6, started_at
    params, averaged = _UNINTERRUPTED[optimizer_name]
    torch.testing.assert_close(full_params(resumed), params, **BITWISE)
    # The recipe's own state, sharded like the weights, resumed with them.
    torch.testing.assert_close(full(average.average), averaged, **BITWISE)


# Each a scenario of its own: where the run saves (in backward or plain) and what
# loads it; sharded step checkpoints also save torchao's quantized state, which
# full-state (all-gather) and asynchronous (deep copy) epoch checkpoints cannot.
_MANAGER_RESUMES: dict[str, dict[str, Any]] = {
    "step_checkpoint_fsdp_in_bwd_to_plain_resumes_bitwise": {
        "save_in_backward": True,
        "load_in_backward": False,
    },
    "step_checkpoint_fsdp_plain_to_in_bwd_resumes_bitwise": {
        "save_in_backward": False,
        "load_in_backward": True,
    },
    "torchao_adamw8bit_step_checkpoint_fsdp_in_bwd_to_plain_resumes_bitwise": {
        "save_in_backward": True,
        "load_in_backward": False,
        "optimizer_name": "torchao_adamw8bit",
    },
    "checkpoint_manager_async_in_bwd_resumes_mid_epoch_bitwise": {
        "asynchronous": True,
        "save_in_backward": True,
        "load_in_backward": True,
    },
    "checkpoint_manager_async_in_bwd_to_plain_resumes_mid_epoch_bitwise": {
        "asynchronous": True,
        "save_in_backward": True,
        "load_in_backward": False,
    },
    "checkpoint_manager_async_save_of_a_killed_run_is_published_at_the_next_start": {
        "asynchronous": True,
        "save_in_backward": True,
        "load_in_backward": True,
        "dies": True,
    },
    "checkpoint_manager_sync_in_bwd_resumes_mid_epoch_bitwise": {
        "save_in_backward": True,
        "load_in_backward": True,
    },
}
for _name, _kwargs in _MANAGER_RESUMES.items():
    SCENARIOS[_name] = partial(check_manager_resume, **_kwargs)


def main(out_dir: Path) -> None:
    """Run every scenario on this rank and report each."""
    torch.set_num_threads(1)
    # A collective that only one rank reaches fails after this long instead of hanging.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    report: dict[str, str] = {}
    try:
        for name, fn in SCENARIOS.items():
            tmp = out_dir / name
            if rank() == 0:
                tmp.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            start = time.perf_counter()
            try:
                fn(tmp)
                report[name] = "ok"
            except Exception:
                report[name] = traceback.format_exc()
            print(f"{name}: {time.perf_counter() - start:.2f} s", flush=True)
            write_report(out_dir, rank(), report)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main_from_argv(main)
