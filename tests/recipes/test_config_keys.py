"""0.6.1 config keys keep working with ``optimizer_in_bwd: True``, as the docs claim.

``docs/source/optimizer_in_backward.rst``: compile of the model and loss works the
same in both modes. ``docs/source/recipes/full_finetune_single_device.rst``:
``dataset.packed``, the HF, Meta and torchtune checkpointer formats, ``compile`` and
``enable_activation_checkpointing`` keep working. ``full_finetune_distributed.rst``:
so do ``enable_activation_checkpointing``, ``custom_sharded_layers``,
``fsdp_reshard_after_forward`` and ``fsdp_cpu_offload``. Each test runs the tiny
Llama2 with the key on, checks that the key took effect (graphs compiled and run,
packs read, layers recomputed, FSDP units, gathered layers, the format written), and
compares the run with in-backward without the key and with plain with the key, on
the same seed and data. On CPU ``fsdp_cpu_offload`` has nothing to move: the recipe
says so in its log and trains without it, which is what the test asserts.

Every single-device run is 2 epochs of 2 steps of AdamW with the cosine schedule and
no warmup (so every step updates the weights and the losses of steps 2 to 4 depend
on the updates), in this process (``run_tune_in_process``). The distributed runs are
one launch of 2 processes, forked from a preloaded server (not from this process,
which has compiled), that trains four configurations in turn, 4 steps each.

Tolerances, from the arithmetic [measured on x86 CPU, 2 cores, torch 2.13]:

- ``BITWISE_TRAINING``: the same kernels on the same values. Activation checkpointing recomputes
  each layer's forward with the same kernels; the Meta and torchtune checkpoints
  hold exactly the HF checkpoint's weights (the conversions only rename and permute);
  a resume reloads exact fp32 weights and optimizer state; dynamo's ``aot_eager``
  backend runs the traced aten ops eagerly, the same kernels as without compile; an
  FSDP2 gradient is the same sum of the two ranks' contributions whichever FSDP unit
  holds it, and keeping a layer gathered changes no value. [all bitwise: losses,
  grad_norm and lr]
- ``ACROSS_MODES``: in-backward and plain multiply the same gradients by the same
  ``world_size / tokens`` with the same operations (inside backward, or after it) and
  measure them the same way, so they agree bitwise too, compiled, packed, with a
  list of datasets, with activation checkpointing and on two processes. [0]
- Learning rates depend on the step count only: ``BITWISE_TRAINING`` everywhere.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.assets.make_assets import TINY_MODEL_KWARGS, TinyAssets
from tests.recipes.utils import (
    BITWISE_TRAINING,
    TuneRun,
    as_indexed,
    assert_same_training,
    full_optimizer_state,
    load_recipe_class,
    read_run,
    run_tune_in_process,
    series,
    tiny_config,
)
from tests.torchtune.distributed_launcher import run_distributed, write_report

pytestmark = pytest.mark.integration_test

EPOCHS, STEPS_PER_EPOCH = 2, 2
ALL_STEPS = range(1, EPOCHS * STEPS_PER_EPOCH + 1)
EPOCH_1 = range(STEPS_PER_EPOCH + 1, EPOCHS * STEPS_PER_EPOCH + 1)
NUM_LAYERS = TINY_MODEL_KWARGS["num_layers"]
SINGLE_DEVICE_CONFIG = tiny_config("tiny_full_single_device")
SHARD = "model-00001-of-00001"  # the weight file 0.6.1's checkpointers write

# rtol for the loss and the grad norm (module docstring).
ACROSS_MODES = BITWISE_TRAINING
TIMEOUT_S = 240  # a collective reached by only some ranks hangs: fail instead


# -- helpers -------------------------------------------------------------------


@dataclass
class CountedRun:
    """A run, and what its fixture counted during it."""

    run: TuneRun
    counts: dict[str, int]


def _mode(optimizer_in_bwd: bool) -> dict[str, Any]:
    return {"optimizer_in_bwd": optimizer_in_bwd, "clip_grad_norm": None}


@pytest.fixture(scope="module")
def train_single(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., TuneRun]:
    """``tune run full_finetune_single_device`` of the tiny config, in this process."""

    def train(
        name: str,
        output_dir: Path | None = None,
        config: Path = SINGLE_DEVICE_CONFIG,
        **overrides: Any,
    ) -> TuneRun:
        settings = {
            "assets_dir": tiny_assets.root,
            "epochs": EPOCHS,
            "max_steps_per_epoch": STEPS_PER_EPOCH,
            "lr_scheduler.num_warmup_steps": 0,
        }
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the subprocess runs of the other tests
        try:
            return run_tune_in_process(
                "full_finetune_single_device",
                config,
                settings | overrides,
                output_dir or tmp_path_factory.mktemp(name),
            )
        finally:
            torch.set_num_threads(threads)

    return train


@pytest.fixture(scope="module")
def in_bwd(train_single: Callable[..., TuneRun]) -> CountedRun:
    """The reference: in-backward, HF checkpoint, no compile, no activation
    checkpointing, unpacked data; counts the layers' forward calls."""
    with pytest.MonkeyPatch.context() as mp:
        counter = _CountLayerForwards(mp)
        run = train_single("in_bwd", **_mode(True))
    assert run.losses[-1] < run.losses[0] - 0.1, run.losses  # it learns
    return CountedRun(run, {"layer_forwards": counter.calls})


class _CountLayerForwards:
    """Counts calls of ``TransformerSelfAttentionLayer.forward`` (recomputations
    included) while installed."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        from torchtune.modules import TransformerSelfAttentionLayer

        self.calls = 0
        forward = TransformerSelfAttentionLayer.forward

        def counted(layer, *args, **kwargs):
            self.calls += 1
            return forward(layer, *args, **kwargs)

        mp.setattr(TransformerSelfAttentionLayer, "forward", counted)


# -- compile ---------------------------------------------------------------------

# A dynamo backend that counts the calls of the graphs it compiled and runs them with
# aot_eager: AOT autograd traces forward and backward, then runs the aten ops eagerly.
# That is the path compile takes with any backend (autograd through a compiled
# graph, whose gradients reach the in-backward hooks when its backward ends),
# without inductor's code generation, which costs minutes on this CPU.
COUNTING_BACKEND = "test_config_keys_counting_aot_eager"
_compiled_graph_calls = {"layer": 0, "loss": 0}


def _counting_aot_eager(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    # The loss's graph takes logits (vocabulary-sized last dimension); a layer's
    # takes hidden states and its own weights, none of them vocabulary-sized.
    kind = (
        "loss"
        if any(
            isinstance(t, torch.Tensor)
            and t.dim() > 0
            and t.shape[-1] == TINY_MODEL_KWARGS["vocab_size"]
            for t in example_inputs
        )
        else "layer"
    )

    def run(*args: Any) -> Any:
        _compiled_graph_calls[kind] += 1
        return compiled(*args)

    return run


# Under every step's grad norm of the tiny run (they are above 1): clips each step.
CLIP_GRAD_NORM = 0.5


@pytest.fixture(scope="module")
def compiled_runs(
    train_single: Callable[..., TuneRun],
) -> Iterator[dict[str, CountedRun]]:
    """``compile=True`` in each mode, without clipping and with ``clip_grad_norm``
    (``in_bwd_clipped``, ``plain_clipped``); the recipes compile through torchtune's
    ``compile_model`` / ``compile_loss``, which take the backend from
    ``TORCH_COMPILE_BACKEND`` (default inductor). Graphs are compiled for dynamic
    shapes from the first step (as after a batch of another length), so their
    backward is compiled ahead of time, with donated buffers by default: the case
    a clipped in-backward step, which runs a compiled backward twice, failed on."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if COUNTING_BACKEND not in _COMPILER_FNS:
        register_backend(_counting_aot_eager, name=COUNTING_BACKEND)
    runs = {}
    with (
        pytest.MonkeyPatch.context() as mp,
        torch._functorch.config.patch(donated_buffer=True),  # torch's default
        torch._dynamo.config.patch(assume_static_by_default=False),
    ):
        mp.setenv("TORCH_COMPILE_BACKEND", COUNTING_BACKEND)
        for name, optimizer_in_bwd, clip in (
            ("in_bwd", True, None),
            ("plain", False, None),
            ("in_bwd_clipped", True, CLIP_GRAD_NORM),
            ("plain_clipped", False, CLIP_GRAD_NORM),
        ):
            before = dict(_compiled_graph_calls)
            torch._dynamo.reset()  # each run compiles its graphs, as a new process
            run = train_single(
                f"compile_{name}",
                compile=True,
                **_mode(optimizer_in_bwd) | {"clip_grad_norm": clip},
            )
            runs[name] = CountedRun(
                run, {k: n - before[k] for k, n in _compiled_graph_calls.items()}
            )
    yield runs
    # Later tests in this process start with no graph compiled by this backend.
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["in_bwd", "plain", "in_bwd_clipped", "plain_clipped"])
def test_compile_runs_the_compiled_model_and_loss(
    compiled_runs: dict[str, CountedRun], mode: str
) -> None:
    counts = compiled_runs[mode].counts
    # Each layer's forward is one graph (no graph break): it runs once per layer
    # and step. The compiled cross-entropy runs once per output chunk (up to 8 per
    # step: fewer when a batch has fewer than 8 positions to split).
    assert counts["layer"] == NUM_LAYERS * len(ALL_STEPS), counts
    assert counts["loss"] >= len(ALL_STEPS), counts


def test_compile_in_backward_matches_compile_plain(
    compiled_runs: dict[str, CountedRun],
) -> None:
    assert_same_training(
        compiled_runs["in_bwd"].run, compiled_runs["plain"].run, ACROSS_MODES, ALL_STEPS
    )


def test_compile_with_clipping_in_backward_matches_compile_plain(
    compiled_runs: dict[str, CountedRun],
) -> None:
    clipped, plain = (
        compiled_runs["in_bwd_clipped"].run,
        compiled_runs["plain_clipped"].run,
    )
    assert_same_training(clipped, plain, ACROSS_MODES, ALL_STEPS)
    # Clipping acted: every step's norm is above the limit, and the run differs
    # from the unclipped one after its first update.
    assert bool((series(plain, "grad_norm", ALL_STEPS) > CLIP_GRAD_NORM).all())
    unclipped = compiled_runs["in_bwd"].run
    assert (
        series(clipped, "loss", EPOCH_1).tolist()
        != series(unclipped, "loss", EPOCH_1).tolist()
    )


def test_compile_in_backward_matches_in_backward_without_compile(
    compiled_runs: dict[str, CountedRun], in_bwd: CountedRun
) -> None:
    # aot_eager runs the same aten kernels as eager mode (module docstring).
    assert_same_training(
        compiled_runs["in_bwd"].run, in_bwd.run, BITWISE_TRAINING, ALL_STEPS
    )


# -- packed datasets -------------------------------------------------------------


@pytest.fixture(scope="module")
def packed_runs(
    train_single: Callable[..., TuneRun],
) -> dict[str, CountedRun]:
    """``dataset.packed=True`` (packs of ``tokenizer.max_seq_len=128`` tokens, the
    tiny config's) in each mode; counts the packs the recipe reads."""
    from torchtune.datasets import PackedDataset

    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        packs_read = [0]
        getitem = PackedDataset.__getitem__

        def counted(self, index):
            packs_read[0] += 1
            return getitem(self, index)

        mp.setattr(PackedDataset, "__getitem__", counted)
        for name, optimizer_in_bwd in (("in_bwd", True), ("plain", False)):
            packs_read[0] = 0
            run = train_single(
                f"packed_{name}", **{"dataset.packed": True}, **_mode(optimizer_in_bwd)
            )
            runs[name] = CountedRun(run, {"packs_read": packs_read[0]})
    return runs


def test_packed_dataset_trains_in_backward_as_plain(
    packed_runs: dict[str, CountedRun], in_bwd: CountedRun
) -> None:
    for counted in packed_runs.values():
        # 4 steps of batch_size=8 packs (the loader may read a few ahead).
        assert counted.counts["packs_read"] >= len(ALL_STEPS) * 8, counted.counts
    # Packed batches are other sequences than padded ones: another first loss.
    assert packed_runs["in_bwd"].run.losses[0] != in_bwd.run.losses[0]
    assert_same_training(
        packed_runs["in_bwd"].run, packed_runs["plain"].run, ACROSS_MODES, ALL_STEPS
    )


# -- a list of datasets -----------------------------------------------------------


@pytest.fixture(scope="module")
def dataset_list_runs(
    tiny_assets: TinyAssets,
    train_single: Callable[..., TuneRun],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, CountedRun]:
    """``dataset`` as a list of two (the tiny training and held-out data), in each
    mode; counts the examples read through the concatenation."""
    from torchtune.datasets import ConcatDataset

    cfg = OmegaConf.load(SINGLE_DEVICE_CONFIG)
    cfg.dataset = [
        {**OmegaConf.to_container(cfg.dataset), "data_files": str(path)}
        for path in (tiny_assets.train_data, tiny_assets.test_data)
    ]
    # A list cannot be given on the command line: a config file that has it.
    config = tmp_path_factory.mktemp("dataset_list_config") / "tiny_datasets.yaml"
    OmegaConf.save(cfg, config)
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        read = [0]
        getitem = ConcatDataset.__getitem__

        def counted(self, index):
            read[0] += 1
            return getitem(self, index)

        mp.setattr(ConcatDataset, "__getitem__", counted)
        for name, optimizer_in_bwd in (("in_bwd", True), ("plain", False)):
            read[0] = 0
            run = train_single(
                f"datasets_{name}", config=config, **_mode(optimizer_in_bwd)
            )
            runs[name] = CountedRun(run, {"examples_read": read[0]})
    return runs


def test_dataset_list_trains_in_backward_as_plain(
    dataset_list_runs: dict[str, CountedRun], in_bwd: CountedRun
) -> None:
    for counted in dataset_list_runs.values():
        # 4 steps of batch_size=8 examples (the loader may read a few ahead).
        assert counted.counts["examples_read"] >= len(ALL_STEPS) * 8, counted.counts
    # The concatenation is longer, so the shuffled order, and the first batch, differ.
    assert dataset_list_runs["in_bwd"].run.losses[0] != in_bwd.run.losses[0]
    assert_same_training(
        dataset_list_runs["in_bwd"].run,
        dataset_list_runs["plain"].run,
        ACROSS_MODES,
        ALL_STEPS,
    )


# -- activation checkpointing, single device -------------------------------------


@pytest.fixture(scope="module")
def checkpointed_runs(train_single: Callable[..., TuneRun]) -> dict[str, CountedRun]:
    """``enable_activation_checkpointing=True`` in each mode, counting layer forwards."""
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        counter = _CountLayerForwards(mp)
        for name, optimizer_in_bwd in (("in_bwd", True), ("plain", False)):
            counter.calls = 0
            run = train_single(
                f"ac_{name}",
                enable_activation_checkpointing=True,
                **_mode(optimizer_in_bwd),
            )
            runs[name] = CountedRun(run, {"layer_forwards": counter.calls})
    return runs


def test_activation_checkpointing_recomputes_every_layer_in_backward(
    checkpointed_runs: dict[str, CountedRun], in_bwd: CountedRun
) -> None:
    # Without checkpointing a step runs each layer's forward once; with it, twice:
    # once in forward and once recomputed in backward.
    assert in_bwd.counts["layer_forwards"] == NUM_LAYERS * len(ALL_STEPS)
    for counted in checkpointed_runs.values():
        assert counted.counts["layer_forwards"] == 2 * NUM_LAYERS * len(ALL_STEPS)


def test_activation_checkpointing_in_backward_matches_without_it_and_plain(
    checkpointed_runs: dict[str, CountedRun], in_bwd: CountedRun
) -> None:
    assert_same_training(
        checkpointed_runs["in_bwd"].run, in_bwd.run, BITWISE_TRAINING, ALL_STEPS
    )
    assert_same_training(
        checkpointed_runs["in_bwd"].run,
        checkpointed_runs["plain"].run,
        ACROSS_MODES,
        ALL_STEPS,
    )


# -- checkpointer formats ----------------------------------------------------------


# Per format: the checkpointer, the file name to write the input checkpoint under,
# and one key that names a weight in that format (the first layer's query projection).
FORMATS = {
    "meta": (
        "torchtune.training.FullModelMetaCheckpointer",
        "consolidated.00.pth",
        "layers.0.attention.wq.weight",
    ),
    "torchtune": (
        "torchtune.training.FullModelTorchTuneCheckpointer",
        "model.pt",
        "layers.0.attn.q_proj.weight",
    ),
}


@pytest.fixture(scope="module", params=list(FORMATS))
def format_run(
    request: pytest.FixtureRequest,
    tiny_assets: TinyAssets,
    train_single: Callable[..., TuneRun],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """The tiny HF checkpoint converted to a format, a 2-epoch in-backward run from
    it, and that run resumed from its epoch-0 checkpoint (in its format) in a fresh
    output_dir."""
    from torchtune.models.convert_weights import hf_to_tune, tune_to_meta

    name = request.param
    component, filename, key = FORMATS[name]
    kwargs = tiny_assets.model_kwargs
    weights = hf_to_tune(
        load_file(tiny_assets.checkpoint_dir / tiny_assets.checkpoint_files[0]),
        num_heads=kwargs["num_heads"],
        num_kv_heads=kwargs["num_kv_heads"],
        dim=kwargs["embed_dim"],
    )
    if name == "meta":
        weights = tune_to_meta(weights)
    assert key in weights
    checkpoint_dir = tmp_path_factory.mktemp(f"{name}_checkpoint")
    torch.save(weights, checkpoint_dir / filename)
    checkpointer = {
        "checkpointer._component_": component,
        "checkpointer.checkpoint_dir": checkpoint_dir,
        "checkpointer.checkpoint_files": [filename],
    }
    keep = {"checkpointer.keep_last_n_checkpoints": EPOCHS}
    run = train_single(f"{name}_format", **checkpointer, **keep, **_mode(True))
    # What torchtune 0.6.1 left after epoch 0: the epoch's weights in the format's
    # own files, and its recipe state with the optimizer state, which a 0.6.1 resume
    # points at.
    resumed_dir = tmp_path_factory.mktemp(f"{name}_format_resumed")
    shutil.copytree(run.output_dir / "epoch_0", resumed_dir / "epoch_0")
    epoch_end = run.output_dir / f"step_{STEPS_PER_EPOCH}"
    (resumed_dir / "recipe_state").mkdir()
    torch.save(
        {
            "optimizer": as_indexed(full_optimizer_state(epoch_end)),
            "seed": 0,
            "epochs_run": 1,
            "total_epochs": EPOCHS,
            "max_steps_per_epoch": STEPS_PER_EPOCH,
        },
        resumed_dir / "recipe_state" / "recipe_state.pt",
    )
    resumed = train_single(
        f"{name}_format_resumed",
        output_dir=resumed_dir,
        resume_from_checkpoint=True,
        **checkpointer
        | {
            "checkpointer.checkpoint_files": [f"epoch_0/{SHARD}.bin"],
            "checkpointer.recipe_checkpoint": "recipe_state/recipe_state.pt",
        },
        **_mode(True),
    )
    return {"run": run, "resumed": resumed, "keys": set(weights), "key": key}


def test_checkpointer_format_trains_and_resumes_as_the_hf_format(
    format_run: dict[str, Any], in_bwd: CountedRun
) -> None:
    run, resumed = format_run["run"], format_run["resumed"]
    # The same weights as the HF checkpoint, so the same run, bitwise.
    assert_same_training(run, in_bwd.run, BITWISE_TRAINING, ALL_STEPS)
    # The epoch-0 checkpoint it wrote is in its own format (the input's key names)...
    saved = torch.load(run.output_dir / "epoch_0" / f"{SHARD}.bin", weights_only=True)
    assert format_run["key"] in saved
    assert set(saved) == format_run["keys"]
    # ...and resuming from it continues the uninterrupted run, bitwise.
    assert_same_training(
        resumed, in_bwd.run, BITWISE_TRAINING, EPOCH_1, reference_steps=ALL_STEPS
    )


# -- full_finetune_distributed: activation checkpointing and the FSDP keys ---------

# The distributed runs clip at a norm every one of their steps exceeds, so the
# clipping in backward runs through activation checkpointing and every FSDP layout.
DISTRIBUTED_CLIP = 1.0
DISTRIBUTED_RUNS = {
    # The reference: in-backward with the tiny config's FSDP settings.
    "in_bwd": {"optimizer_in_bwd": True},
    "in_bwd_keys": {
        "optimizer_in_bwd": True,
        "enable_activation_checkpointing": True,
        "custom_sharded_layers": ["tok_embeddings", "output"],
        "fsdp_reshard_after_forward": False,
        "fsdp_cpu_offload": True,
    },
    "plain_keys": {
        "optimizer_in_bwd": False,
        "enable_activation_checkpointing": True,
        "custom_sharded_layers": ["tok_embeddings", "output"],
        "fsdp_reshard_after_forward": False,
        "fsdp_cpu_offload": True,
    },
    # Selective activation checkpointing of every 2nd layer: the second of two.
    "in_bwd_selective_ac": {
        "optimizer_in_bwd": True,
        "ac_mode": "selective",
        "ac_option": 2,
    },
}
CPU_OFFLOAD_IGNORED = (
    "fsdp_cpu_offload=True is ignored on CPU, which has nothing to move."
)


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _distributed_runs(out_dir: Path) -> None:
    """Each forked rank: train every config of ``DISTRIBUTED_RUNS`` in turn, from
    ``out_dir/<name>.yaml``, and report ``"ok"`` or the traceback for each, and what
    the run did with the keys (``"<name> facts"``, JSON)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from torchtune.modules import TransformerSelfAttentionLayer

    recipe_cls = load_recipe_class(
        "full_finetune_distributed", "FullFinetuneRecipeDistributed"
    )
    rank, first_port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    report: dict[str, str] = {}
    logger = logging.getLogger("torchtune.utils._logging")  # the recipes' logger
    with pytest.MonkeyPatch.context() as mp:
        counter = _CountLayerForwards(mp)
        for i, name in enumerate(DISTRIBUTED_RUNS):
            # Each run starts its own process group (its cleanup destroys it).
            os.environ["MASTER_PORT"] = str(first_port + i)
            cfg = OmegaConf.load(out_dir / f"{name}.yaml")
            messages = _Messages()
            logger.addHandler(messages)
            counter.calls = 0
            try:
                recipe = recipe_cls(cfg)
                recipe.setup(cfg)
                recipe.train()
                model = recipe._model
                facts = {
                    "layer_forwards": counter.calls,
                    "sharded_on_their_own": [
                        n
                        for n in ("tok_embeddings", "output")
                        if isinstance(getattr(model, n), FSDPModule)
                    ],
                    "cpu_offload_ignored": CPU_OFFLOAD_IGNORED in messages.messages,
                }
                # After a forward, FSDP2 leaves a layer's parameters as sharded
                # DTensors if it resharded them, as the gathered tensors if not.
                with torch.no_grad():
                    model(torch.arange(8).view(1, 8))
                facts["layer_params_after_forward"] = sorted(
                    {
                        "sharded" if isinstance(p, DTensor) else "gathered"
                        for m in model.modules()
                        if isinstance(m, TransformerSelfAttentionLayer)
                        for p in m.parameters()
                    }
                )
                recipe.cleanup()
                report[f"{name} facts"] = json.dumps(facts)
                report[name] = "ok"
            except Exception:
                report[name] = traceback.format_exc()
            finally:
                logger.removeHandler(messages)
                if torch.distributed.is_initialized():
                    torch.distributed.destroy_process_group()
    write_report(out_dir, rank, report)


@pytest.fixture(scope="module")
def distributed_runs(
    tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """The configs of ``DISTRIBUTED_RUNS`` on 2 processes (batch_size 4 per rank),
    1 epoch of 4 steps each, in one launch: per config, its run and each rank's
    facts. The ranks are forked from the preloaded server: no interpreter start or
    import is paid, and nothing this process compiled comes with the fork."""
    out = tmp_path_factory.mktemp("full_finetune_distributed")
    for name, overrides in DISTRIBUTED_RUNS.items():
        cfg = OmegaConf.load(tiny_config("tiny_full_distributed"))
        cfg.merge_with(
            {
                "assets_dir": str(tiny_assets.root),
                "output_dir": str(out / name),
                "epochs": 1,
                "max_steps_per_epoch": len(ALL_STEPS),
                "clip_grad_norm": DISTRIBUTED_CLIP,
                "lr_scheduler": {"num_warmup_steps": 0},
                **overrides,
            }
        )
        OmegaConf.save(cfg, out / f"{name}.yaml")
    launch = run_distributed(
        __name__, "_distributed_runs", out, timeout_s=TIMEOUT_S, start="preloaded"
    )
    runs = {}
    for name in DISTRIBUTED_RUNS:
        assert launch.outcome(name) == "ok", launch.outcome(name)
        runs[name] = {
            "run": read_run(out / name),
            "facts": [json.loads(r[f"{name} facts"]) for r in launch.reports],
        }
    return runs


def test_distributed_custom_sharded_layers_are_sharded_on_their_own(
    distributed_runs: dict[str, dict[str, Any]],
) -> None:
    # Without the key, the embedding and the output projection belong to the root's
    # FSDP unit; with it, each is an FSDP unit of its own, on every rank.
    assert all(
        f["sharded_on_their_own"] == [] for f in distributed_runs["in_bwd"]["facts"]
    )
    for name in ("in_bwd_keys", "plain_keys"):
        for facts in distributed_runs[name]["facts"]:
            assert facts["sharded_on_their_own"] == ["tok_embeddings", "output"]


def test_distributed_fsdp_reshard_after_forward_false_keeps_layers_gathered(
    distributed_runs: dict[str, dict[str, Any]],
) -> None:
    for facts in distributed_runs["in_bwd"]["facts"]:
        assert facts["layer_params_after_forward"] == ["sharded"]
    for name in ("in_bwd_keys", "plain_keys"):
        for facts in distributed_runs[name]["facts"]:
            assert facts["layer_params_after_forward"] == ["gathered"]


def test_distributed_fsdp_cpu_offload_is_ignored_on_cpu_with_a_message(
    distributed_runs: dict[str, dict[str, Any]],
) -> None:
    # On CPU the parameters are in CPU memory already (and FSDP's offload pins
    # memory, which needs an accelerator): the recipe says so and trains without it.
    assert not any(
        f["cpu_offload_ignored"] for f in distributed_runs["in_bwd"]["facts"]
    )
    for name in ("in_bwd_keys", "plain_keys"):
        assert all(f["cpu_offload_ignored"] for f in distributed_runs[name]["facts"])


def test_distributed_activation_checkpointing_recomputes_every_layer(
    distributed_runs: dict[str, dict[str, Any]],
) -> None:
    # The runs clip: an in-backward step backpropagates twice (measure, then
    # update), and a checkpointed layer is recomputed in each pass.
    steps = len(ALL_STEPS)
    for facts in distributed_runs["in_bwd"]["facts"]:
        assert facts["layer_forwards"] == NUM_LAYERS * steps
    for facts in distributed_runs["in_bwd_keys"]["facts"]:
        assert facts["layer_forwards"] == 3 * NUM_LAYERS * steps
    for facts in distributed_runs["plain_keys"]["facts"]:
        assert facts["layer_forwards"] == 2 * NUM_LAYERS * steps
    # ac_mode=selective, ac_option=2: one layer of the two is recomputed.
    for facts in distributed_runs["in_bwd_selective_ac"]["facts"]:
        assert facts["layer_forwards"] == (NUM_LAYERS + 2) * steps


def test_distributed_keys_train_in_backward_as_without_them_and_as_plain(
    distributed_runs: dict[str, dict[str, Any]],
) -> None:
    in_bwd = distributed_runs["in_bwd"]["run"]
    assert in_bwd.losses[-1] < in_bwd.losses[0] - 0.1, in_bwd.losses  # it learns
    keys = distributed_runs["in_bwd_keys"]["run"]
    # Recomputed layers, other FSDP units, gathered layers kept: the same values
    # through the same kernels, and each gradient the same sum of the two ranks'.
    assert_same_training(keys, in_bwd, BITWISE_TRAINING, ALL_STEPS)
    selective = distributed_runs["in_bwd_selective_ac"]["run"]
    assert_same_training(selective, in_bwd, BITWISE_TRAINING, ALL_STEPS)
    plain_keys = distributed_runs["plain_keys"]["run"]
    # All clipped.
    assert (series(plain_keys, "grad_norm", ALL_STEPS) > DISTRIBUTED_CLIP).all()
    assert_same_training(keys, plain_keys, ACROSS_MODES, ALL_STEPS)
