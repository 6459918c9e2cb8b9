"""``full_dpo_distributed`` on CPU with gloo.

The tiny Llama2 of ``tests/assets`` is aligned on the preference pairs of
``tests/assets/make_dpo_assets.py`` (``tests/recipes/configs/tiny_full_dpo_distributed.yaml``,
2 epochs of ``STEPS`` steps, 8 pairs a step); its reference model is the same
checkpoint. Every claim is an equivalence between runs on the same seed and data:

- 2 processes, in-backward vs plain: the same loss, pair metrics (rewards, log
  probabilities, logits) and grad norm at every step;
- resumed from a step checkpoint vs uninterrupted, in each save mode: plain ->
  in-backward from the one written in the background at epoch 0's end
  (``step_3``), and in-backward -> in-backward mid-epoch from the synchronous one of
  step 4 (``save_every_n_steps``, copied alone into a fresh ``output_dir``);
- resumed from a torchtune 0.6.1 epoch-0 checkpoint (made from ``step_3``: the
  ``epoch_0`` weights and ``recipe_state/recipe_state.pt``, its optimizer state in
  0.6.1's in-backward format) vs uninterrupted, in both modes;
- 1 process vs 2 at the same global batch.

Besides: the shipped ``llama3_1/8B_full_dpo`` config trains on the tiny assets as
shipped (plain fused AdamW, gradient accumulation, bf16, activation checkpointing)
and with ``optimizer_in_bwd=True``. (That an optimizer FSDP2 cannot train is
refused first is ``test_shared_refusals.py``'s, for every distributed recipe.)

The runs are ``tune run`` on processes forked from a preloaded server
(``run_tune_forked``: real processes, with what torchrun gives each rank, without an
interpreter start and imports per run), two runs at a time, started on first use,
shared by the tests of this module.

Tolerances, from the arithmetic (measured on these runs in brackets):

- ``BITWISE``: the same kernels on the same values in the same process layout. DPO's
  loss is a mean over pairs and every batch holds ``batch_size`` pairs, so both modes
  backpropagate the same loss (no normalization after backward): the gradients are
  bitwise the same, and each parameter is updated by the same single-tensor AdamW
  kernel (the CPU default) whether in backward or after it. Hence loss and pair
  metrics agree bitwise across modes, and everything agrees bitwise between a run
  resumed from exact fp32 weights and optimizer state and the uninterrupted one.
  The grad norm and its clipping too: the in-backward optimizer measures each
  gradient with the plain path's kernel and combines the norms in parameter order,
  as the plain path does, and clips by the same coefficient. Every run clips at
  ``CLIP``, which the grad norm crosses (the parity test checks that some steps
  clip and some do not). [0]
- ``ACROSS_LAYOUTS`` (``rtol=1e-5``, ``atol=1e-6``): 1 process pads its batch of 8
  to the longest of all 8 pairs, 2 processes pad 4 each and reduce-scatter partial
  sums: matmuls block differently and sums add in another order, a few ulps per op,
  carried a little further by each update; other CPUs may block differently again,
  hence the margin. The absolute floor is for the rewards, which are small
  differences of much larger terms (``beta`` times a difference of two summed
  log-probabilities of about 20: 0.1 * 20 * 6e-8 ~ 1e-7 of absolute rounding).
  [losses 8.9e-8 relative, grad norms 4.8e-7, log-probabilities 8.5e-8, rewards
  7.2e-8 absolute]

A wrong normalization (the loss not averaged over ranks, or over accumulated
batches) shows in ``grad_norm`` by a factor of 2 or more, far beyond these.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

import torchtune
from tests.assets.make_assets import TinyAssets
from tests.assets.make_dpo_assets import write_preference_data
from tests.helpers import BITWISE
from tests.recipes.utils import (
    TuneRun,
    as_0_6_1_in_backward,
    assert_metrics_close,
    assert_series_close,
    process_state,
    run_tune_forked,
    shipped_config_overrides,
    step_state,
    tiny_config,
)
from tests.torchtune.distributed_launcher import preloaded_context

pytestmark = pytest.mark.integration_test

RECIPE = "full_dpo_distributed"
CONFIG = tiny_config("tiny_full_dpo_distributed")
SHIPPED_CONFIG = (
    Path(torchtune.__file__).parent.parent
    / "recipes"
    / "configs"
    / "llama3_1"
    / "8B_full_dpo.yaml"
)
EPOCHS, STEPS = 2, 3
ALL_STEPS = range(1, EPOCHS * STEPS + 1)
EPOCH_1 = range(STEPS + 1, EPOCHS * STEPS + 1)
# The in-backward run saves a step checkpoint every SAVE_EVERY steps and at each
# epoch's end; RESUME_STEP is one of them, in the middle of epoch 1.
SAVE_EVERY, RESUME_STEP = 2, 4
AFTER_RESUME_STEP = range(RESUME_STEP + 1, EPOCHS * STEPS + 1)
PAIRS_PER_STEP = 8
# Several runs share 2 cores; a collective reached by only some ranks hangs: fail.
TIMEOUT_S = 300

# The grad norm every run clips at: the tiny policy's norms cross it.
CLIP = 0.45
ACROSS_LAYOUTS = {"rtol": 1e-5, "atol": 1e-6}

# What the recipe logs for the pairs, besides loss, lr and grad_norm.
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "log_probs/chosen",
    "log_probs/rejected",
    "logits/chosen",
    "logits/rejected",
)
# Everything a step logs that both runs compute alike (the lr: from the step count).
EVERY_METRIC = ("loss", "grad_norm", "lr", *PAIR_METRICS)


class Runs:
    """The module's runs (2 processes; 1 for ``one_process`` and the shipped config),
    two at a time.

    ``runs[name]`` waits for the run ``name`` and returns it (or raises what it
    raised). Resumed runs wait for the run they resume from, then start.
    """

    def __init__(self, root: Path, assets: TinyAssets) -> None:
        self._root = root
        self._assets = assets
        # The server the ranks fork from starts here, before any thread does.
        preloaded_context()
        # Two 2-process runs at a time keep both cores busy while one waits (on a
        # collective, on a save); the runs they resume from are submitted first.
        self._pool = ThreadPoolExecutor(max_workers=2)
        self._futures: dict[str, Future[TuneRun]] = {}
        self._submit(
            "in_bwd",
            self._train,
            "in_bwd",
            optimizer_in_bwd=True,
            save_every_n_steps=SAVE_EVERY,
            # Kept once the run is done: the resumes below start from them.
            **{"checkpointer.keep_last_n_checkpoints": 10},
        )
        self._submit(
            "plain_async",
            self._train,
            "plain_async",
            optimizer_in_bwd=False,
            # Its step checkpoints are saved asynchronously. Without
            # save_every_n_steps only the newest is kept: keep epoch 0's too.
            enable_async_checkpointing=True,
            **{"checkpointer.keep_last_n_checkpoints": EPOCHS},
        )
        self._submit(
            "in_bwd_from_step",
            self._resume_from_step,
            "in_bwd",
            "in_bwd_from_step",
            RESUME_STEP,
            optimizer_in_bwd=True,
            save_every_n_steps=SAVE_EVERY,
        )
        self._submit(
            "in_bwd_from_plain_async",
            self._resume,
            "plain_async",
            "in_bwd_from_plain_async",
            optimizer_in_bwd=True,
            enable_async_checkpointing=True,
        )
        # 0.6.1's DPO configs turn activation checkpointing on, which put its
        # wrapper in the names 0.6.1 saved: the in-backward resume has it on too.
        self._submit(
            "in_bwd_from_0_6_1",
            self._resume,
            "in_bwd",
            "in_bwd_from_0_6_1",
            edit=partial(_rewrite_as_0_6_1_in_backward, checkpoint_wrapped=True),
            optimizer_in_bwd=True,
            enable_activation_checkpointing=True,
        )
        self._submit(
            "plain_from_0_6_1",
            self._resume,
            "in_bwd",
            "plain_from_0_6_1",
            edit=partial(_rewrite_as_0_6_1_in_backward, checkpoint_wrapped=False),
            optimizer_in_bwd=False,
        )
        # batch_size is per rank: 1 x 8 = 2 x 4, the same pairs each step.
        self._submit(
            "one_process",
            self._fork,
            "one_process",
            CONFIG,
            self._settings(batch_size=PAIRS_PER_STEP, optimizer_in_bwd=True),
            nproc=1,
        )
        self._submit(
            "shipped",
            self._fork,
            "shipped",
            SHIPPED_CONFIG,
            self._shipped_overrides(),
            nproc=1,
        )
        # As a user turns it on: in-backward cannot accumulate gradients.
        self._submit(
            "shipped_in_bwd",
            self._fork,
            "shipped_in_bwd",
            SHIPPED_CONFIG,
            self._shipped_overrides(
                optimizer_in_bwd=True, gradient_accumulation_steps=1
            ),
            nproc=1,
        )

    def _submit(self, name: str, fn: Callable[..., TuneRun], *args, **kwargs) -> None:
        self._futures[name] = self._pool.submit(fn, *args, **kwargs)

    def __getitem__(self, name: str) -> TuneRun:
        return self._futures[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _settings(self, **overrides: Any) -> dict[str, Any]:
        return {
            "assets_dir": self._assets.root,
            "epochs": EPOCHS,
            "max_steps_per_epoch": STEPS,
            "clip_grad_norm": CLIP,
            **overrides,
        }

    def _train(self, name: str, **overrides: Any) -> TuneRun:
        """2 processes of the tiny config with ``overrides``."""
        return self._fork(name, CONFIG, self._settings(**overrides))

    def _fork(
        self,
        name: str,
        config: Path,
        overrides: dict[str, Any] | list[str],
        nproc: int = 2,
    ) -> TuneRun:
        """``tune run`` on ``nproc`` forked processes (``run_tune_forked``)."""
        return run_tune_forked(
            RECIPE,
            config,
            overrides,
            nproc=nproc,
            output_dir=self._root / name,
            timeout=TIMEOUT_S,
        )

    def _resume(
        self,
        source_name: str,
        name: str,
        edit: Callable[[Path], None] | None = None,
        **overrides: Any,
    ) -> TuneRun:
        """Resume ``source_name`` from the step checkpoint of epoch 0's end, in a
        copy of its output_dir without the step checkpoints further along, as
        torchtune 0.6.1's docs say to: the checkpoint files pointed at ``epoch_0``'s
        export. ``edit`` may rewrite the copy into a torchtune 0.6.1 epoch
        checkpoint, whose weights the configured checkpointer reads from there.
        """
        source = self[source_name]
        later = [f"step_{s}" for s in range(STEPS + 1, EPOCHS * STEPS + 1)]
        shutil.copytree(
            source.output_dir,
            self._root / name,
            ignore=shutil.ignore_patterns(".hf_datasets_cache", *later),
        )
        if edit is not None:
            edit(self._root / name)
        weights = "epoch_0/model-00001-of-00001.safetensors"
        overrides["checkpointer.checkpoint_files"] = [weights]
        return self._train(name, resume_from_checkpoint=True, **overrides)

    def _resume_from_step(
        self, source_name: str, name: str, step: int, **overrides: Any
    ) -> TuneRun:
        """Resume ``source_name`` from its step checkpoint ``step_{step}``, copied
        alone into a fresh output_dir, naming no file: the recipe finds it."""
        source = self[source_name]
        folder = f"step_{step}"
        shutil.copytree(source.output_dir / folder, self._root / name / folder)
        return self._train(name, resume_from_checkpoint=True, **overrides)

    def _shipped_overrides(self, **settings: Any) -> list[str]:
        """``llama3_1/8B_full_dpo`` as shipped, with what this machine forces: the
        tiny model, tokenizer and preference data, both checkpointers on the tiny
        checkpoint, the CPU; and ``settings``."""
        assets = self._assets
        tiny_checkpoint = {
            "_component_": "torchtune.training.FullModelHFCheckpointer",
            "checkpoint_dir": assets.checkpoint_dir,
            "checkpoint_files": list(assets.checkpoint_files),
            "model_type": "LLAMA2",
        }
        return shipped_config_overrides(
            assets,
            SHIPPED_CONFIG,
            {
                "dataset._component_": "torchtune.datasets.preference_dataset",
                "dataset.source": "json",
                "dataset.data_files": assets.root / "preference_train.json",
                "dataset.split": "train",
                **{f"ref_checkpointer.{k}": v for k, v in tiny_checkpoint.items()},
                # The shipped run is 1000 steps of 4 x 8 pairs; one such step here,
                # with the seed fixed for a repeatable test.
                "max_steps_per_epoch": 1,
                "seed": 0,
                **settings,
            },
        )


def _full_step_checkpoint(step_dir: Path) -> dict[str, Any]:
    """The model and optimizer state of the sharded step checkpoint ``step_dir``,
    gathered into full tensors (keyed by the policy's parameter names)."""
    return step_state(step_dir)


def _rewrite_as_0_6_1_in_backward(output_dir: Path, *, checkpoint_wrapped: bool):
    """Rewrite ``output_dir`` as torchtune 0.6.1's DPO recipe left it after epoch 0
    with ``optimizer_in_bwd``: the ``epoch_0`` weights and
    ``recipe_state/recipe_state.pt``, which holds the optimizer state of the step
    checkpoint of epoch 0's end as 0.6.1 saved it (``as_0_6_1_in_backward``).
    Nothing of this patch set's checkpoints is left, nor anything after epoch 0.
    """
    saved = _full_step_checkpoint(output_dir / f"step_{STEPS}")["optimizer"]
    legacy = as_0_6_1_in_backward(saved, checkpoint_wrapped=checkpoint_wrapped)
    for entry in output_dir.iterdir():
        if entry.name.startswith(("step_", "epoch_")) and entry.name != "epoch_0":
            shutil.rmtree(entry)
    (output_dir / "torchtune_run.json").unlink()
    (output_dir / ".epoch_0.manifest.json").unlink()
    (output_dir / "recipe_state").mkdir()
    torch.save(
        {
            "optimizer": legacy,
            "seed": 0,
            "epochs_run": 1,
            "total_epochs": EPOCHS,
            "max_steps_per_epoch": STEPS,
        },
        output_dir / "recipe_state" / "recipe_state.pt",
    )


@pytest.fixture(scope="module")
def preference_data(tiny_assets: TinyAssets) -> Path:
    """The preference pairs, next to the other tiny assets (``${assets_dir}``)."""
    return write_preference_data(tiny_assets.root)


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_assets: TinyAssets,
    preference_data: Path,
):
    started = Runs(tmp_path_factory.mktemp("full_dpo_distributed"), tiny_assets)
    yield started
    started.close()


def test_preference_data_pairs_a_right_and_a_wrong_answer_to_one_prompt(
    preference_data: Path, tiny_assets: TinyAssets
) -> None:
    from torchtune.datasets import preference_dataset
    from torchtune.models.llama2 import llama2_tokenizer

    tokenizer = llama2_tokenizer(
        str(tiny_assets.tokenizer_path), max_seq_len=128, prompt_template=None
    )
    dataset = preference_dataset(
        tokenizer, source="json", data_files=str(preference_data), split="train"
    )
    assert len(dataset) >= EPOCHS * STEPS * PAIRS_PER_STEP
    for sample in (dataset[i] for i in range(len(dataset))):
        chosen, rejected = sample["chosen_input_ids"], sample["rejected_input_ids"]
        assert chosen != rejected
        # train_on_input=False: only the answer (and the end of sequence) is labelled.
        answer = [t for t in sample["chosen_labels"] if t != -100]
        assert 0 < len(answer) < len(chosen)
        prompt = len(chosen) - len(answer)
        assert chosen[:prompt] == rejected[:prompt]


def test_in_backward_matches_plain_on_two_processes(runs: Runs) -> None:
    in_bwd, plain = runs["in_bwd"], runs["plain_async"]
    assert list(in_bwd.metrics) == list(ALL_STEPS)
    assert set(PAIR_METRICS) <= set(in_bwd.metrics[1])
    # It learns: the policy starts as the reference (loss ln 2, rewards 0) and
    # comes to prefer the right answers.
    assert in_bwd.metrics[1]["loss"] == pytest.approx(math.log(2))
    assert in_bwd.metrics[1]["rewards/chosen"] == 0.0
    last = in_bwd.metrics[ALL_STEPS[-1]]
    assert last["loss"] < in_bwd.metrics[1]["loss"]
    assert last["rewards/margins"] > 0 and last["rewards/accuracies"] > 0.5
    # Mean over the global batch: a multiple of 1 / PAIRS_PER_STEP.
    for values in in_bwd.metrics.values():
        pairs_won = values["rewards/accuracies"] * PAIRS_PER_STEP
        assert pairs_won == pytest.approx(round(pairs_won), abs=1e-6)

    norms = torch.tensor([plain.metrics[s]["grad_norm"] for s in ALL_STEPS])
    assert (norms > CLIP).any() and (norms < CLIP).any(), norms
    assert_metrics_close(in_bwd, plain, EVERY_METRIC, ALL_STEPS, **BITWISE)


def test_in_backward_resume_from_plain_async_epoch_0_equals_uninterrupted_run(
    runs: Runs,
) -> None:
    resumed, uninterrupted = runs["in_bwd_from_plain_async"], runs["plain_async"]
    # Each epoch's end wrote a sharded step checkpoint, in the background.
    step_dirs = {p.name for p in uninterrupted.output_dir.glob("step_*")}
    assert step_dirs == {f"step_{STEPS}", f"step_{EPOCHS * STEPS}"}
    step_checkpoint = uninterrupted.output_dir / f"step_{STEPS}"
    assert (step_checkpoint / ".metadata").is_file()
    copied = resumed.output_dir / step_checkpoint.name
    assert f"Resumed from step checkpoint {copied}." in resumed.output
    assert list(resumed.metrics) == list(EPOCH_1)
    # The plain run's AdamW state, loaded from DCP into the in-backward optimizer,
    # gives the same updates (module docstring).
    assert_metrics_close(resumed, uninterrupted, EVERY_METRIC, EPOCH_1, **BITWISE)


def test_in_backward_resume_from_mid_epoch_step_checkpoint_equals_uninterrupted_run(
    runs: Runs,
) -> None:
    uninterrupted = runs["in_bwd"]
    # Every SAVE_EVERY steps, and at each epoch's end before the epoch export.
    step_dirs = {p.name for p in uninterrupted.output_dir.glob("step_*")}
    assert step_dirs == {"step_2", "step_3", "step_4", "step_6"}
    # One DCP checkpoint: each rank's shards and its own dataloader position.
    step_checkpoint = uninterrupted.output_dir / f"step_{RESUME_STEP}"
    assert (step_checkpoint / ".metadata").is_file()
    assert set(process_state(step_checkpoint, "dataloader")) == {"rank_0", "rank_1"}

    resumed = runs["in_bwd_from_step"]
    # Found without being named, and continued from step RESUME_STEP + 1.
    copied = resumed.output_dir / step_checkpoint.name
    assert f"Resumed from step checkpoint {copied}." in resumed.output
    assert list(resumed.metrics) == list(AFTER_RESUME_STEP)
    # The same mode, kernels and values: bitwise (module docstring).
    assert_metrics_close(
        resumed, uninterrupted, EVERY_METRIC, AFTER_RESUME_STEP, **BITWISE
    )


@pytest.mark.parametrize("name", ["in_bwd_from_0_6_1", "plain_from_0_6_1"])
def test_resume_from_a_0_6_1_in_backward_checkpoint_equals_uninterrupted_run(
    name: str, runs: Runs
) -> None:
    resumed, uninterrupted = runs[name], runs["in_bwd"]
    assert "Resumed from step checkpoint" not in resumed.output
    assert list(resumed.metrics) == list(EPOCH_1)
    # Same updates in either mode (module docstring). Moments that failed to load
    # would restart AdamW's bias correction and move the losses after the first and
    # the weights by far more.
    assert_metrics_close(resumed, uninterrupted, EVERY_METRIC, EPOCH_1, **BITWISE)
    final = f"epoch_{EPOCHS - 1}/model-00001-of-00001.safetensors"
    assert_close(
        load_file(resumed.output_dir / final),
        load_file(uninterrupted.output_dir / final),
        **BITWISE,
    )


def test_two_processes_match_one_process_at_the_same_global_batch(
    runs: Runs,
) -> None:
    two, one = runs["in_bwd"], runs["one_process"]
    # Not logits/*: as in 0.6.1 they average every logit of the batch, padding
    # included, and how much padding a batch has depends on how it is split.
    assert_metrics_close(
        two,
        one,
        ("loss", "grad_norm", *PAIR_METRICS[: PAIR_METRICS.index("logits/chosen")]),
        ALL_STEPS,
        **ACROSS_LAYOUTS,
    )
    assert_series_close(two, one, "lr", ALL_STEPS, **BITWISE)


def test_checkpoints_hold_the_trained_policy_and_its_optimizer_state(
    runs: Runs, tiny_assets: TinyAssets
) -> None:
    run = runs["in_bwd"]
    base = load_file(tiny_assets.checkpoint_dir / tiny_assets.checkpoint_files[0])
    final = load_file(
        run.output_dir / f"epoch_{EPOCHS - 1}" / "model-00001-of-00001.safetensors"
    )
    assert final.keys() == base.keys()
    for key, tensor in final.items():
        assert tensor.shape == base[key].shape and tensor.dtype == base[key].dtype
    assert any(not torch.equal(final[k], base[k]) for k in final)
    # The last step checkpoint holds the policy alone (the reference is frozen and
    # read from ref_checkpointer) and its optimizer: one AdamW state per policy
    # parameter, in the plain format whichever mode saved it.
    step = _full_step_checkpoint(run.output_dir / f"step_{EPOCHS * STEPS}")
    assert len(step["model"]) == len(base)
    saved = step["optimizer"]
    assert saved["state"].keys() == step["model"].keys()
    assert {"step", "exp_avg", "exp_avg_sq"} <= set(next(iter(saved["state"].values())))


@pytest.mark.parametrize("name", ["shipped", "shipped_in_bwd"])
def test_shipped_llama3_1_8B_full_dpo_config_trains_on_cpu(
    name: str, runs: Runs
) -> None:
    from omegaconf import OmegaConf

    run = runs[name]
    shipped = OmegaConf.load(SHIPPED_CONFIG)
    # As shipped: DPOLoss and fused AdamW, in bf16 with activation checkpointing;
    # plain, with 8 accumulated batches of 4 pairs a step (the in-backward run: 1).
    assert shipped.loss._component_ == "torchtune.rlhf.loss.DPOLoss"
    assert shipped.optimizer.fused and shipped.enable_activation_checkpointing
    assert shipped.gradient_accumulation_steps == 8 and shipped.batch_size == 4
    assert not shipped.get("optimizer_in_bwd", False)
    assert list(run.metrics) == [1]
    values = run.metrics[1]
    assert set(PAIR_METRICS) <= set(values)
    # The policy starts as the reference.
    assert values["loss"] == pytest.approx(math.log(2))
    assert math.isfinite(values["grad_norm"]) and values["grad_norm"] > 0
    # The shipped warmup: lr rises linearly over num_warmup_steps steps.
    warmup = shipped.lr_scheduler.num_warmup_steps
    assert values["lr"] == pytest.approx(shipped.optimizer.lr / warmup)
    # Saved in the shipped dtype.
    (shard,) = (run.output_dir / "epoch_0").glob("*.safetensors")
    assert {t.dtype for t in load_file(shard).values()} == {torch.bfloat16}
