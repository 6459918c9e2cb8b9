"""The private torch APIs this patch set relies on, in one place: each one's dotted
name, where it is used, what for, and the torch versions it was checked against.

A torch upgrade may rename or remove any of them without notice. This test fails on
the first one that is gone, naming it and what breaks, so that an upgrade shows
where to look before a user's run does. Checked against torch 2.13.0 (the CPU build
this project tests with); update ``CHECKED_WITH`` when another version passes the
whole suite.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

CHECKED_WITH = ("2.13.0",)

_ESTIMATE = "torchtune/training/memory_estimate.py"

# (dotted name, where it is used, what for)
PRIVATE_TORCH_APIS = [
    (
        "torch._C._current_graph_task_id",
        "torchtune/training/memory.py",
        "tells which backward pass a gradient hook runs in, to queue one end-of-pass "
        "update of the buckets whose gradients did not all arrive",
    ),
    (
        "torch.autograd.Variable._execution_engine.queue_callback",
        "torchtune/training/memory.py",
        "runs that end-of-pass update when the backward pass finishes",
    ),
    (
        "torch.optim.Optimizer._patch_step_function",
        "torchtune/training/memory.py",
        "installs the step hooks LR schedulers and profilers expect on an optimizer",
    ),
    (
        "torch._functorch.config.donated_buffer",
        "torchtune/training/memory.py",
        "turned off when OptimizerInBackward clips, so a compiled backward can run "
        "twice over one graph (the measuring pass, then the updating pass)",
    ),
    (
        "torch._dynamo.reset",
        "torchtune/training/memory.py",
        "drops graphs compiled with donated buffers before clipping turns them off",
    ),
    (
        "torch._C._log_api_usage_once",
        "torchtune/training/memory.py",
        "the usage log every torch.optim optimizer writes when built",
    ),
    (
        "torch.utils._foreach_utils._group_tensors_by_device_and_dtype",
        "torchtune/training/gradients.py",
        "groups gradients as clip_grad_norm_ does, so norms are computed bitwise alike",
    ),
    (
        "torch.utils._foreach_utils._has_foreach_support",
        "torchtune/training/gradients.py",
        "chooses the foreach norm kernel exactly when clip_grad_norm_ does",
    ),
    (
        "torch._foreach_norm",
        "torchtune/training/gradients.py",
        "the per-gradient norms, in one kernel, as clip_grad_norm_ computes them",
    ),
    (
        "torch.distributed.checkpoint.state_dict._init_optim_state",
        "torchtune/training/checkpointing/_checkpoint_manager.py",
        "creates optimizer state before a torchtune 0.6.1 DCP checkpoint loads into it",
    ),
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
        "torchtune/training/memory.py, optim_in_bwd_legacy_state_dict.py",
        "activation checkpointing, and the parameter names it adds (0.6.1 checkpoints)",
    ),
    (
        "torch.cuda.memory._record_memory_history",
        "torchtune/training/loop.py",
        "the profiler's memory snapshot (CUDA only), as 0.6.1's recipes take it",
    ),
    (
        "torch.distributed._tools.mem_tracker.MemTracker",
        _ESTIMATE,
        "counts every storage of a step on fake tensors, by reference type",
    ),
    (
        "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker",
        _ESTIMATE,
        "the same under FSDP2: sharded and gathered parameters, all-gather and "
        "reduce-scatter buffers",
    ),
    (
        "torch.distributed._tools.common_utils.get_untyped_storages",
        _ESTIMATE,
        "the storages behind a tensor, a DTensor's or a wrapper subclass's",
    ),
    (
        "torch.distributed._tools.mem_tracker._TOTAL_KEY",
        _ESTIMATE,
        "the key of the bytes alive on a device in the tracker's snapshot",
    ),
    (
        "torch.distributed._tools.mem_tracker._UpdateType",
        _ESTIMATE,
        "the kinds of change the tracker's snapshot takes (a free, a resize)",
    ),
    (
        "torch.distributed._tools.mem_tracker.MemTracker._update_snap",
        _ESTIMATE,
        "overridden: the storages alive at a peak are copied before the first "
        "decrease after it",
    ),
    (
        "torch.distributed._tools.mem_tracker.MemTracker._update_peak_stats",
        _ESTIMATE,
        "overridden: notes a new peak and where the step is (not per module)",
    ),
    (
        "torch.distributed._tools.mem_tracker.MemTracker._register_global_optimizer_hook",
        _ESTIMATE,
        "overridden to do nothing: optimizer state is labelled after each step",
    ),
    (
        "torch.distributed._tools.mem_tracker.MemTracker._update_and_maybe_create_winfos",
        _ESTIMATE,
        "labels a gradient with its parameter as it is assigned",
    ),
    (
        "torch.distributed._tools.mem_tracker.MemTracker._track_optimizer_states",
        _ESTIMATE,
        "labels what an optimizer's state holds after a step",
    ),
    (
        "torch.distributed._tools.fsdp2_mem_tracker._FSDPState",
        _ESTIMATE,
        "its PRE_FW and PRE_BW members tell an all-gather's peak from the step's own",
    ),
    *(
        (
            f"torch.distributed._tools.{module}.{member}",
            _ESTIMATE,
            "a reference type the estimate labels storages with or reports",
        )
        for module, members in (
            ("mem_tracker._MemRefType", ("PARAM", "GRAD")),
            (
                "fsdp2_mem_tracker._FSDPRefType",
                (
                    "SHARDED_PARAM",
                    "SHARDED_GRAD",
                    "UNSHARDED_PARAM",
                    "UNSHARDED_GRAD",
                    "ALL_GATHER",
                    "REDUCE_SCATTER",
                ),
            ),
            *(
                (enum, ("BUFFER", "OPT", "ACT", "TEMP"))
                for enum in (
                    "mem_tracker._MemRefType",
                    "fsdp2_mem_tracker._FSDPRefType",
                )
            ),
        )
        for member in members
    ),
    (
        "torch.ops.aten._local_scalar_dense.default",
        _ESTIMATE,
        "the op a tensor's value is read through, answered during PPO's generation "
        "(whether prompts are padded, whether the KV cache has room)",
    ),
    (
        "torch._subclasses.fake_tensor.FakeTensorMode",
        _ESTIMATE,
        "tensors with shapes and no storage, so a 70B step runs on a CPU",
    ),
    (
        "torch._subclasses.fake_tensor.FakeTensor",
        _ESTIMATE,
        "tells a fake tensor from a real one while a recipe builds its models",
    ),
    (
        "torch._subclasses.fake_tensor.unset_fake_temporarily",
        _ESTIMATE,
        "computes for real, while a recipe builds its models, what is read by value "
        "(a device mesh's ranks, RoPE's frequencies)",
    ),
    (
        "torch.utils._python_dispatch.TorchDispatchMode",
        _ESTIMATE,
        "answers the questions about values PPO's generation asks of fake tensors",
    ),
    (
        "torch.utils._pytree.tree_leaves",
        _ESTIMATE,
        "finds the tensors among a torch function's arguments",
    ),
    (
        "torch.testing._internal.distributed.fake_pg.FakeStore",
        _ESTIMATE,
        "a process group of N ranks in one process (the 'fake' backend) for FSDP2",
    ),
]

# Attributes set in a class's __init__ (not resolvable from the class), each with
# the class, where it is used and what for.
PRIVATE_TORCH_ATTRIBUTES = (
    [
        (
            "torch.distributed._tools.mem_tracker.MemTracker",
            attribute,
            _ESTIMATE,
            used_for,
        )
        for attribute, used_for in (
            ("_WINFO", "the tracker's record of each live storage, read at a peak"),
            ("_curr_mem_snap", "the bytes alive now, per device"),
            ("_ref_class", "the tracker's reference types (plain or FSDP2's)"),
            (
                "_mod_tracker",
                "replaced: its module hooks keep gradients alive (is_bw, parents, "
                "get_known_fqn, register_user_hooks, clear_user_hooks and entering it "
                "are what the trackers use of it)",
            ),
        )
    ]
    + [
        (
            "torch.distributed._tools.mem_tracker._WeakRefInfo",
            attribute,
            _ESTIMATE,
            "a live storage's bytes and reference type, read and set by the estimate",
        )
        for attribute in ("mem_consumed", "reftype")
    ]
    + [
        (
            "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker",
            "_fsdp_state",
            _ESTIMATE,
            "tells an all-gather's peak in forward or backward from the step's own",
        ),
        (
            "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker",
            "_root_mod",
            _ESTIMATE,
            "replaced by all of a step's models, so that it instruments DPO's "
            "reference too",
        ),
    ]
)


def _resolve(dotted: str) -> object:
    """The object at ``dotted``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(dotted)


@pytest.mark.parametrize(
    ("name", "where", "used_for"),
    PRIVATE_TORCH_APIS,
    ids=[name for name, _, _ in PRIVATE_TORCH_APIS],
)
def test_each_private_torch_api_still_exists(name: str, where: str, used_for: str):
    try:
        found = _resolve(name)
    except (ImportError, AttributeError) as e:
        pytest.fail(
            f"{name} is gone in torch {torch.__version__} (checked with "
            f"{', '.join(CHECKED_WITH)}): {where} uses it ({used_for}). {e}"
        )
    if ".config." in name:  # a setting, which this project sets to a bool
        assert isinstance(found, bool), f"{name} is no longer a bool setting"
    elif name.rpartition(".")[2].isupper():  # a constant
        assert isinstance(found, str), f"{name} is no longer a str"
    else:
        assert callable(found), (
            f"{name} is no longer callable in torch {torch.__version__}"
        )


@pytest.mark.parametrize(
    ("cls", "attribute", "where", "used_for"),
    PRIVATE_TORCH_ATTRIBUTES,
    ids=[f"{cls}.{attribute}" for cls, attribute, _, _ in PRIVATE_TORCH_ATTRIBUTES],
)
def test_each_private_torch_attribute_is_still_set(
    cls: str, attribute: str, where: str, used_for: str
):
    # Set in __init__ (or the __init__ of a base class), so read from the source.
    found = _resolve(cls)
    sources = "".join(
        inspect.getsource(base.__init__)
        for base in found.__mro__
        if "__init__" in vars(base) and base.__module__.startswith("torch.")
    )
    if f"self.{attribute} " not in sources and f"self.{attribute}:" not in sources:
        pytest.fail(
            f"{cls} no longer sets {attribute} in torch {torch.__version__} (checked "
            f"with {', '.join(CHECKED_WITH)}): {where} uses it ({used_for})."
        )
