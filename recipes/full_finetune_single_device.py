"""Full fine-tuning of a decoder LLM on one device.

Run it with ``tune run full_finetune_single_device --config <config>``; ``tune ls``
lists the shipped configs.
"""

import os
import sys
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, ListConfig
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from tqdm import tqdm

from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training.checkpointing._checkpoint_client import TrainingProgress

log = utils.get_logger("DEBUG")


class FullFinetuneRecipeSingleDevice(FTRecipeInterface):
    """Full fine-tuning of a dense decoder (Llama2, Llama3, Qwen2, ...) on one device.

    Features, each driven by the config key named:

    - Precision (``dtype``): fp32 or bf16 for weights, activations, gradients and
      optimizer state.
    - Optimizer (``optimizer``, ``optimizer_in_bwd``): any ``torch.optim.Optimizer``,
      including bitsandbytes' low-precision ones. With ``optimizer_in_bwd: True`` each
      parameter is updated inside backward as soon as its gradient is ready and its
      gradient is freed at once, so gradients of the whole model never coexist. The
      optimizer is then a :class:`~torchtune.training.OptimizerInBackward`, which looks
      like the plain optimizer to everything else: LR schedulers, ``get_lr``,
      ``step``/``zero_grad`` and checkpoints are the same in both modes, and a
      checkpoint written in one mode resumes in the other.
      ``optimizer_in_bwd_bucket_cap_mb`` sets how many MiB of gradients one
      update in backward takes (default 4; 0: each parameter on its own).
    - Loss normalization: a step's update is the gradient of the mean loss over every
      target token of the step. Plain runs backpropagate the token sum of each batch
      and divide the accumulated gradients by the step's token count; in-backward runs
      backpropagate the batch's mean loss (there is one batch per step). Both compute
      the same update, up to float rounding.
    - Gradient accumulation (``gradient_accumulation_steps``) and clipping
      (``clip_grad_norm``; null means no clipping). ``grad_norm`` is logged in both
      modes: the pre-clipping norm in plain runs, the norm the optimizer recorded in
      in-backward runs.
    - LR scheduling (``lr_scheduler``, optional).
    - Memory (``enable_activation_checkpointing``, ``enable_activation_offloading``).
    - ``torch.compile`` (``compile``): a bool compiles the model and the loss, as in
      0.6.1; a mapping with keys ``model``, ``loss`` and ``optimizer_step`` picks them
      one by one (``optimizer_step`` compiles the plain optimizer's ``step``; with
      torch 2.13 a compiled Adam/AdamW step at ``lr=0``, e.g. the first step of a
      warmup from 0, writes NaN where the second moment is 0: pytorch/pytorch#126514).
    - Data (``dataset``, one or a list, ``packed`` or not; ``collate_fn``,
      ``batch_size``, ``shuffle``; ``epochs``, ``max_steps_per_epoch``).
    - Checkpointing (``checkpointer``: HF, Meta or torchtune format;
      ``resume_from_checkpoint``): model weights after every epoch; optimizer and
      recipe state too for every epoch but the last, to resume from.
      ``save_every_n_steps: N`` also saves a step checkpoint every N steps and at the
      end of every epoch to ``output_dir/step_{global_step}/`` (model, optimizer,
      recipe, dataloader and RNG state; written whole or not at all), and
      ``checkpointer.keep_last_n_checkpoints: K`` keeps the newest K of those. ``resume_from_checkpoint: True`` without
      ``checkpointer.recipe_checkpoint`` continues from whichever whole checkpoint is
      furthest along, mid-epoch included; a damaged one is skipped with a warning.
    - Logging (``metric_logger``, ``log_every_n_steps``, ``log_peak_memory_stats``):
      ``loss``, ``lr``, ``tokens_per_second_per_gpu``, ``grad_norm`` and, on devices
      that report them, peak memory stats. Profiling (``profiler``; its
      ``profile_memory`` also records a CUDA memory snapshot for the profiled steps).
    - Determinism (``seed``, ``cudnn_deterministic_mode``).

    Args:
        cfg (DictConfig): the parsed config, command-line overrides applied.

    Raises:
        ValueError: ``optimizer_in_bwd=True`` with ``clip_grad_norm`` set.
        ValueError: ``optimizer_in_bwd=True`` with ``gradient_accumulation_steps > 1``.
        ValueError: ``optimizer_in_bwd=True`` with ``compile.optimizer_step=True``.
        ValueError: ``compile`` is a mapping with a key other than ``model``, ``loss``
            and ``optimizer_step``.
        ValueError: ``dtype=fp16``, which this recipe does not support (no loss
            scaling).
        ValueError: ``compile`` on an NPU device.
        ValueError: ``profiler._component_`` is not ``setup_torch_profiler`` (null
            means it).
        ValueError: ``save_every_n_steps`` or ``checkpointer.keep_last_n_checkpoints``
            is not a positive integer or null.
        RuntimeError: ``dtype=bf16`` on hardware without bf16.
        RuntimeError: ``enable_activation_offloading=True`` on a non-CUDA device, or
            without ``enable_activation_checkpointing``.
        RuntimeError: a ``left_pad_sequence`` collate function (inference only).

        Every refusal happens here, before anything is built or written.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self._optimizer_in_bwd = cfg.get("optimizer_in_bwd", False)
        # MiB of gradients per in-backward optimizer call; None: the default.
        self._bucket_cap_mb = cfg.get("optimizer_in_bwd_bucket_cap_mb", None)
        self._gradient_accumulation_steps = cfg.get("gradient_accumulation_steps", 1)
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._compile = training.parse_compile_config(cfg.get("compile", False))
        self._enable_activation_checkpointing = cfg.get(
            "enable_activation_checkpointing", False
        )
        self._enable_activation_offloading = cfg.get(
            "enable_activation_offloading", False
        )

        # Refuse every unsupported combination before anything is built, so that a
        # refused run leaves output_dir (and the checkpoints in it) as it was.
        if self._optimizer_in_bwd:
            training.check_optimizer_in_bwd_options(
                clip_grad_norm=self._clip_grad_norm,
                gradient_accumulation_steps=self._gradient_accumulation_steps,
                compile_optimizer_step=self._compile["optimizer_step"],
                bucket_cap_mb=self._bucket_cap_mb,
            )
        if self._dtype == torch.float16:
            raise ValueError(
                "dtype=fp16 is not supported by this recipe: it has no loss scaling. "
                "Use dtype=bf16 or dtype=fp32."
            )
        if self._device.type == "npu" and any(self._compile.values()):
            raise ValueError(
                "compile is not supported on NPU devices. Set compile=False."
            )
        if self._enable_activation_offloading and self._device.type != "cuda":
            raise RuntimeError(
                "enable_activation_offloading=True needs a CUDA device, got "
                f"device={self._device.type}. Set enable_activation_offloading=False."
            )
        if (
            self._enable_activation_offloading
            and not self._enable_activation_checkpointing
        ):
            raise RuntimeError(
                "enable_activation_offloading=True needs "
                "enable_activation_checkpointing=True."
            )
        self._collate_fn = cfg.get("collate_fn", "torchtune.data.padded_collate_sft")
        if "left_pad_sequence" in self._collate_fn:
            raise RuntimeError(
                f"collate_fn={self._collate_fn} is for inference only. Use "
                "torchtune.data.padded_collate_sft."
            )
        # null means the default, as in 0.6.1.
        training.check_profiler_component(cfg.get(training.PROFILER_KEY))

        self._log_every_n_steps = cfg.get("log_every_n_steps", 1)
        self._log_peak_memory_stats = cfg.get("log_peak_memory_stats", False)
        if self._log_peak_memory_stats and self._device.type == "cpu":
            log.info("log_peak_memory_stats=True is ignored on CPU: no accelerator.")
            self._log_peak_memory_stats = False
        self._resume_from_checkpoint = cfg.resume_from_checkpoint
        self._step_checkpointer = training.StepCheckpointer.from_config(cfg)

        # Public: updated from the checkpoint on resume, and read by tests.
        self.seed = training.set_seed(
            seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None)
        )
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.global_step = 0

    def load_checkpoint(self, cfg_checkpointer: DictConfig) -> dict[str, Any]:
        """Read the model weights, and the recipe and optimizer state on resume:
        from a step checkpoint when one is further along than the epoch checkpoint."""
        cfg_checkpointer = training.StepCheckpointer.checkpointer_config(
            cfg_checkpointer
        )
        step_checkpoint = (
            self._step_checkpointer.resume_point(cfg_checkpointer.recipe_checkpoint)
            if self._resume_from_checkpoint
            else None
        )
        self._checkpointer = config.instantiate(
            cfg_checkpointer,
            should_load_recipe_state=(
                self._resume_from_checkpoint and step_checkpoint is None
            ),
        )
        # Also when resuming from a step checkpoint: the checkpointer learns the
        # model's format from the files it loads, and saves epochs in it.
        ckpt_dict = self._checkpointer.load_checkpoint()
        # Mid-epoch resume state: the dataloader position and the RNG state.
        self._resume_dataloader_state = self._resume_rng_state = None
        if step_checkpoint is not None:
            recipe_state, rank_state, state = self._step_checkpointer.read(
                step_checkpoint
            )
            log.info(f"Resuming from step checkpoint {step_checkpoint}.")
            ckpt_dict = recipe_state | {
                training.MODEL_KEY: state["model"],
                training.OPT_KEY: state["optimizer"],
            }
            self._resume_dataloader_state = rank_state[training.DATALOADER_KEY]
            self._resume_rng_state = rank_state["rng"]
        if self._resume_from_checkpoint:
            self._update_recipe_state(ckpt_dict)
        return ckpt_dict

    def _update_recipe_state(self, ckpt_dict: dict[str, Any]) -> None:
        """Take the epoch count, seed and steps per epoch from the checkpoint."""
        progress = TrainingProgress.from_checkpoint(
            ckpt_dict,
            seed=self.seed,
            total_epochs=self.total_epochs,
            max_steps_per_epoch=self.max_steps_per_epoch,
        )
        self.epochs_run = progress.epochs_run
        self.seed = progress.seed
        self.max_steps_per_epoch = progress.max_steps_per_epoch

    def setup(self, cfg: DictConfig) -> None:
        """Build everything, in dependency order, restoring the state on resume."""
        self._metric_logger = config.instantiate(cfg.metric_logger)
        self._metric_logger.log_config(cfg)

        ckpt_dict = self.load_checkpoint(cfg.checkpointer)
        # The optimizer state can only be loaded once the model exists.
        self._model = self._setup_model(cfg.model, ckpt_dict[training.MODEL_KEY])
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(
            cfg.optimizer,
            ckpt_dict[training.OPT_KEY] if self._resume_from_checkpoint else None,
        )

        self._loss_fn = config.instantiate(cfg.loss)
        if self._compile["loss"]:
            training.compile_loss(self._loss_fn)
        # A chunked output loss needs the model to return its logits in chunks.
        if hasattr(self._loss_fn, "num_output_chunks"):
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)

        # The collate function pads with the tokenizer's pad id and the loss's ignore
        # index, so data comes after both.
        self._dataloader = self._setup_data(cfg.dataset, cfg.shuffle, cfg.batch_size)

        # One step is gradient_accumulation_steps batches.
        self._steps_per_epoch = (
            len(self._dataloader) // self._gradient_accumulation_steps
        )
        if self.max_steps_per_epoch is not None:
            self._steps_per_epoch = min(self._steps_per_epoch, self.max_steps_per_epoch)
        # A step checkpoint knows its step; an epoch checkpoint is at an epoch's end.
        self.global_step = ckpt_dict.get(
            "global_step", self.epochs_run * self._steps_per_epoch
        )

        # The scheduler is not checkpointed: last_epoch puts it where the interrupted
        # run was, and the optimizer state brings back its initial_lr.
        cfg_lr_scheduler = cfg.get("lr_scheduler", None)
        self._lr_scheduler = (
            None
            if cfg_lr_scheduler is None
            else config.instantiate(
                cfg_lr_scheduler,
                self._optimizer,
                num_training_steps=self.total_epochs * self._steps_per_epoch,
                last_epoch=self.global_step - 1,
            )
        )
        if self._compile["optimizer_step"]:
            # After the scheduler, which wraps step() to check the call order.
            self._optimizer.step = torch.compile(
                self._optimizer.step,
                backend=os.environ.get("TORCH_COMPILE_BACKEND", "inductor"),
            )

        self._profiler = self._setup_profiler(cfg.get(training.PROFILER_KEY, None))

    def _setup_profiler(
        self, cfg_profiler: DictConfig | None
    ) -> torch.profiler.profile | training.DummyProfiler:
        """Build the torch profiler, or a no-op one when ``profiler`` is absent or off.

        With ``profile_memory`` on CUDA, the loop also records a memory snapshot over
        the profiled (active) steps of the first epoch: ``self._memory_window`` holds
        their first and last batch index, or is None.
        """
        cfg_profiler = cfg_profiler or DictConfig({"enabled": False})
        cfg_profiler["_component_"] = training.TORCH_PROFILER  # checked in __init__
        profiler, profiler_cfg = config.instantiate(cfg_profiler)
        log.info(f"Profiler config after instantiation: {profiler_cfg}")

        self._memory_window = None
        if (
            profiler_cfg["enabled"]
            and profiler_cfg.get("profile_memory", False)
            and self._device.type == "cuda"
        ):
            first = profiler_cfg["wait_steps"] + profiler_cfg["warmup_steps"]
            self._memory_window = (first, first + profiler_cfg["active_steps"])
        return profiler

    def _setup_model(
        self, cfg_model: DictConfig, model_state_dict: dict[str, Any]
    ) -> nn.Module:
        """Build the model on the device in the training dtype and load its weights."""
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        if self._compile["model"]:
            training.compile_model(model)
        if self._enable_activation_checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
        model.load_state_dict(model_state_dict)
        training.validate_expected_param_dtype(
            model.named_parameters(), dtype=self._dtype
        )
        # A no-op context when offloading is off.
        self._activations_handling_ctx = training.get_act_offloading_ctx_manager(
            model, self._enable_activation_offloading
        )
        log.info(f"Model is initialized with precision {self._dtype}.")
        if self._device.type != "cpu":
            training.log_memory_stats(training.get_memory_stats(device=self._device))
        return model

    def _setup_optimizer(
        self, cfg_optimizer: DictConfig, opt_state_dict: dict[str, Any] | None
    ) -> torch.optim.Optimizer:
        """Build the optimizer: the one place that tells plain from in-backward.

        Both kinds have the same param groups and state-dict format, so the state of
        either mode loads into either (torchtune 0.6.1's in-backward format too).
        """
        make_optimizer = partial(config.instantiate, cfg_optimizer)
        # Parameter names let the in-backward optimizer also load the name-keyed
        # in-backward checkpoints of torchtune 0.6.1.
        optimizer = (
            training.OptimizerInBackward(
                self._model.named_parameters(),
                make_optimizer,
                bucket_cap_mb=self._bucket_cap_mb,
            )
            if self._optimizer_in_bwd
            else make_optimizer(self._model.parameters())
        )
        if opt_state_dict is not None:
            optimizer.load_state_dict(opt_state_dict)
        log.info(f"Optimizer is initialized: {type(optimizer).__name__}.")
        return optimizer

    def _setup_data(
        self, cfg_dataset: DictConfig | ListConfig, shuffle: bool, batch_size: int
    ) -> StatefulDataLoader:
        """Build the map-style dataset (a list is concatenated) and its loader."""
        if isinstance(cfg_dataset, ListConfig):
            ds = ConcatDataset(
                [config.instantiate(c, self._tokenizer) for c in cfg_dataset]
            )
            packed = getattr(ds, "packed", False)
        else:
            ds = config.instantiate(cfg_dataset, self._tokenizer)
            packed = cfg_dataset.get("packed", False)
        collate_fn = (
            padded_collate_packed
            if packed
            else partial(
                _get_component_from_path(self._collate_fn),
                padding_idx=self._tokenizer.pad_id,
                ignore_idx=self._loss_fn.ignore_index,
            )
        )
        # The sampler's seed is fixed: the data order depends only on the epoch.
        sampler = StatefulDistributedSampler(
            ds, num_replicas=1, rank=0, shuffle=shuffle, seed=0
        )
        # drop_last keeps every batch the same shape (compile, flex attention).
        return StatefulDataLoader(
            dataset=ds,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=True,
        )

    def save_checkpoint(self, epoch: int) -> None:
        """Save the model; for every epoch but the last, also what resuming needs."""
        intermediate = epoch + 1 < self.total_epochs
        ckpt_dict = {training.MODEL_KEY: self._model.state_dict()}
        if intermediate:
            ckpt_dict |= {
                training.OPT_KEY: self._optimizer.state_dict(),
                training.SEED_KEY: self.seed,
                training.EPOCHS_KEY: self.epochs_run,
                training.TOTAL_EPOCHS_KEY: self.total_epochs,
                training.MAX_STEPS_KEY: self.max_steps_per_epoch,
                # Saved for the record only: training resumes at an epoch boundary,
                # where a fresh loader with the epoch's sampler seed is what the
                # uninterrupted run uses too.
                training.DATALOADER_KEY: self._dataloader.state_dict(),
            }
        self._checkpointer.save_checkpoint(
            ckpt_dict, epoch=epoch, intermediate_checkpoint=intermediate
        )

    def _save_step_checkpoint(self, epochs_run: int, mid_epoch: bool) -> None:
        """Save everything a run needs to continue from this very step. At an
        epoch's end the next epoch starts with a fresh loader, as it does here."""
        progress = TrainingProgress(
            seed=self.seed,
            epochs_run=epochs_run,
            total_epochs=self.total_epochs,
            max_steps_per_epoch=self.max_steps_per_epoch,
        )
        loader_state = self._dataloader.state_dict() if mid_epoch else None
        self._step_checkpointer.save(
            self.global_step,
            self._model,
            self._optimizer,
            recipe_state=progress.state_dict(),
            rank_state={training.DATALOADER_KEY: loader_state},
        )

    def _loss_step(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the mean loss over the batch's target tokens, and their count."""
        # Position t predicts token t + 1: shift the labels left, ignore the last one.
        ignore_index = self._loss_fn.ignore_index
        labels = F.pad(batch.pop("labels")[..., 1:], (0, 1), value=ignore_index)
        with self._activations_handling_ctx:
            logits = self._model(**batch)
        # A chunked output loss takes the list of logit chunks as it is.
        if not isinstance(logits, list):
            logits = logits.reshape(-1, logits.size(-1))
            labels = labels.reshape(-1)
        return self._loss_fn(logits, labels), (labels != ignore_index).sum()

    def train(self) -> None:
        """Train for the remaining epochs, saving a checkpoint after each one."""
        if self._compile["model"]:
            log.info("The model compiles in its first forward: expect a slow step 1.")
        self._optimizer.zero_grad(set_to_none=True)
        if self._resume_rng_state is not None:
            # Resuming mid-run: draw (dropout) what the interrupted run would have.
            training.restore_rng_state(self._resume_rng_state)
        # Totals over the current step's batches.
        running_loss, num_tokens = 0, 0
        t0 = time.perf_counter()
        self._profiler.start()
        for curr_epoch in range(self.epochs_run, self.total_epochs):
            self._dataloader.sampler.set_epoch(curr_epoch)
            if self._resume_dataloader_state:
                # Resuming mid-epoch: the loader continues where the saved one was.
                self._dataloader.load_state_dict(self._resume_dataloader_state)
                self._resume_dataloader_state = None
            steps_done = self.global_step - curr_epoch * self._steps_per_epoch
            pbar = tqdm(total=self._steps_per_epoch, initial=steps_done)
            first_batch = steps_done * self._gradient_accumulation_steps
            for idx, batch in enumerate(self._dataloader, start=first_batch):
                if idx // self._gradient_accumulation_steps == self._steps_per_epoch:
                    break
                record_memory = curr_epoch == 0 and self._memory_window is not None
                if record_memory and idx == self._memory_window[0]:
                    torch.cuda.memory._record_memory_history()
                utils.batch_to_device(batch, self._device)

                loss, batch_tokens = self._loss_step(batch)
                running_loss += loss.detach() * batch_tokens
                num_tokens += batch_tokens
                if self._optimizer_in_bwd:
                    # Parameters are updated as their gradients arrive, so those must
                    # already be means over the step's tokens: backward the batch mean.
                    loss.backward()
                else:
                    # Backward the token sum; the gradients are divided by the step's
                    # token count after accumulation, when that count is known.
                    (loss * batch_tokens).backward()
                del loss

                if (idx + 1) % self._gradient_accumulation_steps == 0:
                    if self._optimizer_in_bwd:
                        # The update already happened; backward recorded the norm.
                        grad_norm = self._optimizer.grad_norm
                    else:
                        training.scale_grads(self._model, 1 / num_tokens)
                        grad_norm = nn.utils.get_total_norm(
                            [
                                p.grad
                                for p in self._model.parameters()
                                if p.grad is not None
                            ]
                        )
                        if self._clip_grad_norm is not None:
                            nn.utils.clip_grads_with_norm_(
                                self._model.parameters(),
                                float(self._clip_grad_norm),
                                grad_norm,
                            )
                    # A no-op after an in-backward backward.
                    self._optimizer.step()
                    self._optimizer.zero_grad(set_to_none=True)
                    if self._lr_scheduler is not None:
                        self._lr_scheduler.step()
                    self.global_step += 1

                    loss_to_log = (running_loss / num_tokens).item()
                    pbar.update(1)
                    pbar.set_description(
                        f"{curr_epoch + 1}|{self.global_step}|Loss: {loss_to_log}"
                    )
                    if self.global_step % self._log_every_n_steps == 0:
                        log_dict = {
                            "loss": loss_to_log,
                            "lr": training.get_lr(self._optimizer),
                            "tokens_per_second_per_gpu": num_tokens.item()
                            / (time.perf_counter() - t0),
                            "grad_norm": grad_norm.item(),
                        }
                        if self._log_peak_memory_stats:
                            log_dict |= training.get_memory_stats(device=self._device)
                        self._metric_logger.log_dict(log_dict, step=self.global_step)
                    running_loss, num_tokens = 0, 0
                    epoch_ends = (idx + 1) // self._gradient_accumulation_steps == (
                        self._steps_per_epoch
                    )
                    if self._step_checkpointer.is_due(self.global_step) and not (
                        epoch_ends
                    ):
                        self._save_step_checkpoint(curr_epoch, mid_epoch=True)
                    t0 = time.perf_counter()

                if record_memory and idx == self._memory_window[1]:
                    torch.cuda.memory._record_memory_history(enabled=None)
                # Steps per batch, so a trace may not end on an optimizer step.
                self._profiler.step()

            pbar.close()
            self.epochs_run += 1
            if self._step_checkpointer.every_n_steps is not None:
                # Before the epoch checkpoint, whose recipe state is written in place:
                # a crash while it is written leaves this one to resume from.
                self._save_step_checkpoint(self.epochs_run, mid_epoch=False)
            self.save_checkpoint(epoch=curr_epoch)
        self._profiler.stop()

    def cleanup(self) -> None:
        self._metric_logger.close()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: the config file, with command-line overrides applied."""
    config.log_config(recipe_name="FullFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = FullFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
