"""Peak memory per rank of a recipe's training step, plain and with
``optimizer_in_bwd``, estimated on a CPU without allocating model-sized memory.

Run it with the config and overrides you give ``tune run``::

    python -m torchtune.training.memory_estimate --config llama3_1/8B_full --nproc 8
    python -m torchtune.training.memory_estimate \\
        --config llama3_2/1B_full_single_device batch_size=4

How it works, what it leaves out, and its checks against measured runs:
``docs/source/memory_estimate.rst``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _UpdateType
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GIB = 2**30

#: Recipes the estimate reproduces, and whether each shards with FSDP2.
RECIPES = {
    "full_finetune_single_device": False,
    "full_finetune_distributed": True,
    "lora_finetune_single_device": False,
    "lora_finetune_distributed": True,
    "full_dpo_distributed": True,
    "ppo_full_finetune_single_device": False,
    "qat_distributed": True,
    "dev/early_exit_finetune_distributed": True,
}

#: What the bytes alive at a peak are, in the order the report lists them.
CATEGORIES = (
    "parameters",
    "buffers",
    "unsharded parameters",
    "gradients",
    "optimizer state",
    "activations",
    "temporaries",
)

#: GPU sizes (GB, 10**9 bytes) the report says a run fits in.
GPU_SIZES_GB = (24, 40, 48, 80)

#: What a GPU needs besides the tensors the estimate counts (CUDA context, NCCL
#: buffers, kernel workspaces) and the caching allocator's fragmentation, as bytes
#: kept free when saying whether a run fits: 2 GiB plus 10% of the peak.
FIT_RESERVE_BYTES = 2 * GIB
FIT_RESERVE_SHARE = 0.10


# -- counting live storages: torch's memory tracker --------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


#: The storages behind a tensor: a DTensor's local shard, a wrapper subclass's
#: inner tensors (torchao's quantized optimizer state), or its own.
_storages = get_untyped_storages

#: The report's category of each of the trackers' reference types (by name); any
#: other (temporaries of backward and of optimizer steps, the reduce-scatter's
#: flat gradients, inputs) is a temporary.
_CATEGORY_OF_REFTYPE = {
    "PARAM": "parameters",
    "SHARDED_PARAM": "parameters",
    "BUFFER": "buffers",
    "UNSHARDED_PARAM": "unsharded parameters",
    "ALL_GATHER": "unsharded parameters",
    "GRAD": "gradients",
    "SHARDED_GRAD": "gradients",
    "UNSHARDED_GRAD": "gradients",
    "OPT": "optimizer state",
    "ACT": "activations",
}


class _Alive(NamedTuple):
    """A storage alive at a peak."""

    nbytes: int
    category: str
    #: Where the step was when an op made it, or its reference type.
    tag: str
    #: The op that made it, or the parameter of a gradient.
    detail: Any
    reftype: str


class _NoModuleTracking:
    """Stands in for the trackers' ``ModTracker``, whose hooks on every module's
    outputs keep gradients alive that a step without them frees (measured: one
    chunk of the logits' gradient more at the peak, 8 MB of a 237 MB step with a
    32K vocabulary), and whose per-module peaks, kept after every op, took most
    of an estimate's time. Where the step is comes from :attr:`_Counting.phase`
    (what ``FSDPMemTracker`` reads of it: ``is_bw``, ``parents``,
    ``get_known_fqn``).
    """

    is_bw = False
    # No enclosing module: FSDPMemTracker then never takes a second call of a
    # unit (the early-exit loss runs the output projection again) for a second
    # iteration, which it refuses.
    parents = frozenset()

    def get_known_fqn(self, module: nn.Module) -> str:
        return type(module).__name__

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _NoModuleTracking:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class _Counting:
    """What the estimate adds to torch's ``MemTracker`` (and ``FSDPMemTracker``),
    which count every storage until it is freed, by reference type.

    - **Where the step is** (:attr:`phase`, set by the step), kept with each
      storage an op makes (``recompute`` for an activation checkpoint's forward run
      again in backward), and with the peak.
    - **What is alive at the peak**, storage by storage, for the report's held
      gradients and largest storages: copied at the first decrease after a new
      peak (a local maximum), reading no tensor, as a free can come in the middle
      of a tensor's destruction.
    - **Optimizer state** is what ``optimizer.state`` holds after a step
      (:meth:`label_state`). The trackers label whatever a step allocates as state
      through the optimizers' step hooks, which counts a step's temporaries as
      state, and ``FSDPMemTracker`` hooks only the optimizer it is given, so it
      labels an in-backward optimizer's state, made by the optimizers inside it,
      as temporaries.
    - **Gradients** are labelled with their parameter by a hook that runs before
      an in-backward update (:meth:`label`). The tracker's own gradient hooks,
      installed by its module tracking, run after the update has freed the
      gradient, and are registered on frozen parameters too, which torch refuses
      (a LoRA model has them).
    - **No module tracking** (:class:`_NoModuleTracking`).
    - **Gradient sums autograd makes in place**: autograd adds a gradient to the
      one already waiting for the same input in place when nothing else holds
      that buffer, but out of place when a dispatch mode is active, so counted as
      it runs every such sum would count one gradient too many. Measured on real
      runs, the first sum of two gradients is out of place (they are views of
      their producers' outputs) and every later one is in place, into the previous
      sum: only a buffer an earlier sum made counts as summed into in place.
    """

    def _start_counting(self) -> None:
        self._mod_tracker = _NoModuleTracking()
        self.phase = "setup"
        self.peak = 0
        self.at_peak: tuple[list[_Alive], str] = ([], "")
        self._peak_phase = ""
        self._pending = False

    @property
    def current(self) -> int:
        """Bytes alive now, on every device."""
        return sum(snap[_TOTAL_KEY] for snap in self._curr_mem_snap.values())

    def _register_global_optimizer_hook(self) -> None:
        """State is labelled by :meth:`label_state`, not by the optimizers' hooks."""

    def track_models(self, models: list[nn.Module]) -> None:
        """Track the parameters and buffers of ``models`` (``FSDPMemTracker``
        tracks only its root's, when it is entered)."""
        param = "PARAM" if "PARAM" in self._ref_class.__members__ else "SHARDED_PARAM"
        for model in models:
            for p in model.parameters():
                self.label(p, param)
            for b in model.buffers():
                self.label(b, "BUFFER")

    def label(self, tensor: torch.Tensor, reftype: str, detail: Any = None) -> None:
        """Name what a tensor is (tracking it if it is not yet)."""
        for winfo in self._update_and_maybe_create_winfos(
            tensor, self._ref_class[reftype]
        ):
            winfo.detail = detail

    def label_state(self, optimizer: torch.optim.Optimizer) -> None:
        self._track_optimizer_states(self._ref_class["OPT"], optimizer)

    def start_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak = self.current
        self._peak_phase = self.phase
        self._copy_peak()

    def finish(self) -> None:
        if self._pending:
            self._copy_peak()

    def _update_peak_stats(self, peak_state: Any) -> None:
        # In place of the tracker's own, which keeps each module's peak too (a
        # scan of every module after every op: most of an estimate's time).
        if self.current > self.peak:
            self.peak = self.current
            self._peak_phase = self._where()
            self._pending = True

    def _where(self) -> str:
        state = getattr(self, "_fsdp_state", None)
        if state is not None and state.name in ("PRE_FW", "PRE_BW"):
            return (
                f"all-gather in {'forward' if state.name == 'PRE_FW' else 'backward'}"
            )
        return self.phase

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
        if self._pending and u_type in (_UpdateType.DEL, _UpdateType.SIZE):
            # Before the first decrease after a peak: copy it, the storage that
            # shrinks at its size before.
            before = (
                winfo.mem_consumed if old_mem_consumed is None else old_mem_consumed
            )
            self._copy_peak(winfo, before)
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    def _copy_peak(self, changing: Any = None, nbytes: int = 0) -> None:
        self._pending = False
        live = {id(w): w for w, _ in list(self._WINFO.values())}
        if changing is not None:
            live[id(changing)] = changing
        self.at_peak = (
            [
                _Alive(
                    nbytes if w is changing else w.mem_consumed,
                    _CATEGORY_OF_REFTYPE.get(w.reftype.name, "temporaries"),
                    getattr(w, "tag", w.reftype.name),
                    getattr(w, "detail", None),
                    w.reftype.name,
                )
                for w in live.values()
            ],
            self._peak_phase,
        )

    def _tag(self) -> str:
        if self.phase == "backward" and torch.is_grad_enabled():
            return "recompute"
        return self.phase

    def _summed_in_place(self, func: Any, args: tuple, kwargs: dict | None) -> Any:
        """The tracked buffer autograd would sum a gradient into in place, if this
        op is that sum."""
        if (
            func is not torch.ops.aten.add.Tensor
            or kwargs
            or self.phase != "backward"
            or torch.is_grad_enabled()
            or len(args) != 2
        ):
            return None
        a, b = args
        if not (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.is_contiguous()
        ):
            return None
        winfo, _ = self._WINFO.get(a.untyped_storage(), (None, None))
        if winfo is None or getattr(winfo, "detail", None) is not func:
            return None
        return winfo

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        summed = self._summed_in_place(func, args, kwargs)
        if summed is not None and summed.mem_consumed:
            # Count the sum in the first buffer's bytes: it is freed right after.
            before, summed.mem_consumed = summed.mem_consumed, 0
            self._update_snap(_UpdateType.SIZE, summed, old_mem_consumed=before)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented:
            return out
        tag = self._tag()
        made = (self._ref_class["ACT"], self._ref_class["TEMP"])
        reftype = made[0] if tag in ("forward", "recompute") else made[1]
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            for storage in _storages(t):
                winfo, _ = self._WINFO.get(storage, (None, None))
                # A storage this op made: what the tracker labels by where it is
                # (a parameter or gradient an op returns keeps its label).
                if winfo is None or hasattr(winfo, "tag") or winfo.reftype not in made:
                    continue
                winfo.tag, winfo.detail = tag, func
                if winfo.reftype is not reftype:
                    old, winfo.reftype = winfo.reftype, reftype
                    self._update_snap(_UpdateType.REF, winfo, old_reftype=old)
        return out


class _TrueWhenAsked(TorchDispatchMode):
    """Answers ``True`` to every question about a boolean fake tensor's value,
    which fake tensors do not have: PPO's generation asks whether the prompts are
    unpadded and whether its KV cache has room. Either answer leads to the same
    shapes, and shapes are all the estimate reads."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            func is torch.ops.aten._local_scalar_dense.default
            and args[0].dtype == torch.bool
        ):
            return True
        return func(*args, **(kwargs or {}))


class _RealValues(TorchFunctionMode):
    """While a recipe builds its models on fake tensors, keeps real what is
    computed from real values only, starting from ``torch.arange``: a device
    mesh's ranks and RoPE's frequencies (Llama 3.1 scales them one by one) are read
    by value, which fake tensors do not have. They are small; parameters, their
    initialization and the state dict stay fake (or meta)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [
            t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        ]
        real = all(
            not isinstance(t, FakeTensor) and t.device.type == "cpu" for t in tensors
        )
        if real and (tensors or func is torch.arange):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _Tracker(_Counting, MemTracker):
    """torch's ``MemTracker``, counting as the estimate needs (:class:`_Counting`)."""

    def __init__(self) -> None:
        super().__init__()
        self._start_counting()


class _FSDPTracker(_Counting, FSDPMemTracker):
    """torch's ``FSDPMemTracker``, counting as the estimate needs
    (:class:`_Counting`): FSDP2's gathered parameters, its all-gather and
    reduce-scatter buffers, by the tracker's own instrumentation."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__(models[0])
        # It instruments the FSDP2 units under one root: all of the step's models
        # (DPO's policy and reference).
        self._root_mod = nn.ModuleList(models)
        self._start_counting()


# -- the report --------------------------------------------------------------------


@dataclass
class Peak:
    """What is alive at a peak, in bytes of this rank."""

    total: int = 0
    phase: str = ""
    by_category: dict[str, int] = field(default_factory=dict)
    #: Gradients alive at the peak that in-backward has not freed yet, each with
    #: its bytes and the reason: (what, bytes, why).
    held_gradients: list[tuple[str, int, str]] = field(default_factory=list)
    #: The largest storages alive at the peak: (bytes, category, what made it).
    largest: list[tuple[int, str, str]] = field(default_factory=list)


@dataclass
class ModeEstimate:
    """The estimate of one mode (plain or in-backward)."""

    peak: Peak
    #: Peak of the first step, which creates the optimizer state.
    first_step_peak: int
    #: Bytes alive when the reported step starts (parameters, buffers, state).
    step_start: int
    seconds: float


@dataclass
class Estimate:
    """The estimate for a config, per rank."""

    config: str
    recipe: str
    nproc: int
    dtype: str
    optimizer: str
    optimizer_note: str
    batch_size: int
    seq_len: int
    seq_len_note: str
    activation_checkpointing: bool
    clip_grad_norm: float | None
    bucket_cap_mb: float | None
    params: int
    trainable_params: int
    param_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    #: bitsandbytes' paged state (CUDA managed memory, which
    #: ``torch.cuda.max_memory_allocated`` does not count), included in the peaks.
    paged_state_bytes: int
    plain: ModeEstimate
    in_backward: ModeEstimate
    notes: list[str] = field(default_factory=list)

    @property
    def saving(self) -> int:
        return self.plain.peak.total - self.in_backward.peak.total

    @property
    def bound(self) -> int:
        """The in-backward peak without the gradients it holds at that peak for the
        reasons listed (never above the in-backward peak)."""
        held = sum(b for _, b, _ in self.in_backward.peak.held_gradients)
        return self.in_backward.peak.total - held

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["saving"] = self.saving
        out["saving_share_of_gradients"] = (
            self.saving / self.gradient_bytes if self.gradient_bytes else None
        )
        out["in_backward_bound"] = self.bound
        out["fits"] = {
            mode: fits(getattr(self, key).peak.total)
            for mode, key in (("plain", "plain"), ("in_backward", "in_backward"))
        }
        out["fits_with_paged_state_on_host"] = {
            mode: fits(getattr(self, key).peak.total, self.paged_state_bytes)
            for mode, key in (("plain", "plain"), ("in_backward", "in_backward"))
        }
        return out


def fits(peak: int, on_host: int = 0) -> list[int]:
    """The sizes in :data:`GPU_SIZES_GB` a peak fits in, with the reserve kept free,
    when ``on_host`` bytes of it live in host memory instead (bitsandbytes' paged
    optimizer state, which the driver moves there when the GPU is full)."""
    need = (peak - on_host) * (1 + FIT_RESERVE_SHARE) + FIT_RESERVE_BYTES
    return [gb for gb in GPU_SIZES_GB if need <= gb * 10**9]


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def format_report(est: Estimate) -> str:
    """The human-readable report of an estimate."""
    ranks = f"per rank, {est.nproc} ranks (FSDP2)" if est.nproc > 1 else "one device"
    lines = [
        f"ESTIMATED peak memory of one training step, {ranks}: {est.config} "
        f"({est.recipe})",
        f"  {est.params / 1e9:.3f}B parameters ({est.trainable_params / 1e9:.3f}B "
        f"trainable), {est.dtype}; batch {est.batch_size} x {est.seq_len} tokens "
        f"({est.seq_len_note}); activation checkpointing "
        f"{'on' if est.activation_checkpointing else 'off'}; clip_grad_norm "
        f"{est.clip_grad_norm}; optimizer {est.optimizer}",
        f"  optimizer state: {est.optimizer_note}",
        *(
            [
                f"  of which paged (in every peak below): {_gib(est.paged_state_bytes)}"
                "; torch.cuda.max_memory_allocated does not count it"
            ]
            if est.paged_state_bytes
            else []
        ),
        "",
        f"  {'':24}{'plain':>12}{'in-backward':>14}",
    ]
    plain, bwd = est.plain.peak, est.in_backward.peak
    for cat in CATEGORIES:
        a, b = plain.by_category.get(cat, 0), bwd.by_category.get(cat, 0)
        if a or b:
            lines.append(f"  {cat:24}{_gib(a):>12}{_gib(b):>14}")
    lines += [
        f"  {'peak':24}{_gib(plain.total):>12}{_gib(bwd.total):>14}",
        f"  {'peak is in':24}{plain.phase:>12}{bwd.phase:>14}",
        "",
        f"  gradients of the trainable parameters: {_gib(est.gradient_bytes)}",
        f"  in-backward saves {_gib(est.saving)} = "
        f"{est.saving / max(est.gradient_bytes, 1):.0%} of the gradient bytes",
        f"  in-backward lower bound at its peak: {_gib(est.bound)}, kept from it by:",
    ]
    if not bwd.held_gradients and bwd.phase in ("forward", "all-gather in forward"):
        lines.append(
            "    nothing: its peak is in forward, before any gradient exists; "
            "in-backward cannot lower it (activation checkpointing, a smaller batch "
            "or shorter samples can)"
        )
    elif not bwd.held_gradients:
        lines.append("    nothing: no gradient waits at the in-backward peak")
    for what, nbytes, why in bwd.held_gradients:
        lines.append(f"    {_gib(nbytes)} {what}: {why}")
    sizes = ", ".join(f"{gb} GB" for gb in GPU_SIZES_GB)
    lines += [
        "",
        f"  fits ({sizes}; keeping 2 GiB + 10% free): plain "
        f"{fits(plain.total) or 'none'}, in-backward {fits(bwd.total) or 'none'}",
    ]
    if est.paged_state_bytes:
        paged = est.paged_state_bytes
        lines.append(
            "  with the paged state in host memory (the driver moves it there when "
            "the GPU is full; steps slow down): plain "
            f"{fits(plain.total, paged) or 'none'}, in-backward "
            f"{fits(bwd.total, paged) or 'none'}"
        )
    lines += [f"  note: {n}" for n in est.notes]
    return "\n".join(lines)


# -- building what the recipe builds, without memory --------------------------------


def _bnb_patch(device_type: str) -> contextlib.AbstractContextManager:
    """bitsandbytes' 8-bit optimizers build their state with their own ``init_state``
    (the documented layout: uint8 per element plus an fp32 absmax per block of 256,
    fp32 state for parameters under 4096 elements). Their update kernel is updated in
    place on CUDA (nothing allocated); on CPU it is torch code that dequantizes the
    state to fp32, which runs here on fake tensors as it would for real."""
    try:
        import bitsandbytes.functional as bnb_f
    except ImportError:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    if device_type == "cpu":
        from bitsandbytes.backends.cpu import ops as cpu_ops

        original = bnb_f.optimizer_update_8bit_blockwise

        def cpu_update(*args: Any, **kwargs: Any) -> None:
            cpu_ops._optimizer_update_8bit_blockwise_cpu(*args, **kwargs)

        bnb_f.optimizer_update_8bit_blockwise = cpu_update
        stack.callback(setattr, bnb_f, "optimizer_update_8bit_blockwise", original)
    return stack


@contextlib.contextmanager
def _torchao_patch() -> Iterator[None]:
    """torchao's low-bit Adam builds its state subclasses with its own code, on fake
    tensors, once its quantization maps (computed from values, and cached) exist.
    Its update, one compiled kernel per parameter that dequantizes, updates and
    quantizes in registers, cannot run on fake tensors: it is skipped, and counted
    as allocating nothing."""
    try:
        from torchao.optim import adam, subclass_4bit, subclass_8bit
    except ImportError:
        yield
        return
    for module in (subclass_8bit, subclass_4bit):
        module.get_qmap_signed()
        module.get_qmap_unsigned()
    original = adam.single_param_adam

    def no_update(*args: Any, **kwargs: Any) -> None:
        return None

    compile_fn = torch.compile

    def compile_but_no_update(fn: Any = None, **kwargs: Any) -> Any:
        # Nothing to compile in the skipped update.
        return fn if fn is no_update else compile_fn(fn, **kwargs)

    adam.single_param_adam = no_update
    torch.compile = compile_but_no_update
    try:
        yield
    finally:
        adam.single_param_adam = original
        torch.compile = compile_fn


def _optimizer_note(optimizer_cls: Any) -> str:
    module = getattr(optimizer_cls, "__module__", "")
    name = getattr(optimizer_cls, "__name__", str(optimizer_cls))
    if module.startswith("bitsandbytes"):
        layout = (
            "uint8 per element and an fp32 absmax per block of 256; fp32 for "
            "parameters under 4096 elements"
            if "8bit" in name
            else "fp32 per element"
        )
        note = (
            f"{name}'s own init_state on fake tensors ({layout}); its update kernel "
            "cannot run on fake tensors: on CUDA it is in place and allocates "
            "nothing, on CPU its torch fallback is run"
        )
        if "Paged" in name:
            note += (
                "; paged state is in CUDA managed memory, counted here as resident "
                "(the driver can evict it to host memory under pressure)"
            )
        return note
    if module.startswith("torchao"):
        return (
            f"{name}'s own state subclasses on fake tensors (codes and a scale per "
            "block); its compiled update cannot run on fake tensors and is counted "
            "as allocating nothing (it works in registers)"
        )
    return f"{name}'s own step on fake tensors"


@dataclass
class _Setup:
    """What a recipe builds for a training step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: nn.Module
    param_names: dict[torch.Tensor, str]
    #: Gradient bytes (whole and this rank's shard) of each trainable parameter
    #: used more than once in a step -> its name and why its sum is held.
    tied_bytes: dict[int, tuple[str, str]]
    #: What counts the step's memory (``None`` for a real run).
    tracker: _Counting | None = None
    #: Every model the step runs (``model`` first: DPO's reference, PPO's
    #: reference, value and reward models).
    models: list[nn.Module] = field(default_factory=list)
    #: The recipe object whose methods the step calls, built without ``__init__``.
    recipe: Any = None


def _tied_parameters(model: nn.Module) -> dict[int, tuple[str, str]]:
    """Trainable parameters used by more than one module (an embedding tied to the
    output projection through ``TiedLinear``): gradient bytes (whole and this
    rank's shard) -> name."""
    names = {p: n for n, p in model.named_parameters()}
    tied = {}
    # ``TiedLinear`` is not a module: it is an attribute of the decoder.
    tied_linears = [
        v
        for m in model.modules()
        for v in vars(m).values()
        if hasattr(v, "tied_module")
    ]
    for tied_linear in tied_linears:
        tied_module = tied_linear.tied_module
        if isinstance(tied_module, nn.Module) and tied_module.weight.requires_grad:
            weight = tied_module.weight
            name = (
                f"{names[weight]} (tied to the output)",
                "autograd sums a tied parameter's gradient from its first use's "
                "backward (the output projection) to its last (the embedding) "
                "before the parameter can be updated",
            )
            # Summed whole before FSDP2 reduce-scatters it, or as this rank's shard.
            tied[weight.numel() * weight.element_size()] = name
            tied[_local_bytes(weight)] = name
    return tied


class _Estimator:
    """Builds a recipe's model, optimizer and loss under ``FakeTensorMode`` and runs
    its training step while counting live bytes."""

    def __init__(self, cfg: DictConfig, recipe: str, nproc: int, seq_len: int) -> None:
        from torchtune.training.recipe_options import RecipeOptions

        self.cfg = cfg
        self.recipe = recipe
        self.nproc = nproc
        self.seq_len = seq_len
        self.distributed = RECIPES[recipe]
        self.target_device = str(cfg.get("device", "cuda"))
        # The options as the recipe reads them, on this machine's CPU: the fake
        # tensors live on CPU whatever device the config names.
        cpu_cfg = OmegaConf.merge(
            cfg, {"device": "cpu", "enable_activation_offloading": False}
        )
        self.opts = RecipeOptions.from_config(cpu_cfg, distributed=self.distributed)
        self.notes: list[str] = []
        if cfg.get("layer_dropout", None):
            self.notes.append(
                "layer_dropout is not modeled: every layer runs (an upper bound)"
            )
            # The early-exit recipe's _setup_model wraps its layers only when set.
            self.cfg = OmegaConf.merge(cfg, {"layer_dropout": None})
        if cfg.get("enable_activation_offloading", False):
            self.notes.append(
                "enable_activation_offloading is not modeled: activations are counted "
                "as if they stayed on the GPU (an upper bound)"
            )
        if cfg.get("fsdp_cpu_offload", False):
            self.notes.append(
                "fsdp_cpu_offload is not modeled: shards are counted on the GPU"
            )
        if self.opts.compile["model"] or self.opts.compile["loss"]:
            self.notes.append(
                "compile is not modeled: the eager step is counted (compiled "
                "kernels usually need less activation memory)"
            )
        # What the recipes' _setup_model reads, without what is not modeled.
        self.opts = dataclasses.replace(
            self.opts,
            compile=dict.fromkeys(self.opts.compile, False),
            fsdp_cpu_offload=False,
        )

    # -- the models -------------------------------------------------------------

    def _state_dict(self, fake_mode: Any, cfg_model: DictConfig) -> dict[str, Any]:
        """A full state dict for ``cfg_model``, as a checkpointer would load it: fake
        tensors, or a random init for a real run to check the estimate against."""
        from torchtune import config, training

        with training.set_default_dtype(self.opts.dtype), torch.device("meta"):
            shapes = config.instantiate(cfg_model).state_dict()
        with fake_mode or contextlib.nullcontext():
            out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in shapes.items()}
            for v in out.values():
                if v.is_floating_point():
                    v.normal_(0.0, 0.02)
            return out

    def _setup_models(self, recipe: Any, fake_mode: Any) -> list[nn.Module]:
        """The recipe's models, built by its own ``_setup_model`` (the trained one
        first), under ``fake_mode``."""
        cfg, name = self.cfg, self.recipe
        weights = partial(self._state_dict, fake_mode)
        real_values = contextlib.nullcontext() if fake_mode is None else _RealValues()
        with fake_mode or contextlib.nullcontext(), real_values:
            if name == "ppo_full_finetune_single_device":
                policy, value = cfg.policy_model, cfg.reward_and_value_model
                build = recipe._setup_model
                models = [
                    build(policy, weights(policy), trainable=True),
                    build(policy, weights(policy), trainable=False),
                    build(value, weights(value), trainable=True, classifier=True),
                    build(value, weights(value), trainable=False, classifier=True),
                ]
                (
                    recipe._policy_model,
                    recipe._ref_policy_model,
                    recipe._value_model,
                    recipe._reward_model,
                ) = models
                return models
            if name == "full_dpo_distributed":
                models = [
                    recipe._setup_model(cfg.model, weights(cfg.model), trainable=t)
                    for t in (True, False)
                ]
                recipe._ref_model = models[1]
                return models
            if name == "qat_distributed":
                recipe._quantizer = recipe._setup_quantizer(cfg.quantizer)
                return [recipe._setup_model(cfg.model, weights(cfg.model))]
            if name.startswith("lora"):
                # A fresh adapter: the base state dict is the whole model's.
                first = cfg if self.distributed else cfg.model
                return [recipe._setup_model(first, weights(cfg.model), None)]
            if name == "full_finetune_single_device":
                return [recipe._setup_model(cfg.model, weights(cfg.model))]
            return [recipe._setup_model(cfg, weights(cfg.model))]

    def _build(self, fake_mode: Any, in_backward: bool, count: bool) -> _Setup:
        from torch.distributed.fsdp import FSDPModule

        from torchtune import config

        recipe = _recipe_class(self.recipe).__new__(_recipe_class(self.recipe))
        recipe._dtype, recipe._device = self.opts.dtype, torch.device("cpu")
        recipe._opts, recipe._optimizer_in_bwd = self.opts, in_backward
        # What the distributed recipes' __init__ sets that _setup_model reads;
        # tensor parallelism is not modeled.
        recipe.world_size, recipe._tp_dim, recipe._tp_plan = self.nproc, 1, None
        recipe._cfg_early_exit_loss = self.cfg.get("early_exit_loss", None)
        models = self._setup_models(recipe, fake_mode)
        if fake_mode is not None:
            # Buffers computed for real (RoPE's), made fake as the step would: once.
            for m in (m for model in models for m in model.modules()):
                for name, buf in list(m.named_buffers(recurse=False)):
                    if not isinstance(buf, FakeTensor):
                        setattr(m, name, fake_mode.from_tensor(buf))
        # Activation offloading is not modeled (see the notes).
        recipe._activations_handling_ctx = contextlib.nullcontext()
        model = recipe._model = models[0]
        names = {p: n for n, p in model.named_parameters()}
        if len(models) > 2:  # PPO's value model is trained too
            names |= {p: f"value model {n}" for n, p in models[2].named_parameters()}
        setup = _Setup(model, None, None, names, _tied_parameters(model))
        setup.models, setup.recipe = models, recipe
        if self.recipe == "ppo_full_finetune_single_device":
            self._set_up_ppo(recipe)
        elif self.recipe.startswith("dev/early"):
            self._set_up_early_exit(recipe, model)
        if count:
            setup.tracker = (
                _FSDPTracker(models) if isinstance(model, FSDPModule) else _Tracker()
            )
            self._label_gradients(setup)
        # Built outside fake mode: bitsandbytes computes its quantization maps from
        # values when built; the state comes in the first step, on fake tensors.
        # The recipe's own method (the parameters it optimizes, its options).
        optimizer = recipe._optimizer = recipe._setup_optimizer(self.cfg.optimizer)
        loss_fn = recipe._loss_fn = config.instantiate(self.cfg.loss)
        if hasattr(loss_fn, "num_output_chunks"):
            model.set_num_output_chunks(loss_fn.num_output_chunks)
            output = getattr(model, "output", None)
            chunks = loss_fn.num_output_chunks
            if isinstance(output, nn.Linear) and output.weight.requires_grad:
                # The output projection runs once per chunk of the logits.
                weight = output.weight
                why = (
                    f"the output projection runs on each of {chunks} chunks of the "
                    "logits: autograd sums their gradients before any update"
                )
                for nbytes in (
                    weight.numel() * weight.element_size(),
                    _local_bytes(weight),
                ):
                    setup.tied_bytes.setdefault(nbytes, (names[weight], why))
        setup.optimizer, setup.loss_fn = optimizer, loss_fn
        if count and self.recipe == "ppo_full_finetune_single_device":
            self._follow_ppo_phases(setup)
        return setup

    def _set_up_early_exit(self, recipe: Any, model: nn.Module) -> None:
        """The early-exit loss as the recipe sets it up (no curriculum step)."""
        from types import SimpleNamespace

        recipe.progress = SimpleNamespace(total_epochs=1, global_step=0)
        recipe._steps_per_epoch = 1
        cfg_loss = self.cfg.get("early_exit_loss", None)
        recipe._early_exit_layers, _ = recipe._setup_early_exit_loss(cfg_loss)
        recipe._set_output_hidden_states()
        if recipe._early_exit_layers is not None:
            recipe._final_hidden = None
            model.norm.register_forward_pre_hook(recipe._keep_final_hidden)

    def _set_up_ppo(self, recipe: Any) -> None:
        """What the PPO recipe reads of its config to generate and optimize, with
        a tokenizer that only names its special ids (generation runs for
        ``max_generated_tokens``: no response stops early)."""
        from types import SimpleNamespace

        cfg = self.cfg
        stop = list(cfg.get("stop_token_ids", None) or [1])
        recipe._tokenizer = SimpleNamespace(pad_id=0, eos_id=stop[0], stop_tokens=stop)
        recipe._setup_generation_and_rewards(cfg)
        recipe.batch_size = int(cfg.batch_size)
        recipe._forward_batch_size = int(cfg.forward_batch_size)
        recipe._ppo_epochs = int(cfg.ppo_epochs)
        recipe._ppo_batch_size = recipe._ppo_backward_batch_size = int(
            cfg.ppo_batch_size
        )
        recipe._gradient_accumulation_steps = 1
        # Fake tensors draw without a generator (the recipe's is seeded).
        recipe._rng = None
        recipe._optimizer_steps = 0
        self.notes.append(
            f"PPO: prompts of {self.seq_len} tokens and responses of "
            f"{cfg.max_generated_tokens} (max_generated_tokens)"
        )
        if cfg.ppo_epochs * cfg.batch_size > cfg.ppo_batch_size:
            self.notes.append(
                f"a PPO step takes {cfg.ppo_epochs * cfg.batch_size // cfg.ppo_batch_size}"
                " optimizer steps: the peak is that of the whole PPO step"
            )

    # -- what is alive ------------------------------------------------------------

    def _label_gradients(self, setup: _Setup) -> None:
        """Label each gradient, with its parameter, as it is assigned, before any
        optimizer hook uses it: these hooks are registered before the optimizer
        registers its own."""
        tracker = setup.tracker
        reftype = "SHARDED_GRAD" if isinstance(tracker, _FSDPTracker) else "GRAD"

        def tag(param: torch.Tensor) -> None:
            if param.grad is not None:
                tracker.label(param.grad, reftype, param)

        for model in setup.models:
            for param in model.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(tag)

    def _follow_ppo_phases(self, setup: _Setup) -> None:
        """The PPO recipe runs forward, backward and optimizer steps inside one
        method: its models' forward, its loss and the optimizer's step say where
        it is."""
        tracker = setup.tracker

        def forward(*args: Any) -> None:
            if torch.is_grad_enabled() and tracker.phase != "backward":
                tracker.phase = "forward"

        def backward(*args: Any) -> None:
            tracker.phase = "backward"

        def step(*args: Any) -> None:
            tracker.phase = "optimizer step"

        for model in (setup.models[0], setup.models[2]):
            model.register_forward_pre_hook(forward)
        setup.loss_fn.register_forward_hook(backward)
        setup.optimizer.register_step_pre_hook(step)

    def _peak(self, setup: _Setup, tracker: _Counting, in_backward: bool) -> Peak:
        live, phase = tracker.at_peak
        peak = Peak(total=sum(v.nbytes for v in live), phase=phase)
        by_cat = dict.fromkeys(CATEGORIES, 0)
        tied = dict(setup.tied_bytes)
        # Largest first: a parameter's whole gradient sum before its shard's size.
        live = sorted(live, key=lambda v: -v.nbytes)
        for v in live:
            by_cat[v.category] += v.nbytes
            if not in_backward:
                continue
            if v.category == "gradients":
                held = _why_held(
                    setup.optimizer, v.detail, setup.param_names, v.nbytes, phase
                )
                if held is not None:
                    peak.held_gradients.append(held)
            elif v.reftype == "REDUCE_SCATTER":
                peak.held_gradients.append(
                    (
                        "reduce-scatter buffer",
                        v.nbytes,
                        "FSDP2 flattens a unit's gradients to reduce-scatter them "
                        "before any of them reaches the optimizer",
                    )
                )
            elif v.tag == "backward" and v.nbytes in tied:
                name, why = _pop_name(tied, v.nbytes)
                peak.held_gradients.append((f"gradient sum of {name}", v.nbytes, why))
        peak.by_category = by_cat
        for v in live[:8]:
            what = setup.param_names.get(v.detail) or str(v.detail or v.reftype)
            peak.largest.append((v.nbytes, v.category, f"{v.tag}: {what}"))
        return peak

    # -- the step ------------------------------------------------------------------

    def _batch(self) -> dict[str, torch.Tensor]:
        bsz, seq = int(self.cfg.batch_size), self.seq_len
        vocab = 2
        return {
            "tokens": torch.randint(0, vocab, (bsz, seq)),
            "labels": torch.randint(0, vocab, (bsz, seq)),
        }

    def _step(self, setup: _Setup, tracker: Any, in_backward: bool) -> None:
        """One training step as the recipe takes it (one batch per step), through
        the recipe's own methods where its loop has them."""
        if self.recipe == "ppo_full_finetune_single_device":
            self._ppo_step(setup, tracker)
            return
        tracker.phase = "forward"
        if self.recipe == "full_dpo_distributed":
            # A mean over the batch's pairs: nothing to scale by.
            loss, scale = self._dpo_loss(setup), None
        else:
            loss, num_tokens = self._loss_step(setup)
            # The recipes backpropagate the token sum and scale the gradients by
            # the step's (global) token count.
            loss = loss * num_tokens
            world = self.nproc if self.distributed else 1
            if world > 1:
                torch.distributed.all_reduce(num_tokens)
            scale = world / num_tokens
        tracker.phase = "backward"
        self._backward_and_update(setup, tracker, loss, scale, in_backward)

    def _backward_and_update(
        self,
        setup: _Setup,
        tracker: Any,
        loss: torch.Tensor,
        scale: torch.Tensor | None,
        in_backward: bool,
    ) -> None:
        """What every recipe's loop does after its loss, in either mode."""
        from torch.distributed.fsdp import FSDPModule

        from torchtune import training

        model, optimizer = setup.model, setup.optimizer
        if in_backward:
            kwargs = {} if scale is None else {"grad_scale": scale}
            if isinstance(model, FSDPModule) and self.recipe.startswith("dev/early"):
                # The early-exit loss reads out hidden states with the root unit's
                # norm and output outside its forward.
                kwargs["before_update_pass"] = model.unshard
            optimizer.backward(loss, **kwargs)
        else:
            loss.backward()
        del loss
        tracker.phase = "optimizer step"
        if not in_backward:
            training.scale_and_clip_grads_(
                model.parameters(), scale, self.opts.clip_grad_norm
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker.phase = "between steps"

    def _loss_step(self, setup: _Setup) -> tuple[torch.Tensor, torch.Tensor]:
        """The recipe's ``_loss_step`` (early exit: its loop's forward and loss)."""
        from torchtune import training
        from torchtune.modules.early_exit_loss import early_exit_loss

        recipe, batch = setup.recipe, self._batch()
        if not self.recipe.startswith("dev/early"):
            return recipe._loss_step(batch)
        labels, num_tokens = training.next_token_labels(
            batch.pop("labels"), recipe._loss_fn.ignore_index
        )
        logits, hidden_states = recipe._exit_hidden_states(setup.model(**batch))
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        if not hidden_states:
            return recipe._loss_fn(logits, labels), num_tokens
        loss = early_exit_loss(
            setup.model,
            hidden_states,
            labels,
            recipe._loss_fn,
            recipe._early_exit_loss_scale,
            recipe._early_exit_loss_scale_fn,
        )
        return loss, num_tokens

    def _dpo_loss(self, setup: _Setup) -> torch.Tensor:
        """DPO's loss over ``batch_size`` pairs, with the recipe's
        ``concatenated_forward`` of the policy and (without autograd) the
        reference."""
        recipe, bsz, seq = setup.recipe, int(self.cfg.batch_size), self.seq_len
        batch = (
            torch.randint(0, 2, (2 * bsz, seq)),
            torch.randint(0, 2, (2 * bsz, seq)),
        )
        chosen, rejected, _, _ = recipe.concatenated_forward(recipe._model, batch)
        with torch.no_grad():
            ref_chosen, ref_rejected, _, _ = recipe.concatenated_forward(
                recipe._ref_model, batch
            )
        losses, _, _ = recipe._loss_fn(chosen, rejected, ref_chosen, ref_rejected)
        return losses.mean()

    def _ppo_step(self, setup: _Setup, tracker: Any) -> None:
        """A PPO step as the recipe's loop takes it: the recipe's generation and
        scoring of ``batch_size`` prompts, then its optimization over them (each
        minibatch's forward, backward and optimizer step)."""
        from torchtune import rlhf

        recipe = setup.recipe
        # Token ids other than pad_id (0): prompts without padding.
        input_ids = torch.randint(1, 3, (recipe.batch_size, self.seq_len))
        tracker.phase = "generation"
        # Generation asks whether prompts are padded and whether its KV cache has
        # room: taken as unpadded, and with room (no response stops early).
        fake = isinstance(tracker, _Counting)
        with _TrueWhenAsked() if fake else contextlib.nullcontext():
            trajectory = recipe.generate_trajectory_batched(input_ids)
        rewards, _, _ = rlhf.get_rewards_ppo(
            trajectory.scores,
            trajectory.logprobs,
            trajectory.ref_logprobs,
            recipe._kl_coeff,
            trajectory.value_seq_idxs,
        )
        advantages, returns = rlhf.estimate_advantages(
            trajectory.values,
            rewards,
            recipe._gamma,
            recipe._lmbda,
            masks=~trajectory.response_padding_masks,
        )
        tracker.phase = "forward"
        recipe._optimize(trajectory, advantages, returns, input_ids.shape[1])
        tracker.phase = "between steps"

    def run(self, in_backward: bool) -> tuple[ModeEstimate, _Setup]:
        """Two training steps on fake tensors, counted; the second is reported."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        start = time.perf_counter()
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        setup = self._build(fake_mode, in_backward, count=True)
        tracker = setup.tracker
        device = "cpu" if self.target_device == "cpu" else "cuda"
        patches = _bnb_patch(device), _torchao_patch(), _phase_patch(tracker)
        with patches[0], patches[1], patches[2], fake_mode:
            tracker.track_models(setup.models)
            with tracker:
                peaks = []
                for _ in range(2):
                    step_start = tracker.current
                    tracker.start_peak()
                    self._step(setup, tracker, in_backward)
                    tracker.finish()
                    peaks.append(tracker.peak)
                    # State made in this step is the optimizer's from now on.
                    tracker.label_state(setup.optimizer)
            peak = self._peak(setup, tracker, in_backward)
        seconds = time.perf_counter() - start
        return ModeEstimate(peak, peaks[0], step_start, seconds), setup

    def build_real(self, in_backward: bool) -> _Setup:
        """What :meth:`run` builds, on real CPU tensors (randomly initialized), for
        a measured run of a small config to check the estimate against."""
        return self._build(None, in_backward, count=False)

    def step_real(self, setup: _Setup, in_backward: bool) -> None:
        """One training step of :meth:`build_real`'s setup, as :meth:`run` takes it."""
        device = "cpu" if self.target_device == "cpu" else "cuda"
        with _bnb_patch(device):
            self._step(setup, _Phase(), in_backward)


class _Phase:
    """Where a step is, for a run that counts nothing."""

    phase = ""


@functools.cache
def _recipe_class(recipe: str) -> type:
    """The recipe's class, from the installed recipe file (recipes are files, not
    a package), so that the estimate runs the recipe's own methods."""
    import importlib.util

    import torchtune

    path = Path(torchtune.__file__).parent.parent / "recipes" / f"{recipe}.py"
    spec = importlib.util.spec_from_file_location(
        "_estimated_" + recipe.replace("/", "_"), path
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return next(
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and value.__module__ == module.__name__
        and hasattr(value, "train")
    )


def _pop_name(sizes: dict[int, Any], nbytes: int) -> Any:
    """Take the name of ``nbytes`` out of ``sizes``, with its other sizes."""
    name = sizes[nbytes]
    for key in [k for k, v in sizes.items() if v == name]:
        del sizes[key]
    return name


def _why_held(
    optimizer: Any, param: Any, names: dict, nbytes: int, phase: str
) -> tuple[str, int, str] | None:
    """Why in-backward holds ``param``'s gradient at its peak; ``None`` when it is
    the one being applied (no update can do without it)."""
    name = names.get(param, "?")
    bucket = getattr(optimizer, "_bucket_of", {}).get(param)
    if bucket is None or phase == "update in backward" and not bucket.ready:
        return None
    waiting = len(bucket.params) - len(bucket.ready)
    cap = getattr(optimizer, "_bucket_cap_bytes", 0) / 2**20
    return (
        f"gradient of {name}",
        nbytes,
        f"its bucket (optimizer_in_bwd_bucket_cap_mb={cap:g}) waits for {waiting} "
        f"more of its {len(bucket.params)} parameters' gradients",
    )


@contextlib.contextmanager
def _phase_patch(tracker: _Counting) -> Iterator[None]:
    """Say when an in-backward update runs, and take every step as finite (fake
    tensors have no values to check)."""
    from torchtune.training.memory import OptimizerInBackward

    update = OptimizerInBackward._update

    def tagged_update(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer, tracker.phase = tracker.phase, "update in backward"
        try:
            return update(self, *args, **kwargs)
        finally:
            tracker.phase = outer

    patches = [
        (OptimizerInBackward, "_update", tagged_update),
        (OptimizerInBackward, "_finite", lambda self, value, on_every_rank: True),
    ]
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in originals:
            setattr(obj, name, value)


def _local_bytes(p: torch.Tensor) -> int:
    t = _local(p)
    return t.numel() * t.element_size()


# -- the command line ----------------------------------------------------------------


def _config_path(name: str) -> tuple[Path, str | None]:
    """The YAML file of a config path or a shipped config name, and the recipe the
    shipped config belongs to."""
    from torchtune._recipe_registry import get_all_recipes

    for recipe in get_all_recipes():
        for cfg in recipe.configs:
            if cfg.name == name:
                root = Path(__import__("torchtune").__file__).parent.parent
                return root / "recipes" / "configs" / cfg.file_path, recipe.name
    path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(
            f"--config {name} is neither a file nor a shipped config (`tune ls` lists "
            "them)"
        )
    return path, None


def _seq_len(cfg: DictConfig, given: int | None) -> tuple[int, str]:
    if given is not None:
        return given, "--seq-len"
    tok_len = (cfg.get("tokenizer", None) or {}).get("max_seq_len", None)
    if tok_len is not None:
        return int(tok_len), "tokenizer.max_seq_len; every sample assumed full length"
    return 2048, (
        "tokenizer.max_seq_len is null: 2048 assumed, set --seq-len for your data"
    )


@contextlib.contextmanager
def _fake_process_group(nproc: int) -> Iterator[None]:
    """A process group of ``nproc`` ranks in which this process is rank 0 and every
    collective returns at once, with a CPU device mesh for FSDP2 over it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the estimate needs a process of its own, without a group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=nproc)
    try:
        init_device_mesh("cpu", (nproc,))
        yield
    finally:
        dist.destroy_process_group()


def estimate(
    cfg: DictConfig,
    *,
    recipe: str,
    nproc: int = 1,
    seq_len: int | None = None,
    config_name: str = "",
) -> Estimate:
    """Estimate the per-rank peak memory of ``recipe`` trained with ``cfg``, plain and
    in-backward (``optimizer_in_bwd`` is set either way, whatever ``cfg`` says).

    Args:
        cfg (DictConfig): the recipe config, overrides applied.
        recipe (str): one of :data:`RECIPES`.
        nproc (int): ranks (FSDP2) for a distributed recipe. Default: ``1``
        seq_len (int | None): tokens per sample; ``None``: the tokenizer's
            ``max_seq_len``, or 2048 when that is null. Default: ``None``
        config_name (str): how the report names the config. Default: ``""``

    Returns:
        Estimate: both modes' peaks and what they are made of.

    Raises:
        ValueError: for a recipe the estimate does not reproduce, ``nproc > 1``
            with a single-device recipe, or a QLoRA model.
    """
    if recipe not in RECIPES:
        raise ValueError(
            f"recipe {recipe!r} is not one the estimate reproduces: {sorted(RECIPES)}"
        )
    if nproc > 1 and not RECIPES[recipe]:
        raise ValueError(f"{recipe} runs on one device: --nproc must be 1")
    component = str((cfg.get("model", None) or {}).get("_component_", ""))
    if "qlora_" in component or (cfg.get("model", None) or {}).get("quantize_base"):
        raise ValueError(
            f"model._component_={component} quantizes its base weights to NF4 "
            "(QLoRA), which the estimate cannot build on fake tensors; estimate the "
            "same model's LoRA builder (without qlora_), which counts the base "
            "weights at the training dtype (about 4x their NF4 bytes)"
        )
    length, length_note = _seq_len(cfg, seq_len)
    from torchtune.training.memory import DEFAULT_BUCKET_CAP_MB

    results = {}
    setups = {}
    group = _fake_process_group(nproc) if RECIPES[recipe] else contextlib.nullcontext()
    est_notes: list[str] = []
    with group:
        for in_bwd in (False, True):
            mode_cfg = OmegaConf.merge(
                cfg, {"optimizer_in_bwd": in_bwd, "gradient_accumulation_steps": 1}
            )
            if not in_bwd:
                mode_cfg.pop("optimizer_in_bwd_bucket_cap_mb", None)
            estimator = _Estimator(mode_cfg, recipe, nproc, length)
            results[in_bwd], setups[in_bwd] = estimator.run(in_bwd)
            est_notes = estimator.notes
    setup = setups[False]
    params = [p for model in setup.models for p in model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    state = [
        v
        for s in setup.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    state_bytes = sum(
        s.nbytes() for s in {id(s): s for t in state for s in _storages(t)}.values()
    )
    cls = setup.optimizer.__class__
    paged = 0
    if getattr(setup.optimizer, "is_paged", False):
        # bitsandbytes pages the moments of parameters of 1e5 elements or more.
        for p, s in setup.optimizer.state.items():
            if _local(p).numel() >= 1e5:
                paged += sum(
                    s[k].untyped_storage().nbytes()
                    for k in ("state1", "state2")
                    if isinstance(s.get(k), torch.Tensor)
                )
    notes = list(est_notes)
    if int(cfg.get("gradient_accumulation_steps", 1)) > 1:
        notes.append(
            "gradient_accumulation_steps is set to 1 in both modes (in-backward "
            "cannot accumulate; plain peaks the same for every batch of a step)"
        )
    bucket = cfg.get("optimizer_in_bwd_bucket_cap_mb", None)
    return Estimate(
        config=config_name,
        recipe=recipe,
        nproc=nproc,
        dtype=str(cfg.get("dtype", "fp32")),
        optimizer=f"{cls.__module__}.{cls.__name__}",
        optimizer_note=_optimizer_note(cls),
        batch_size=int(cfg.batch_size),
        seq_len=length,
        seq_len_note=length_note,
        activation_checkpointing=bool(
            cfg.get("enable_activation_checkpointing", False)
        ),
        clip_grad_norm=cfg.get("clip_grad_norm", None),
        bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if bucket is None else bucket,
        params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in trainable),
        param_bytes=sum(_local_bytes(p) for p in params),
        gradient_bytes=sum(_local_bytes(p) for p in trainable),
        optimizer_state_bytes=state_bytes,
        paged_state_bytes=paged,
        plain=results[False],
        in_backward=results[True],
        notes=notes,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m torchtune.training.memory_estimate``: see the module docstring."""
    from torchtune.config._parse import TuneRecipeArgumentParser
    from torchtune.config._utils import _merge_yaml_and_cli_args

    parser = argparse.ArgumentParser(
        prog="python -m torchtune.training.memory_estimate",
        description=(
            "Estimate the per-rank peak memory of a training step, plain and with "
            "optimizer_in_bwd, for a config and the overrides you give tune run. "
            "Nothing model-sized is allocated."
        ),
    )
    parser.add_argument("--config", required=True, help="shipped name or YAML path")
    parser.add_argument(
        "--recipe", help="recipe name; default: the one the shipped config is for"
    )
    parser.add_argument("--nproc", type=int, default=1, help="ranks (FSDP2)")
    parser.add_argument("--seq-len", type=int, help="tokens per sample")
    parser.add_argument("--json", type=Path, help="also write the estimate here")
    args, overrides = parser.parse_known_args(argv)
    path, recipe = _config_path(args.config)
    recipe = args.recipe or recipe
    if recipe is None:
        parser.error("--recipe is needed for a config file that is not shipped")
    yaml_args, _ = TuneRecipeArgumentParser(add_help=False).parse_known_args(
        ["--config", str(path)]
    )
    cfg = _merge_yaml_and_cli_args(yaml_args, overrides)
    est = estimate(
        cfg,
        recipe=recipe,
        nproc=args.nproc,
        seq_len=args.seq_len,
        config_name=args.config,
    )
    print(format_report(est))
    if args.json is not None:
        args.json.write_text(json.dumps(est.to_dict(), indent=1))
    return 0


__all__ = ["Estimate", "ModeEstimate", "Peak", "estimate", "fits", "format_report"]


if __name__ == "__main__":
    sys.exit(main())
