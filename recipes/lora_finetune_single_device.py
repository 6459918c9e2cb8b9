"""LoRA, QLoRA and DoRA fine-tuning of a decoder LLM on one device.

Run it with ``tune run lora_finetune_single_device --config <config>``; ``tune ls``
lists the shipped configs.
"""

import os
import sys
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import torchtune.modules.common_utils as common_utils
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset, PackedDataset
from torchtune.modules.peft import (
    get_adapter_params,
    get_lora_module_names,
    set_trainable_params,
    validate_missing_and_unexpected_for_lora,
)
from torchtune.recipe_interfaces import FTRecipeInterface

log = utils.get_logger("DEBUG")


class LoRAFinetuneRecipeSingleDevice(FTRecipeInterface):
    """LoRA fine-tuning of a dense decoder (Llama2, Llama3, Qwen2, ...) on one device.

    Only the adapter parameters train; the base weights stay frozen (in NF4 with the
    QLoRA model builders). Features, each driven by the config key named:

    - Adapters (``model``): any LoRA, QLoRA or DoRA model builder, with its
      ``lora_attn_modules``, ``apply_lora_to_mlp``, ``apply_lora_to_output``,
      ``lora_rank`` and ``lora_alpha``. ``low_cpu_ram`` lowers peak CPU memory when
      QLoRA weights are turned back to the training dtype for a checkpoint.
    - Precision (``dtype``): fp32 or bf16.
    - Optimizer (``optimizer``, ``optimizer_in_bwd``): any ``torch.optim.Optimizer``,
      including bitsandbytes' low-precision ones. With ``optimizer_in_bwd: True`` each
      adapter parameter is updated inside backward as soon as its gradient is ready,
      and the gradient is freed at once; the frozen base weights get no optimizer.
      The optimizer is then a :class:`~torchtune.training.OptimizerInBackward`, which
      looks like the plain optimizer to everything else: LR schedulers, ``get_lr``,
      ``step``/``zero_grad`` and checkpoints are the same in both modes, and a
      checkpoint written in one mode resumes in the other.
      ``optimizer_in_bwd_bucket_cap_mb`` sets how many MiB of gradients one
      update in backward takes (default 4; 0: each parameter on its own).
    - Loss normalization: a step's update is the gradient of the mean loss over every
      target token of the step. Both modes backpropagate each batch's token sum and
      divide the gradients by the step's token count: plain runs after accumulation,
      in-backward runs inside backward (there is one batch per step), with the same
      operations, so both compute the same numbers.
    - Gradient accumulation (``gradient_accumulation_steps``, plain runs) and
      clipping (``clip_grad_norm``; null means no clipping; ``inf`` measures and never
      clips), in both modes: in-backward clipping is exact, at the price of a second
      backward pass (see :meth:`~torchtune.training.OptimizerInBackward.backward`).
      ``grad_norm``, logged in both modes, is the norm before clipping.
    - LR scheduling (``lr_scheduler``, optional).
    - Memory (``enable_activation_checkpointing``, ``enable_activation_offloading``).
    - ``torch.compile`` (``compile``): a bool compiles the model and the loss, as in
      0.6.1; a mapping with keys ``model``, ``loss`` and ``optimizer_step`` picks them
      one by one (``optimizer_step`` compiles the plain optimizer's ``step``).
    - Data (``dataset``, one or a list, ``packed`` or not; ``collate_fn``,
      ``batch_size``, ``shuffle``; ``epochs``, ``max_steps_per_epoch``).
    - Checkpointing (``checkpointer``, ``save_adapter_weights_only``,
      ``resume_from_checkpoint``), by :class:`~torchtune.training.CheckpointManager`:
      after every epoch, the adapter weights and config and (unless
      ``save_adapter_weights_only``) the base weights with the adapter merged into
      them, to ``epoch_{N}``, and a step checkpoint (adapter, optimizer, recipe,
      dataloader and RNG state; written whole or not at all) to
      ``output_dir/step_{global_step}/``. ``save_every_n_steps: N`` also saves one
      every N steps, and ``checkpointer.keep_last_n_checkpoints: K`` keeps the newest
      K of them. ``resume_from_checkpoint: True`` continues from the newest whole step
      checkpoint, mid-epoch included (a damaged one is skipped with a warning), or
      from a torchtune 0.6.1 epoch checkpoint, whose adapter comes from
      ``checkpointer.adapter_checkpoint`` (default: the latest ``epoch_*`` folder).
      Saving never changes the model being trained.
    - Logging (``metric_logger``, ``log_every_n_steps``, ``log_peak_memory_stats``):
      ``loss``, ``lr``, ``tokens_per_second_per_gpu``, ``grad_norm`` and, on devices
      that report them, peak memory stats. Profiling (``profiler``; its
      ``profile_memory`` also records a CUDA memory snapshot for the profiled steps).
    - Determinism (``seed``, ``cudnn_deterministic_mode``).

    Args:
        cfg (DictConfig): the parsed config, command-line overrides applied.

    Raises:
        ValueError: an option :class:`~torchtune.training.RecipeOptions` or
            :class:`~torchtune.training.CheckpointManager` refuses (see theirs).
        PermissionError: ``output_dir`` or ``checkpointer.output_dir`` cannot be
            written.
        RuntimeError: see :class:`~torchtune.training.RecipeOptions`.
        ValueError: ``resume_from_checkpoint=True`` from an epoch checkpoint, and no
            adapter checkpoint found.

        Every refusal but the missing adapter happens here, before anything is built
        or written.
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Every refusal comes first, so that a refused run leaves output_dir (and the
        # checkpoints in it) as it was.
        self._opts = training.RecipeOptions.from_config(cfg)
        self._device, self._dtype = self._opts.device, self._opts.dtype
        self._optimizer_in_bwd = self._opts.optimizer_in_bwd
        self._checkpoint = training.CheckpointManager(
            training.CheckpointOptions.from_config(cfg),
            adapter_config=self._adapter_config(cfg.model),
        )
        self._collate_fn = cfg.get("collate_fn", "torchtune.data.padded_collate_sft")

        self.seed = training.set_seed(
            seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None)
        )
        # Where training stands; a resumed run takes it from the checkpoint.
        self.progress = training.TrainingProgress(total_epochs=cfg.epochs)

    def _adapter_config(self, cfg_model: DictConfig) -> dict[str, Any]:
        """The PEFT config saved beside the adapter in every export
        (``adapter_config.json``), so that Hugging Face PEFT can load it."""
        return {
            "r": cfg_model.lora_rank,
            "lora_alpha": cfg_model.lora_alpha,
            "target_modules": get_lora_module_names(
                list(cfg_model.lora_attn_modules),
                cfg_model.get("apply_lora_to_mlp", False),
                cfg_model.get("apply_lora_to_output", False),
            ),
            "peft_type": "LORA",
        }

    def setup(self, cfg: DictConfig) -> None:
        """Build the model, tokenizer, optimizer, loss, data, LR scheduler and
        profiler, from the checkpoint's state when resuming."""
        ckpt_dict = self._checkpoint.load_base_checkpoint()
        # Picks the variant of the hook that turns NF4 weights back to the training
        # dtype in state_dict() (QLoRA checkpoints).
        common_utils._use_low_cpu_ram = cfg.get("low_cpu_ram", False)
        self._model = self._setup_model(
            cfg.model,
            ckpt_dict[training.MODEL_KEY],
            ckpt_dict.get(training.ADAPTER_KEY),
        )
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(cfg.optimizer)

        self._loss_fn = config.instantiate(cfg.loss)
        if self._opts.compile["loss"]:
            # A new module, except for a chunked loss (compiled in place).
            self._loss_fn = training.compile_loss(self._loss_fn)
        if hasattr(self._loss_fn, "num_output_chunks"):
            # A chunked output loss takes the logits in as many chunks.
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)

        # The collate function pads with the tokenizer's pad id and the loss's ignore
        # index, so data comes after both.
        self._dataloader = self._setup_data(cfg.dataset, cfg.shuffle, cfg.batch_size)
        # Full optimizer steps per epoch, at most max_steps_per_epoch (null: all).
        steps = len(self._dataloader) // self._opts.gradient_accumulation_steps
        self._steps_per_epoch = min(steps, cfg.get("max_steps_per_epoch") or steps)
        # Saved with every step checkpoint, and put back on resume: the trained
        # adapter, optimizer, data position, LR schedule, RNG and progress.
        cfg_lr_scheduler = cfg.get("lr_scheduler", None)
        self._lr_scheduler = training.setup_lr_scheduler(
            cfg_lr_scheduler and partial(config.instantiate, cfg_lr_scheduler),
            self._optimizer,
            num_training_steps=self.progress.total_epochs * self._steps_per_epoch,
        )
        self._checkpoint.load(
            {
                "model": self._model,
                "optimizer": self._optimizer,
                "dataloader": self._dataloader,
                "progress": self.progress,
                "lr_scheduler": self._lr_scheduler,
            },
            steps_per_epoch=self._steps_per_epoch,
        )
        # Logs and the config copy are written once every check has passed and
        # output_dir is this run's (load() took its lock).
        metric_logger = config.instantiate(cfg.metric_logger)
        metric_logger.log_config(cfg)
        self._step_logger = training.StepLogger.from_options(metric_logger, self._opts)
        if self._opts.compile["optimizer_step"]:
            # After the scheduler: it wraps the optimizer's bound step() method,
            # which a compiled step is not.
            self._optimizer.step = torch.compile(
                self._optimizer.step,
                backend=os.environ.get("TORCH_COMPILE_BACKEND", "inductor"),
            )
        # With profile_memory on CUDA, also a memory snapshot of the profiled steps.
        self._profiler = training.setup_profiler(
            cfg.get(training.PROFILER_KEY, None), device=self._device
        )

    def _setup_model(
        self,
        cfg_model: DictConfig,
        base_model_state_dict: dict[str, Any],
        lora_weights_state_dict: dict[str, Any] | None,
    ) -> nn.Module:
        """Build the model on the device in the training dtype, freeze all but the
        adapter, and load the base weights (and the adapter, when resuming)."""
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        self.adapter_params = get_adapter_params(model)
        set_trainable_params(model, self.adapter_params)

        if self._opts.compile["model"]:
            training.compile_model(model)
        if self._opts.enable_activation_checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )

        base_missing, base_unexpected = model.load_state_dict(
            base_model_state_dict, strict=False
        )
        # DoRA magnitudes start as the norms of the loaded base weights.
        if any("magnitude" in name for name in self.adapter_params):
            for m in model.modules():
                if hasattr(m, "initialize_dora_magnitude"):
                    m.initialize_dora_magnitude()
        lora_missing, lora_unexpected = None, None
        if lora_weights_state_dict:
            lora_missing, lora_unexpected = model.load_state_dict(
                lora_weights_state_dict, strict=False
            )
        validate_missing_and_unexpected_for_lora(
            lora_attn_modules=list(cfg_model.lora_attn_modules),
            apply_lora_to_mlp=cfg_model.apply_lora_to_mlp,
            apply_lora_to_output=cfg_model.get("apply_lora_to_output", False),
            base_missing=base_missing,
            base_unexpected=base_unexpected,
            lora_missing=lora_missing,
            lora_unexpected=lora_unexpected,
        )
        training.validate_expected_param_dtype(
            self.adapter_params.items(), dtype=self._dtype
        )
        # A no-op context when offloading is off.
        self._activations_handling_ctx = training.get_act_offloading_ctx_manager(
            model, self._opts.enable_activation_offloading
        )
        log.info(f"Model is initialized with precision {self._dtype}.")
        if self._device.type != "cpu":
            training.log_memory_stats(training.get_memory_stats(device=self._device))
        return model

    def _setup_optimizer(self, cfg_optimizer: DictConfig) -> torch.optim.Optimizer:
        """Build the optimizer: the one place that tells plain from in-backward.

        Both get every parameter of the model, as in 0.6.1: the frozen ones get no
        state (and no in-backward hook), and the param groups, hence the state dicts,
        are the same in both modes, so the state of either loads into either.
        """
        return training.build_optimizer(
            self._model.parameters(),
            partial(config.instantiate, cfg_optimizer),
            in_backward=self._optimizer_in_bwd,
            bucket_cap_mb=self._opts.bucket_cap_mb,
            max_norm=self._opts.clip_grad_norm,
        )

    def _setup_data(
        self, cfg_dataset: DictConfig | ListConfig, shuffle: bool, batch_size: int
    ) -> StatefulDataLoader:
        """Build the loader over one map-style dataset or the concatenation of a list."""
        if isinstance(cfg_dataset, ListConfig):
            ds = ConcatDataset(
                [config.instantiate(c, self._tokenizer) for c in cfg_dataset]
            )
        else:
            ds = config.instantiate(cfg_dataset, self._tokenizer)
        # Packs come padded; other samples are padded with the tokenizer's pad id,
        # their labels with the loss's ignore index.
        if isinstance(ds, PackedDataset) or getattr(ds, "packed", False):
            collate_fn = padded_collate_packed
        else:
            collate_fn = partial(
                _get_component_from_path(self._collate_fn),
                padding_idx=self._tokenizer.pad_id,
                ignore_idx=self._loss_fn.ignore_index,
            )
        return training.stateful_dataloader(
            ds, batch_size=batch_size, shuffle=shuffle, collate_fn=collate_fn
        )

    def _loss_step(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the mean loss over the batch's target tokens, and their count."""
        # Position t predicts token t + 1 (a batch without targets: see the helper).
        labels, num_targets = training.next_token_labels(
            batch.pop("labels"), self._loss_fn.ignore_index
        )
        with self._activations_handling_ctx:
            logits = self._model(**batch)
        # A chunked output loss takes the list of logit chunks as it is.
        if not isinstance(logits, list):
            logits = logits.reshape(-1, logits.size(-1))
            labels = labels.reshape(-1)
        return self._loss_fn(logits, labels), num_targets

    def train(self) -> None:
        """Train for the remaining epochs, saving a checkpoint after each one."""
        if self._opts.compile["model"]:
            log.info("The model compiles in its first forward: expect a slow step 1.")
        gradient_accumulation_steps = self._opts.gradient_accumulation_steps
        self._optimizer.zero_grad(set_to_none=True)
        # Totals over the current step's batches. A step without any target divides
        # them by 1 (clamp): its loss and gradients are exactly zero.
        running_loss, num_tokens = 0, 0
        self._profiler.start()
        for curr_epoch in range(self.progress.epochs_run, self.progress.total_epochs):
            # The data order depends only on the seed and the epoch.
            self._dataloader.sampler.set_epoch(curr_epoch)
            steps_done = self.progress.global_step - curr_epoch * self._steps_per_epoch
            self._step_logger.start_epoch(
                curr_epoch, steps=self._steps_per_epoch, steps_done=steps_done
            )
            # From where a resumed epoch stands, to its last full optimizer step.
            for idx, batch in training.epoch_batches(
                self._dataloader,
                steps_done=steps_done,
                steps_per_epoch=self._steps_per_epoch,
                gradient_accumulation_steps=gradient_accumulation_steps,
            ):
                utils.batch_to_device(batch, self._device)
                loss, batch_tokens = self._loss_step(batch)
                running_loss += loss.detach() * batch_tokens
                num_tokens += batch_tokens
                # Backward the token sum; the gradients are divided by the step's
                # token count once it is known.
                if self._optimizer_in_bwd:
                    # One batch per step: its count is the step's. The optimizer
                    # scales, clips and applies each gradient inside backward.
                    self._optimizer.backward(
                        loss * batch_tokens, grad_scale=1 / num_tokens.clamp(min=1)
                    )
                else:
                    (loss * batch_tokens).backward()
                del loss
                if (idx + 1) % gradient_accumulation_steps != 0:
                    continue

                if self._optimizer_in_bwd:
                    # The update already happened; backward measured the gradients.
                    grad_norm = self._optimizer.grad_norm
                else:
                    grad_norm = training.scale_and_clip_grads_(
                        self._model.parameters(),
                        1 / num_tokens.clamp(min=1),
                        self._opts.clip_grad_norm,
                    )
                # Stop before a non-finite step updates (plain) or is saved.
                training.stop_if_not_finite(
                    running_loss,
                    grad_norm,
                    step=self.progress.global_step + 1,
                    epoch=curr_epoch,
                    batch=idx,
                    newest_checkpoint=self._checkpoint.newest_checkpoint,
                )
                # A no-op after an in-backward backward, which already updated.
                self._optimizer.step()
                self._optimizer.zero_grad(set_to_none=True)
                if self._lr_scheduler is not None:
                    self._lr_scheduler.step()
                self.progress.global_step += 1

                self._step_logger.log(
                    self.progress.global_step,
                    loss=(running_loss / num_tokens.clamp(min=1)).item(),
                    num_tokens=num_tokens.item(),
                    lr=training.get_lr(self._optimizer),
                    grad_norm=grad_norm,
                )
                running_loss, num_tokens = 0, 0
                # A step checkpoint, when one is due.
                self._checkpoint.save()
                # Once per optimizer step: the profiler's schedule counts those.
                self._profiler.step()

            self.progress.epochs_run += 1
            # The epoch's step checkpoint, then its export (epoch_{N}).
            self._checkpoint.save(epoch_end=True)
        self._profiler.stop()

    def cleanup(self) -> None:
        # Releases output_dir.
        self._checkpoint.close()
        self._step_logger.close()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run lora_finetune_single_device --config <config>``.

    Config values come from the config file, overridden by ``key=value`` arguments on
    the command line.
    """
    config.log_config(recipe_name="LoRAFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = LoRAFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
