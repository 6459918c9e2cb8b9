"""Contract tests for OptimizerInBackward (torchtune/training/memory.py): the parts of
its behaviour that the end-to-end equivalence tests in test_memory.py do not pin
down, found by mutation testing (scripts/mutation_test.sh). Each test is small and
runs in one process.

Tolerances: every comparison of parameters or optimizer state is bitwise
(``rtol=0, atol=0``), for the reason given in test_memory.py (the same optimizer
kernels on the same values). ``grad_norm`` is bitwise the plain path's
``training.grad_norm``; where it is compared with a norm computed another way (all
squares summed at once) the tolerance is ``rtol=1e-6``, a few float32 ulps (eps is
1.2e-7).
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard
from torch.optim.lr_scheduler import StepLR

from torchtune import training
from torchtune.training import OptimizerInBackward
from torchtune.training.memory import (
    DEFAULT_BUCKET_CAP_MB,
    _bucket_cap_bytes,
    _BucketState,
    _local_bytes,
)

BITWISE = {"rtol": 0, "atol": 0}
MIB = 1024**2


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def loss_fn(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
    return model(x).square().mean()


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def set_grads(model: nn.Module, step: int) -> None:
    """Gradients by hand (no backward, so no hook runs)."""
    model.zero_grad(set_to_none=True)
    loss_fn(model, step).backward()


# -- bucket sizes -----------------------------------------------------------------------


def test_bucket_cap_is_counted_in_mib_of_gradient_bytes() -> None:
    assert DEFAULT_BUCKET_CAP_MB == 4.0
    assert _bucket_cap_bytes(None) == 4 * MIB
    assert _bucket_cap_bytes(0) == 0
    assert _bucket_cap_bytes(0.5) == MIB // 2
    assert _bucket_cap_bytes(3) == 3 * MIB


def test_a_bucket_holds_params_up_to_exactly_the_cap() -> None:
    """Three float32 parameters of 512 KiB each, cap 1 MiB: the first two fill the
    bucket exactly, the third starts a new one. In bfloat16 (256 KiB each) all three
    fit in one."""
    for dtype, expected in ((torch.float32, [2, 1]), (torch.bfloat16, [3])):
        params = [nn.Parameter(torch.zeros(128 * 1024, dtype=dtype)) for _ in range(3)]
        optimizer = OptimizerInBackward(
            params, torch.optim.SGD, lr=0.1, bucket_cap_mb=1
        )
        assert [len(b.params) for b in optimizer._buckets()] == expected, dtype


@pytest.mark.parametrize(
    "cap_bytes, numels, expected",
    [
        # float32: 4 bytes an element. Two fill a bucket exactly, in every bucket.
        (8, [1, 1, 1, 1], [2, 2]),
        # 8 bytes alone; then 4 + 4 > 7 in the second bucket too.
        (7, [2, 1, 1], [1, 1, 1]),
    ],
)
def test_each_bucket_counts_its_bytes_from_zero(
    cap_bytes: int, numels: list[int], expected: list[int]
) -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in numels]
    optimizer = OptimizerInBackward(
        params, torch.optim.SGD, lr=0.1, bucket_cap_mb=cap_bytes / MIB
    )
    assert optimizer._bucket_cap_bytes == cap_bytes
    assert [len(b.params) for b in optimizer._buckets()] == expected


def test_local_bytes_are_the_bytes_of_the_local_shard(gloo_world_of_one) -> None:
    mesh = gloo_world_of_one
    plain = torch.zeros(5, 3, dtype=torch.bfloat16)
    assert _local_bytes(plain) == 5 * 3 * 2
    # As rank 0 of 2 would hold it: local rows 4 of 8.
    sharded = DTensor.from_local(
        torch.zeros(4, 3),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=(8, 3),
        stride=(3, 1),
    )
    assert sharded.numel() == 24
    assert _local_bytes(sharded) == 4 * 3 * 4


def test_params_and_optimizer_cls_may_be_keywords_and_the_cap_is_keyword_only() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(
        params=model.parameters(), optimizer_cls=torch.optim.SGD, lr=0.1
    )
    assert optimizer.param_groups[0]["lr"] == 0.1
    with pytest.raises(TypeError):
        OptimizerInBackward(model.parameters(), torch.optim.SGD, 0.5)


# -- the shared state view ---------------------------------------------------------------


def test_a_buckets_state_is_a_live_view_of_the_owners_state() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.AdamW)
    params = list(model.parameters())
    (bucket,) = optimizer._buckets()
    view = bucket.optimizer.state
    assert isinstance(view, _BucketState)
    assert len(view) == 0 and list(view) == [] and params[0] not in view
    assert view.get(params[0], "none") == "none"
    assert len(optimizer.state) == 0  # get() created nothing

    loss_fn(model, 0).backward()
    assert len(view) == len(params) == len(optimizer.state)
    assert list(view) == params  # the bucket's order
    for p in params:
        assert p in view and view[p] is optimizer.state[p]
        assert view.get(p) is optimizer.state[p]
    assert repr(view).startswith("_BucketState({")

    del view[params[1]]
    assert params[1] not in optimizer.state and len(view) == len(params) - 1
    view[params[1]] = {"marker": 1}
    assert optimizer.state[params[1]] == {"marker": 1}
    # Like a defaultdict(dict): reading a missing entry creates it.
    del optimizer.state[params[2]]
    assert view[params[2]] == {} and params[2] in optimizer.state


def test_a_buckets_state_refuses_tensors_of_other_buckets() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(
        model.parameters(), torch.optim.AdamW, bucket_cap_mb=0
    )
    loss_fn(model, 0).backward()
    first, second = optimizer._buckets()[:2]
    other = second.params[0]
    equal_but_other = first.params[0].detach().clone()
    view = first.optimizer.state
    assert other in optimizer.state and other not in view
    assert equal_but_other not in view
    assert view.get(other, "none") == "none"
    for key in (other, equal_but_other):
        with pytest.raises(KeyError, match="bucket's parameters"):
            view[key]
        with pytest.raises(KeyError, match="bucket's parameters"):
            view[key] = {}
        with pytest.raises(KeyError, match="bucket's parameters"):
            del view[key]
    assert len(optimizer.state) == 4


# -- the wrapped optimizer's attributes and hooks ----------------------------------------


class _FlavouredSGD(torch.optim.SGD):
    flavour = "vanilla"

    def describe(self) -> str:
        return f"{self.flavour} SGD"


def test_public_attributes_are_the_wrapped_optimizers() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), _FlavouredSGD, lr=0.1)
    assert optimizer.flavour == "vanilla" and optimizer.describe() == "vanilla SGD"
    with pytest.raises(AttributeError, match="no attribute 'not_there'"):
        optimizer.not_there  # noqa: B018
    with pytest.raises(AttributeError, match="'OptimizerInBackward' object has no"):
        optimizer._private_of_the_wrapped  # noqa: B018
    # Before __init__ has run (as during unpickling) nothing is forwarded.
    bare = OptimizerInBackward.__new__(OptimizerInBackward)
    with pytest.raises(AttributeError, match="no attribute 'flavour'"):
        bare.flavour  # noqa: B018


def test_state_param_groups_and_defaults_are_read_and_written_through() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    wrapped = optimizer._optimizer
    assert optimizer.param_groups is wrapped.param_groups
    assert optimizer.defaults is wrapped.defaults
    assert optimizer.state is wrapped.state
    groups, defaults, state = list(wrapped.param_groups), {"lr": 0.5}, {}
    optimizer.param_groups = groups
    optimizer.defaults = defaults
    optimizer.state = state
    assert wrapped.param_groups is groups
    assert wrapped.defaults is defaults
    assert wrapped.state is state


def test_repr_names_the_wrapped_optimizer_and_copies_are_refused() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    assert repr(optimizer) == f"OptimizerInBackward({optimizer._optimizer!r})"
    for copier in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="Save state_dict"):
            copier(optimizer)


def test_state_dict_hooks_run_where_the_plain_optimizers_run() -> None:
    """Hooks registered on the in-backward optimizer are the wrapped optimizer's and
    run at the same points as on a plain one."""
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    calls = []

    def save_pre(opt):
        calls.append("save_pre")

    def save_post(opt, state_dict):
        calls.append("save_post")
        return {**state_dict, "saved_by": "post"}

    def load_pre(opt, state_dict):
        calls.append("load_pre")
        groups = [{**g, "lr": 0.7} for g in state_dict["param_groups"]]
        return {"state": state_dict["state"], "param_groups": groups}

    def load_post(opt):
        calls.append("load_post")

    optimizer.register_state_dict_pre_hook(save_pre)
    optimizer.register_state_dict_post_hook(save_post)
    optimizer.register_load_state_dict_pre_hook(load_pre)
    optimizer.register_load_state_dict_post_hook(load_post)
    wrapped = optimizer._optimizer
    for name, hook in (
        ("_optimizer_state_dict_pre_hooks", save_pre),
        ("_optimizer_state_dict_post_hooks", save_post),
        ("_optimizer_load_state_dict_pre_hooks", load_pre),
        ("_optimizer_load_state_dict_post_hooks", load_post),
    ):
        assert list(getattr(wrapped, name).values()) == [hook], name

    state_dict = optimizer.state_dict()
    assert calls == ["save_pre", "save_post"] and state_dict["saved_by"] == "post"
    optimizer.load_state_dict(state_dict)
    assert calls == ["save_pre", "save_post", "load_pre", "load_post"]
    assert [g["lr"] for g in optimizer.param_groups] == [0.7]


# -- step(), zero_grad() and ownership ----------------------------------------------------


def test_step_skips_a_param_another_optimizer_took_and_updates_the_rest() -> None:
    """The first parameter of the group moved to another instance; step() with hand-
    set gradients updates every other one, like a plain SGD over them."""
    reference, model = make_model(), make_model()
    first = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    taken = model[0].weight
    second = OptimizerInBackward([taken], torch.optim.SGD, lr=0.1)
    first.remove_hooks()
    second.remove_hooks()
    set_grads(model, 0)
    set_grads(reference, 0)
    first.step()
    assert taken.grad is not None  # the other optimizer's to use
    plain = torch.optim.SGD(list(reference.parameters())[1:], lr=0.1)
    plain.step()
    after, expected = snapshot(model), snapshot(reference)
    torch.testing.assert_close(after, expected, **BITWISE)


def test_zero_grad_sets_grads_to_none_unless_told_otherwise() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    optimizer.remove_hooks()
    loss_fn(model, 0).backward()
    optimizer.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_after_remove_hooks_no_parameter_gets_a_hook_again() -> None:
    """Neither a parameter unfrozen later (attached by step()) nor one added with
    add_param_group is updated in backward once the hooks are removed."""
    model = make_model()
    model[0].weight.requires_grad_(False)
    optimizer = OptimizerInBackward(model[0:2].parameters(), torch.optim.SGD, lr=0.1)
    optimizer.remove_hooks()
    model[0].weight.requires_grad_(True)
    optimizer.add_param_group({"params": list(model[2].parameters())})
    for step in range(2):
        loss_fn(model, step).backward()
        assert all(p.grad is not None for p in model.parameters()), step
        optimizer.step()
        assert all(p.grad is None for p in model.parameters()), step
    assert all(
        len(p._post_accumulate_grad_hooks or {}) == 0 for p in model.parameters()
    )


def test_takeover_removes_the_earlier_instances_hooks_so_it_can_be_freed() -> None:
    model = make_model()
    first = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    first_ref = weakref.ref(first)
    second = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    for p in model.parameters():
        assert list(p._post_accumulate_grad_hooks.values()) == [second._on_grad_ready]
    assert first._hook_handles == {} and first._buckets() == []
    del first
    gc.collect()
    assert first_ref() is None


# -- load_state_dict ----------------------------------------------------------------------


def test_loaded_hyperparameters_are_the_ones_later_updates_use() -> None:
    """torch's load_state_dict replaces the param group dicts. The in-backward
    updates must read the new ones: the saved (scheduled) lr and the lr a scheduler
    sets after the load."""

    def run(in_backward: bool) -> dict[str, torch.Tensor]:
        model = make_model()
        build = (
            (lambda: OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1))
            if in_backward
            else (lambda: torch.optim.SGD(model.parameters(), lr=0.1))
        )
        optimizer = build()
        scheduler = StepLR(optimizer, step_size=1, gamma=0.5)
        for step in range(2):
            loss_fn(model, step).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        saved = copy.deepcopy(optimizer.state_dict())
        assert saved["param_groups"][0]["lr"] == 0.025
        resumed = build()
        resumed.load_state_dict(saved)
        for step in range(2, 4):
            loss_fn(model, step).backward()
            resumed.step()
            resumed.zero_grad()
            for group in resumed.param_groups:
                group["lr"] *= 3.0
        return snapshot(model)

    torch.testing.assert_close(run(True), run(False), **BITWISE)


def test_mismatch_message_names_missing_params_by_global_index() -> None:
    model = make_model()
    groups = [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters())},
    ]
    optimizer = OptimizerInBackward(groups, torch.optim.SGD, lr=0.1)
    saved = optimizer.state_dict()
    saved["param_groups"][1]["params"] = saved["param_groups"][1]["params"][:1]
    with pytest.raises(ValueError) as error:
        optimizer.load_state_dict(saved)
    message = str(error.value)
    assert "group 1 holds 2 parameters, the state dict's holds 1" in message
    assert "missing [#3 (shape (2,))], extra []" in message
    assert "group 0" not in message


def test_a_state_dict_without_the_torch_keys_is_refused_naming_its_first_keys() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError) as error:
        optimizer.load_state_dict({f"k{i}": {} for i in range(7)})
    assert "no ['param_groups', 'state'] entry" in str(error.value)
    assert "got keys ['k0', 'k1', 'k2', 'k3', 'k4']" in str(error.value)


def test_named_state_dicts_load_in_the_same_order_only() -> None:
    model = make_model()
    optimizer = OptimizerInBackward(model.named_parameters(), torch.optim.AdamW)
    loss_fn(model, 0).backward()
    saved = optimizer.state_dict()
    optimizer.load_state_dict(copy.deepcopy(saved))  # same names, same order
    reloaded = optimizer.state_dict()
    torch.testing.assert_close(reloaded["state"], saved["state"], **BITWISE)
    assert reloaded["param_groups"] == saved["param_groups"]
    swapped = copy.deepcopy(saved)
    names = swapped["param_groups"][0]["param_names"]
    names[0], names[1] = names[1], names[0]
    with pytest.raises(ValueError, match="same parameters in a different order"):
        optimizer.load_state_dict(swapped)


def test_grad_norm_of_plain_tensors_is_get_total_norms_bitwise() -> None:
    """Plain tensors: the norm of the stacked per-gradient norms, exactly as
    torch.nn.utils.get_total_norm computes it (one parameter, so no ordering
    question), not the square root of its square: for this gradient the square
    overflows float32 (sqrt(x * x) == x whenever it does not, in IEEE arithmetic)."""
    grad = torch.tensor([1e20])
    param = nn.Parameter(torch.zeros(1))
    optimizer = OptimizerInBackward([param], torch.optim.SGD, lr=0.0)
    param.grad = grad.clone()
    optimizer.step()
    expected = torch.nn.utils.get_total_norm([grad])
    assert expected.square().sqrt() != expected
    torch.testing.assert_close(optimizer.grad_norm, expected, **BITWISE)


# -- grad_norm with DTensor parameters ----------------------------------------------------


@pytest.fixture
def gloo_world_of_one() -> Iterator[DeviceMesh]:
    """A one-process gloo group and a 1-D mesh over it, torn down after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


def test_grad_norm_of_dtensor_and_plain_gradients_is_the_plain_paths_bitwise(
    gloo_world_of_one,
) -> None:
    """Sharded, replicated and partial DTensor gradients and plain ones, alone and
    mixed: the in-backward norm is bitwise ``training.grad_norm`` of the same
    gradients (DTensor reduces each mesh's norms), and it is the norm of all the
    gradients together. How the reduction runs across ranks is checked on 2
    processes by the FSDP scenarios."""
    mesh = gloo_world_of_one
    torch.manual_seed(0)
    sharded = nn.Parameter(DTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)]))
    replicated = nn.Parameter(DTensor.from_local(torch.randn(3), mesh, [Replicate()]))
    plain = nn.Parameter(torch.randn(2))
    partial = nn.Parameter(DTensor.from_local(torch.randn(3), mesh, [Replicate()]))
    cases = ([sharded], [replicated], [sharded, replicated, plain], [partial, plain])
    for params in cases:
        optimizer = OptimizerInBackward(params, torch.optim.SGD, lr=0.0)
        grads = []
        for i, p in enumerate(params):
            grad = torch.full(p.shape, float(i + 1))
            if p is partial:
                grad = DTensor.from_local(grad, mesh, [Partial()])
            elif isinstance(p, DTensor):
                grad = DTensor.from_local(grad, mesh, p.placements)
            p.grad = grad
            grads.append(grad.full_tensor() if isinstance(grad, DTensor) else grad)
        expected = training.grad_norm(params)
        optimizer.step()
        torch.testing.assert_close(optimizer.grad_norm, expected, **BITWISE)
        # rtol: the reference sums all squares at once, not per parameter.
        everything = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        torch.testing.assert_close(optimizer.grad_norm, everything, rtol=1e-6, atol=0)
