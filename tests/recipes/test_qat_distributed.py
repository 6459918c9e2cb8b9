"""``qat_distributed`` on CPU with 2 gloo processes: quantization-aware training with
int8 dynamic activation + int4 weight fake quantization (torchao's
``Int8DynActInt4WeightQATQuantizer``, groupsize 32), which runs on CPU.

Every claim is an equivalence between runs on the same seed and data:

- in-backward vs plain, with fake quantization on;
- resumed from epoch 0 vs uninterrupted: in-backward from its own step checkpoint
  of epoch 0's end (``step_2``), and plain from a torchtune 0.6.1 epoch-0 checkpoint
  made of the in-backward run's, its optimizer state in 0.6.1's in-backward layout
  (with activation checkpointing and separately sharded layers added);
- resumed from the in-backward run's mid-epoch step checkpoint (``step_1``, before
  fake quantization starts) vs uninterrupted;
- 2 processes vs 1 at the same global batch;
- fake quantization off for ``fake_quant_after_n_steps`` steps, then on.

And a partly frozen model's checkpoint holds the optimizer state of every parameter,
as 0.6.1's and the other recipes' do; a linear layer the model builder froze stays
frozen, although the quantizer's prepare replaces it.

Every run is 2 epochs x 2 steps of the tiny Llama2 (``tiny_qat_distributed.yaml``,
fake quantization from step 3), shared through module-scoped fixtures: six runs in
all, each ``tune run`` on processes forked from a preloaded server
(``run_tune_forked``: real processes, with what torchrun gives each rank, without an
interpreter start and imports per run), the partly frozen one on 1 process.
Refusals run in this process. The shipped configs are checked to resolve (components and keys), not run:
neither sets ``optimizer_in_bwd: True``.

The data: the tiny instruct set, whose answers have different lengths, so every
step divides by another token count. Both modes backpropagate the token sum and
multiply the gradients by ``world_size / tokens`` with the same operations (after
backward, or inside it per bucket), and clip them the same way, so they reach the
same gradients bit for bit. This matters for QAT: fake quantization rounds each
weight and activation to a coarse grid, so a weight one ulp apart can land on the
next grid point and change the loss by orders of magnitude more than the ulp. (When
in-backward runs divided the loss before backward instead, their losses drifted
5e-4 relative from the plain run's within three steps on this data.) The in-backward
and plain runs (every subprocess run here) clip at ``CLIP``, which their grad norm
crosses.

Tolerances, from the arithmetic (observed on x86 CPU in brackets):

- ``BITWISE_TRAINING`` for losses, grad norms and lr between the modes and for every resume:
  the same values through the same kernels, as above [0].
- ``ACROSS_LAYOUTS`` for 2 processes vs 1: per-rank partial sums and a
  reduce-scatter add the same terms in another order, a few ulps per op. Compared on
  the steps before fake quantization starts, where nothing amplifies them [loss
  and grad_norm within 1e-7 relative]. 1e-5 leaves room for other CPUs' kernels.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.assets.make_assets import TinyAssets
from tests.helpers import snapshot_files
from tests.recipes.partly_frozen_model import partly_frozen_llama2
from tests.recipes.utils import (
    BITWISE_TRAINING,
    TuneRun,
    assert_same_training,
    full_optimizer_state,
    process_state,
    run_tune_forked,
    run_tune_in_process,
    series,
    tiny_config,
    tolerances,
)

pytestmark = pytest.mark.integration_test

RECIPE = "qat_distributed"
CONFIG = tiny_config("tiny_qat_distributed")
EPOCHS, STEPS = 2, 2  # the tiny config's run length
ALL_STEPS = range(1, EPOCHS * STEPS + 1)
EPOCH_0, EPOCH_1 = range(1, STEPS + 1), range(STEPS + 1, EPOCHS * STEPS + 1)
FAKE_QUANT_AFTER = 2  # the tiny config's fake_quant_after_n_steps
SHARD = "model-00001-of-00001.safetensors"
TIMEOUT_S = 240  # a collective reached by only some ranks hangs: fail instead

# rtol for the loss and the grad norm (module docstring).
# The grad norm the in-backward and plain runs clip at: their norms cross it.
CLIP = 4.0
ACROSS_LAYOUTS = tolerances(1e-5, 1e-5)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("qat_distributed")


@pytest.fixture(scope="module")
def train_data(tiny_assets: TinyAssets) -> Path:
    """The tiny instruct set: answers of every length (see the module docstring)."""
    return Path(tiny_assets.train_data)


def _train(
    out: Path, assets: TinyAssets, data: Path, *, nproc: int = 2, **overrides: Any
) -> TuneRun:
    base = {
        "assets_dir": assets.root,
        "dataset.data_files": data,
        "clip_grad_norm": CLIP,
    }
    return run_tune_forked(
        RECIPE, CONFIG, base | overrides, nproc=nproc, output_dir=out, timeout=TIMEOUT_S
    )


def _resume(
    source: TuneRun, out: Path, assets: TinyAssets, data: Path, **overrides: Any
) -> TuneRun:
    """Resume from the step checkpoint of ``source``'s epoch 0 end, in a fresh
    output_dir that holds what epoch 0 left (its export and manifest, that step
    checkpoint and the run's id), as torchtune 0.6.1's docs say to: the checkpoint
    files pointed at the epoch's export."""
    for part in ("epoch_0", f"step_{STEPS}"):
        shutil.copytree(source.output_dir / part, out / part)
    for name in ("torchtune_run.json", ".epoch_0.manifest.json"):
        shutil.copy(source.output_dir / name, out / name)
    docs = {"checkpointer.checkpoint_files": [f"epoch_0/{SHARD}"]}
    run = _train(out, assets, data, resume_from_checkpoint=True, **docs, **overrides)
    assert f"Resumed from step checkpoint {out / f'step_{STEPS}'}." in run.output
    assert list(run.metrics) == list(EPOCH_1), run.metrics
    return run


def _resume_0_6_1(out: Path, assets: TinyAssets, data: Path, **overrides: Any):
    """Resume from the torchtune 0.6.1 epoch-0 checkpoint in ``out`` (``epoch_0``
    and ``recipe_state/recipe_state.pt``), naming both, as 0.6.1's users did."""
    run = _train(
        out,
        assets,
        data,
        resume_from_checkpoint=True,
        **{
            "checkpointer.checkpoint_files": [f"epoch_0/{SHARD}"],
            "checkpointer.recipe_checkpoint": "recipe_state/recipe_state.pt",
        },
        **overrides,
    )
    assert list(run.metrics) == list(EPOCH_1), run.metrics
    return run


# A step checkpoint after every step: step_1 and step_3 land mid-epoch. Saving them
# changes no loss, grad_norm or lr of the run (checked bitwise against a run without).
# All of them kept once the run is done: the resumes start from them.
STEP_CHECKPOINTS = {
    "save_every_n_steps": 1,
    "checkpointer.keep_last_n_checkpoints": 10,
}


@pytest.fixture(scope="module")
def in_bwd(runs_dir: Path, tiny_assets: TinyAssets, train_data: Path) -> TuneRun:
    """The reference: in-backward on 2 processes, with step checkpoints."""
    return _train(
        runs_dir / "in_bwd",
        tiny_assets,
        train_data,
        **STEP_CHECKPOINTS,
    )


@pytest.fixture(scope="module")
def plain(runs_dir: Path, tiny_assets: TinyAssets, train_data: Path) -> TuneRun:
    return _train(
        runs_dir / "plain",
        tiny_assets,
        train_data,
        optimizer_in_bwd=False,
    )


def test_in_backward_matches_plain_bitwise_with_fake_quantization(
    in_bwd: TuneRun, plain: TuneRun
) -> None:
    assert list(in_bwd.metrics) == list(ALL_STEPS)
    assert in_bwd.losses[-1] < in_bwd.losses[0]  # it learns
    norms = series(plain, "grad_norm", ALL_STEPS)
    assert (norms > CLIP).any() and (norms < CLIP).any(), norms
    assert_same_training(in_bwd, plain, BITWISE_TRAINING, ALL_STEPS)


@pytest.fixture(scope="module")
def one_process_without_fake_quant(
    runs_dir: Path, tiny_assets: TinyAssets, train_data: Path
) -> TuneRun:
    """1 process with batch 8 (the 2 x 4 samples of a 2-process step), fake
    quantization never on."""
    return _train(
        runs_dir / "one_process",
        tiny_assets,
        train_data,
        nproc=1,
        batch_size=8,
        fake_quant_after_n_steps=EPOCHS * STEPS,
    )


def test_two_processes_match_one_process_at_the_same_global_batch(
    in_bwd: TuneRun, one_process_without_fake_quant: TuneRun
) -> None:
    # Both runs train unquantized until the 2-process run turns fake quantization
    # on: step 2's loss already reflects the first update, both grad_norms the
    # normalization over ranks.
    assert_same_training(
        one_process_without_fake_quant,
        in_bwd,
        ACROSS_LAYOUTS,
        EPOCH_0,
        run_steps=ALL_STEPS,
        reference_steps=ALL_STEPS,
    )


def test_fake_quantization_is_off_for_fake_quant_after_n_steps_then_on(
    in_bwd: TuneRun, one_process_without_fake_quant: TuneRun
) -> None:
    assert "Step 0: fake quantization disabled." in in_bwd.output
    assert f"Step {FAKE_QUANT_AFTER}: fake quantization enabled." in in_bwd.output
    # From step 3 the 2-process run fake-quantizes and the 1-process run does not:
    # the quantization error moves the loss far more than the layouts' rounding
    # (1.2e-3 relative at step 3, measured).
    step = FAKE_QUANT_AFTER + 1
    with_fq = in_bwd.metrics[step]["loss"]
    without_fq = one_process_without_fake_quant.metrics[step]["loss"]
    rtol = ACROSS_LAYOUTS["loss"]["rtol"]
    assert abs(with_fq - without_fq) > 100 * rtol * abs(without_fq)


def test_in_backward_resume_from_epoch_0_equals_uninterrupted_run(
    in_bwd: TuneRun, runs_dir: Path, tiny_assets: TinyAssets, train_data: Path
) -> None:
    resumed = _resume(in_bwd, runs_dir / "in_bwd_from_in_bwd", tiny_assets, train_data)
    # It starts past fake_quant_after_n_steps, so it keeps the fake quantization
    # that prepare() turned on (and the losses below show it is on).
    assert "fake quantization disabled" not in resumed.output
    assert_same_training(
        resumed, in_bwd, BITWISE_TRAINING, EPOCH_1, reference_steps=ALL_STEPS
    )


def test_in_backward_resume_from_a_mid_epoch_step_checkpoint_equals_uninterrupted_run(
    in_bwd: TuneRun, runs_dir: Path, tiny_assets: TinyAssets, train_data: Path
) -> None:
    """``step_1`` alone in a fresh output_dir, and the same command again with
    ``resume_from_checkpoint=True``, naming no file: it continues mid-epoch 0, with the
    QAT-prepared model's shards and optimizer state each rank saved, its dataloader
    position and RNG, and fake quantization set from the resumed step count: off for
    step 2, on from step 3."""
    step_1 = in_bwd.output_dir / "step_1"
    assert (step_1 / ".metadata").is_file()
    assert set(process_state(step_1, "dataloader")) == {"rank_0", "rank_1"}
    out = runs_dir / "in_bwd_from_step_1"
    shutil.copytree(step_1, out / "step_1")
    resumed = _train(
        out,
        tiny_assets,
        train_data,
        resume_from_checkpoint=True,
        **STEP_CHECKPOINTS,
    )
    assert f"Resumed from step checkpoint {out.resolve() / 'step_1'}." in (
        resumed.output
    )
    assert "Step 1: fake quantization disabled." in resumed.output
    assert f"Step {FAKE_QUANT_AFTER}: fake quantization enabled." in resumed.output
    resumed_steps = range(2, EPOCHS * STEPS + 1)
    assert_same_training(
        resumed, in_bwd, BITWISE_TRAINING, resumed_steps, reference_steps=ALL_STEPS
    )


def test_plain_resumes_a_0_6_1_in_backward_checkpoint_as_the_run_went_on(
    in_bwd: TuneRun, runs_dir: Path, tiny_assets: TinyAssets, train_data: Path
) -> None:
    """The in-backward run's epoch 0, its optimizer state rewritten the way torchtune
    0.6.1's qat_distributed saved in-backward runs of the shipped configs, which turn
    activation checkpointing on: one full optimizer state dict per parameter, keyed
    by the parameter's name in the wrapped model (``layers.0._checkpoint_wrapped_
    module.attn.q_proj.weight``). Resumed with the plain optimizer.

    Also with activation checkpointing and the embeddings and output sharded on their
    own, as the shipped configs have them: recomputing the forward and grouping the
    parameters differently change no value, so the losses stay bitwise equal.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        _CHECKPOINT_PREFIX,
    )

    from torchtune import modules, training
    from torchtune.models.llama2 import llama2

    with torch.device("meta"):
        model = llama2(**tiny_assets.model_kwargs)
    training.set_activation_checkpointing(
        model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
    )
    wrapped_names = [name for name, _ in model.named_parameters()]
    assert any(_CHECKPOINT_PREFIX in name for name in wrapped_names)

    # 0.6.1's epoch-0 checkpoint: the export, and the recipe state of epoch 0's end
    # (the optimizer state of the step checkpoint there).
    out = runs_dir / "plain_from_0_6_1"
    shutil.copytree(in_bwd.output_dir / "epoch_0", out / "epoch_0")
    optimizer = full_optimizer_state(in_bwd.output_dir / f"step_{STEPS}")
    state = {
        training.SEED_KEY: 0,
        training.EPOCHS_KEY: 1,
        training.TOTAL_EPOCHS_KEY: EPOCHS,
        training.MAX_STEPS_KEY: STEPS,
    }
    (group,) = optimizer["param_groups"]
    # The inner state dicts came from torch's full-state API: unwrapped names.
    state[training.OPT_KEY] = {
        wrapped: {
            "state": {name: optimizer["state"][name]},
            "param_groups": [group | {"params": [name]}],
        }
        for wrapped in wrapped_names
        for name in [wrapped.replace(_CHECKPOINT_PREFIX, "")]
    }
    assert sorted(optimizer["state"]) == sorted(
        entry["param_groups"][0]["params"][0]
        for entry in state[training.OPT_KEY].values()
    )
    (out / "recipe_state").mkdir()
    torch.save(state, out / "recipe_state" / "recipe_state.pt")

    resumed = _resume_0_6_1(
        out,
        tiny_assets,
        train_data,
        optimizer_in_bwd=False,
        enable_activation_checkpointing=True,
        custom_sharded_layers=["tok_embeddings", "output"],
    )
    assert_same_training(
        resumed, in_bwd, BITWISE_TRAINING, EPOCH_1, reference_steps=ALL_STEPS
    )


def test_final_checkpoint_holds_the_unquantized_trained_weights_under_the_base_keys(
    in_bwd: TuneRun, tiny_assets: TinyAssets
) -> None:
    base = {}
    for name in tiny_assets.checkpoint_files:
        base |= load_file(tiny_assets.checkpoint_dir / name)
    final = load_file(in_bwd.output_dir / f"epoch_{EPOCHS - 1}" / SHARD)
    # Fake quantization adds no weights and changes no names or dtypes.
    assert final.keys() == base.keys()
    for key, tensor in final.items():
        assert tensor.shape == base[key].shape and tensor.dtype == base[key].dtype, key
    assert any(not torch.equal(final[k], base[k]) for k in final)


def test_rank_0_alone_writes_the_epoch_checkpoints(in_bwd: TuneRun) -> None:
    # Every rank takes part in gathering the full state; only rank 0 writes it, once
    # (the checkpointer names each file it writes at the final epoch; before it, the
    # manager names the export).
    out = in_bwd.output_dir
    final = f"{out / f'epoch_{EPOCHS - 1}' / SHARD}"
    assert in_bwd.output.count(f" saved to {final}\n") == 1, final
    for epoch in range(EPOCHS - 1):
        exported = f"Epoch {epoch}'s weights exported to {out / f'epoch_{epoch}'} ("
        assert in_bwd.output.count(exported) == 1, exported


# A partly frozen model: the embedding (in FSDP's root unit, beside trainable
# weights), the norms of a layer and one of its linear layers (in that layer's
# unit). The quantizer's prepare swaps every linear layer for a fake-quantized one
# with new, trainable weights; the recipe keeps the frozen one frozen.
FROZEN = ["tok_embeddings", "layers.0.sa_norm", "layers.0.mlp_norm", "layers.0.mlp.w1"]


def test_a_partly_frozen_models_optimizer_state_holds_every_parameter(
    runs_dir: Path, tiny_assets: TinyAssets, train_data: Path
) -> None:
    """The optimizer is built over every parameter, frozen ones included, as 0.6.1's
    qat_distributed and every other recipe build it: frozen ones get no state. So the
    checkpoint lists the same parameters as theirs; an optimizer over the trainable
    parameters only listed fewer, and its checkpoints did not interchange with
    theirs. A frozen linear layer stays frozen through the quantizer's prepare:
    its weight is the base checkpoint's, and it has no optimizer state."""
    run = _train(
        runs_dir / "partly_frozen",
        tiny_assets,
        train_data,
        nproc=1,
        batch_size=8,
        clip_grad_norm=None,
        **{
            "model._component_": (
                "tests.recipes.partly_frozen_model.partly_frozen_llama2"
            ),
            "model.frozen": FROZEN,
            # The step checkpoint of the last epoch's end, kept to be read below.
            "checkpointer.keep_last_n_checkpoints": 1,
        },
    )
    assert list(run.metrics) == list(ALL_STEPS)
    model = partly_frozen_llama2(FROZEN, **tiny_assets.model_kwargs)
    names = [name for name, _ in model.named_parameters()]
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert 0 < len(trainable) < len(names)
    # The step checkpoint of the last epoch's end.
    saved = full_optimizer_state(run.output_dir / f"step_{EPOCHS * STEPS}")
    (group,) = saved["param_groups"]
    assert group["params"] == names
    assert sorted(saved["state"]) == sorted(trainable)
    assert "layers.0.mlp.w1.weight" in names
    assert "layers.0.mlp.w1.weight" not in saved["state"]
    # And the frozen weights are the base checkpoint's, the others trained.
    base = load_file(tiny_assets.checkpoint_dir / tiny_assets.checkpoint_files[0])
    final = load_file(run.output_dir / f"epoch_{EPOCHS - 1}" / SHARD)
    for key in (
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.gate_proj.weight",  # layers.0.mlp.w1, a linear layer
    ):
        assert torch.equal(final[key], base[key]), key
    for key in (
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ):
        assert not torch.equal(final[key], base[key]), key


def _registered_configs() -> list[tuple[str, Path]]:
    """Every config registered for this recipe, with its file in the installed package."""
    import torchtune
    from torchtune._recipe_registry import get_all_recipes

    configs_dir = Path(torchtune.__file__).parent.parent / "recipes" / "configs"
    (recipe,) = [r for r in get_all_recipes() if r.name == RECIPE]
    return [(c.name, configs_dir / c.file_path) for c in recipe.configs]


REGISTERED = _registered_configs()


@pytest.mark.parametrize(("name", "path"), REGISTERED, ids=[n for n, _ in REGISTERED])
def test_every_upstream_config_of_the_recipe_resolves(name: str, path: Path) -> None:
    from torchtune import config, training

    cfg = OmegaConf.load(path)
    # Each component exists and takes the keys the config gives it.
    config.validate(cfg)
    mode = training.quantization.get_quantizer_mode(config.instantiate(cfg.quantizer))
    assert mode is not None and "qat" in mode, mode


NOT_QAT = "torchtune.training.quantization.Int8DynActInt4WeightQuantizer"
# The refusals that are this recipe's own; those it shares with the other recipes
# (RecipeOptions, CheckpointManager) are tested once for all in test_shared_refusals.
REFUSALS = {
    "compile": (
        ["compile=True"],
        "compile=True is not supported by qat_distributed: it does not compile "
        "fake-quantized layers. Set compile=False.",
    ),
    "not_a_qat_quantizer": (
        [f"quantizer._component_={NOT_QAT}"],
        f"quantizer._component_={NOT_QAT} is not a QAT quantizer (mode 8da4w): "
        "fine-tuning needs one that fake-quantizes, e.g. "
        "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer.",
    ),
    "no_quantizer": (
        ["quantizer=null"],
        "qat_distributed needs a quantizer, e.g. quantizer._component_="
        "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer.",
    ),
    "fake_quant_after_n_steps": (
        ["fake_quant_after_n_steps=-1"],
        "fake_quant_after_n_steps must be null or an integer >= 0, got -1.",
    ),
}


@pytest.mark.parametrize("key", REFUSALS)
def test_refused_config_fails_with_its_message_and_leaves_output_dir_untouched(
    key: str, in_bwd: TuneRun, tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    import torch.distributed as dist

    # An output_dir that holds a finished run's checkpoints and logs.
    out = tmp_path / "out"
    shutil.copytree(in_bwd.output_dir, out)
    before = snapshot_files(out)
    overrides, message = REFUSALS[key]
    # ``tune run`` without --nproc_per_node runs the recipe in this process: the
    # refusal must come before the process group, the model or any file.
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        run_tune_in_process(
            RECIPE, CONFIG, [f"assets_dir={tiny_assets.root}", *overrides], out
        )
    assert not dist.is_initialized()
    assert snapshot_files(out) == before
