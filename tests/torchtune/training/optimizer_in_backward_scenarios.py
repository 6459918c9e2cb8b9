"""Distributed checks of OptimizerInBackward and CheckpointClient, run on 2 CPU
processes with gloo by ``tests/torchtune/conftest.py`` (one launch for all of them:
starting processes costs more than every check together).

Each scenario runs on every rank and is reported per rank as ``"ok"`` or a traceback;
the tests in ``test_memory.py`` and ``checkpointing/test_checkpoint_client.py`` assert
on those reports. Run by hand with ``torchrun --nproc-per-node 2 -m
tests.torchtune.training.optimizer_in_backward_scenarios OUT_DIR`` from the repo root.

Tolerances: the in-backward and plain runs call the same kernels on the same values,
in the same order per parameter, with the same reduce-scatter: parameters must agree
bitwise (``rtol=0, atol=0``). Only ``grad_norm`` is compared with ``rtol=1e-6``: it sums
squared per-parameter norms where torch takes the norm of the stacked norms, which
rounds differently by a few float32 ulps.
"""

from __future__ import annotations

import copy
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
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

from tests.torchtune.distributed_launcher import main_from_argv, write_report
from torchtune import training
from torchtune.training import OptimizerInBackward
from torchtune.training.checkpointing._checkpoint_client import (
    CheckpointClient,
    TrainingProgress,
)

BITWISE = {"rtol": 0, "atol": 0}
ADAMW = {"lr": 0.01, "weight_decay": 0.1}

SCENARIOS: dict[str, Callable[[Path], None]] = {}


def scenario(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def rank() -> int:
    return dist.get_rank()


def build_model(kind: str, seed: int = 0) -> nn.Module:
    """A small MLP, identical on every rank; FSDP2-sharded (one unit per linear) or
    a plain replica on each rank."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def batch(step: int, kind: str) -> torch.Tensor:
    # FSDP ranks see different data (data parallel). Plain replicas see the same data
    # on every rank, so they stay identical without a gradient all-reduce.
    seed = 1000 * step + (rank() if kind == "fsdp" else 0)
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    kind: str,
    steps: range,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    grad_norms: list[torch.Tensor] | None = None,
) -> None:
    for step in steps:
        model(batch(step, kind)).square().mean().backward()
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


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    torch.testing.assert_close(full_params(a), full_params(b), **BITWISE)


def make_optimizer(in_backward: bool, model: nn.Module) -> torch.optim.Optimizer:
    if in_backward:
        return OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    return torch.optim.AdamW(model.parameters(), **ADAMW)


# -- training --------------------------------------------------------------------


@scenario
def fsdp_training_with_steplr_matches_plain_bitwise(tmp: Path) -> None:
    reference, model = build_model("fsdp"), build_model("fsdp")
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    in_bwd = OptimizerInBackward(model.parameters(), torch.optim.AdamW, **ADAMW)
    plain_norms: list[torch.Tensor] = []
    in_bwd_norms: list[torch.Tensor] = []
    train(
        reference,
        plain,
        "fsdp",
        range(4),
        torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5),
        plain_norms,
    )
    train(
        model,
        in_bwd,
        "fsdp",
        range(4),
        torch.optim.lr_scheduler.StepLR(in_bwd, step_size=1, gamma=0.5),
        in_bwd_norms,
    )
    assert_same_params(reference, model)
    # clip_grad_norm_ returns a DTensor for DTensor grads: compare full values.
    plain_norms = [
        n.full_tensor() if isinstance(n, DTensor) else n for n in plain_norms
    ]
    torch.testing.assert_close(
        torch.stack(in_bwd_norms), torch.stack(plain_norms), rtol=1e-6, atol=0
    )


# -- state dict interchange --------------------------------------------------------


def check_resume(
    kind: str,
    save_in_backward: bool,
    save: Callable[[nn.Module, torch.optim.Optimizer], object],
    load: Callable[[nn.Module, torch.optim.Optimizer, object], None],
) -> None:
    """Train 2 steps, save the optimizer, load it into a fresh optimizer of the other
    kind over a model holding the same weights, train 2 more steps: must equal 4
    uninterrupted steps bitwise."""
    reference = build_model(kind)
    train(reference, make_optimizer(False, reference), kind, range(4))

    model = build_model(kind)
    optimizer = make_optimizer(save_in_backward, model)
    train(model, optimizer, kind, range(2))
    # Sharded state dicts share tensors with the live optimizer: copy before reuse.
    saved = copy.deepcopy(save(model, optimizer))
    weights = copy.deepcopy(get_model_state_dict(model))

    resumed = build_model(kind, seed=1)  # different initial weights, overwritten
    set_model_state_dict(resumed, weights)
    new_optimizer = make_optimizer(not save_in_backward, resumed)
    load(resumed, new_optimizer, saved)
    # Every entry arrived: same state keys as the optimizer that saved it.
    assert {k for s in new_optimizer.state.values() for k in s} == {
        "step",
        "exp_avg",
        "exp_avg_sq",
    }, new_optimizer.state
    train(resumed, new_optimizer, kind, range(2, 4))
    assert_same_params(reference, resumed)


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
    for kind in ("fsdp", "plain"):
        for api, (save, load) in APIS.items():
            for direction, save_in_backward in (
                ("in_bwd_to_plain", True),
                ("plain_to_in_bwd", False),
            ):
                name = f"{kind}_{api}_{direction}_resumes_bitwise"

                def run(tmp, kind=kind, save=save, load=load, sib=save_in_backward):
                    check_resume(kind, sib, save, load)

                SCENARIOS[name] = run


_add_resume_scenarios()


# -- checkpoint client -------------------------------------------------------------


def client_config(tmp: Path, resume: bool) -> OmegaConf:
    checkpoint_dir = tmp / "base"
    if rank() == 0:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        torch.save({}, checkpoint_dir / "model.pt")
    dist.barrier()
    return OmegaConf.create(
        {
            "device": "cpu",
            "resume_from_checkpoint": resume,
            "enable_async_checkpointing": True,
            "checkpointer": {
                "_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
                "checkpoint_dir": str(checkpoint_dir),
                "checkpoint_files": ["model.pt"],
                "output_dir": str(tmp / "out"),
                "model_type": "LLAMA2",
            },
        }
    )


def check_client_async_round_trip(tmp: Path, load_in_backward: bool) -> None:
    reference = build_model("fsdp")
    train(reference, make_optimizer(False, reference), "fsdp", range(4))

    model = build_model("fsdp")
    optimizer = make_optimizer(True, model)
    train(model, optimizer, "fsdp", range(2))
    saved_state = copy.deepcopy(get_optimizer_state_dict(model, optimizer))
    client = CheckpointClient(client_config(tmp, resume=False))
    progress = TrainingProgress(
        seed=7, epochs_run=1, total_epochs=3, max_steps_per_epoch=2
    )
    client.save_checkpoint(model, optimizer, progress, epoch=0)
    client.wait_for_async_save()
    dist.barrier()

    resumed = build_model("fsdp", seed=1)
    new_optimizer = make_optimizer(load_in_backward, resumed)
    loaded = CheckpointClient(
        client_config(tmp, resume=True)
    ).load_distributed_checkpoint(resumed, new_optimizer)
    assert loaded[training.EPOCHS_KEY] == 1 and loaded[training.SEED_KEY] == 7
    # The optimizer state itself survived (0.6.1 restored none, silently).
    torch.testing.assert_close(
        get_optimizer_state_dict(resumed, new_optimizer)["state"],
        saved_state["state"],
        **BITWISE,
    )
    train(resumed, new_optimizer, "fsdp", range(2, 4))
    assert_same_params(reference, resumed)


@scenario
def checkpoint_client_async_save_then_load_restores_in_bwd_state(tmp: Path) -> None:
    check_client_async_round_trip(tmp, load_in_backward=True)


@scenario
def checkpoint_client_async_in_bwd_checkpoint_loads_into_plain(tmp: Path) -> None:
    check_client_async_round_trip(tmp, load_in_backward=False)


@scenario
def checkpoint_client_sync_save_holds_full_in_bwd_state(tmp: Path) -> None:
    reference = build_model("fsdp")
    train(reference, make_optimizer(False, reference), "fsdp", range(4))

    model = build_model("fsdp")
    optimizer = make_optimizer(True, model)
    train(model, optimizer, "fsdp", range(2))
    cfg = client_config(tmp, resume=False)
    cfg.enable_async_checkpointing = False
    progress = TrainingProgress(
        seed=7, epochs_run=1, total_epochs=3, max_steps_per_epoch=2
    )
    CheckpointClient(cfg).save_checkpoint(model, optimizer, progress, epoch=0)
    (recipe_state,) = (tmp / "out").rglob("recipe_state.pt")
    checkpoint = torch.load(recipe_state, weights_only=False)
    (weights,) = (tmp / "out" / "epoch_0").glob("*.bin")
    dist.barrier()

    resumed = build_model("fsdp", seed=1)
    training.load_from_full_model_state_dict(
        resumed,
        torch.load(weights, weights_only=True),
        torch.device("cpu"),
        strict=True,
    )
    new_optimizer = make_optimizer(True, resumed)
    training.load_from_full_optimizer_state_dict(
        resumed, new_optimizer, checkpoint[training.OPT_KEY], torch.device("cpu")
    )
    train(resumed, new_optimizer, "fsdp", range(2, 4))
    assert_same_params(reference, resumed)


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
