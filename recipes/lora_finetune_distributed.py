"""LoRA, QLoRA and DoRA fine-tuning of a decoder LLM over several processes (FSDP2).

Run it with ``tune run --nproc_per_node N lora_finetune_distributed --config <config>``
(multi-node through torchrun's own arguments); ``tune ls`` lists the shipped configs.
"""

import math
import os
import sys
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.distributed import destroy_process_group
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtune import config, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset, PackedDataset
from torchtune.modules.peft import (
    get_adapter_params,
    get_lora_module_names,
    set_trainable_params,
)
from torchtune.recipe_interfaces import FTRecipeInterface

log = utils.get_logger("DEBUG")


def _freeze_all_but_the_adapter(model: nn.Module) -> nn.Module:
    """Only the adapter trains (applied before sharding)."""
    set_trainable_params(model, get_adapter_params(model))
    return model


def _fresh_adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Initial adapter weights of ``model`` (unsharded, on the meta device: only
    names, shapes and dtypes are read) as full tensors, as the LoRA modules
    initialize them: ``lora_a`` Kaiming-uniform, ``lora_b`` zero (and DoRA
    magnitudes zero, until they are computed from the base weights).

    Initializing the shards in place would draw different numbers for every world
    size (and, on CPU, the same numbers on every rank); these are drawn from the
    seeded generator in one fixed order and sharded on loading.
    """
    fresh = {}
    for name, param in get_adapter_params(model).items():
        fresh[name] = torch.zeros(param.shape, dtype=param.dtype)
        if "lora_a" in name:
            nn.init.kaiming_uniform_(fresh[name], a=math.sqrt(5))
    return fresh


class LoRAFinetuneRecipeDistributed(FTRecipeInterface):
    """LoRA fine-tuning of a dense decoder (Llama2, Llama3, Qwen2, ...) sharded with
    FSDP2 over one or more processes: CUDA with NCCL, or CPU with gloo.

    Only the adapter parameters train; the base weights stay frozen (in NF4 with the
    QLoRA model builders). Features, each driven by the config key named:

    - Adapters (``model``): any LoRA, QLoRA or DoRA model builder, with its
      ``lora_attn_modules``, ``apply_lora_to_mlp``, ``apply_lora_to_output``,
      ``lora_rank`` and ``lora_alpha``. Fresh adapters are initialized as full
      tensors and then sharded, so they are the same for any number of processes.
    - Sharding (FSDP2): each ``layers.i`` and the whole model are sharded over the
      processes; ``custom_sharded_layers`` names more modules to shard on their own,
      ``fsdp_reshard_after_forward: False`` keeps parameters gathered from forward
      to backward, ``fsdp_cpu_offload`` keeps parameters, gradients and optimizer
      state in CPU memory (CUDA only: on CPU there is nothing to move).
    - Precision (``dtype``): fp32 or bf16.
    - Optimizer (``optimizer``, ``optimizer_in_bwd``): any ``torch.optim.Optimizer``
      that can step sharded parameters (not bitsandbytes'; see
      :meth:`~torchtune.training.RecipeOptions.from_config`).
      With ``optimizer_in_bwd: True`` each adapter parameter is updated inside
      backward as soon as its (reduce-scattered) gradient is ready, and the gradient
      is freed at once; the frozen base weights get no optimizer. The optimizer is
      then a :class:`~torchtune.training.OptimizerInBackward`, which looks like the
      plain optimizer to everything else: LR schedulers, ``get_lr``,
      ``step``/``zero_grad`` and checkpoints are the same in both modes, and a
      checkpoint written in one mode resumes in the other.
      ``optimizer_in_bwd_bucket_cap_mb`` sets how many MiB of gradients one
      update in backward takes (default 4; 0: each parameter on its own).
    - Loss normalization: a step's update is the gradient of the mean loss over every
      target token the step sees on all processes. Each process backpropagates its
      token sum, and the gradients are multiplied by ``world_size / all-reduced token
      count`` (the world size undoes FSDP's average over processes): after
      accumulation in plain runs, inside backward in in-backward runs (one batch per
      step), with the same operations, so both compute the same numbers.
    - Gradient accumulation (``gradient_accumulation_steps``, plain runs; the global
      batch is ``batch_size * processes * gradient_accumulation_steps``) and clipping
      (``clip_grad_norm``; null means no clipping; ``inf`` measures and never clips),
      in both modes: in-backward clipping is exact, at the price of a second backward
      pass (see :meth:`~torchtune.training.OptimizerInBackward.backward`).
      ``grad_norm``, logged in both modes, is the norm before clipping.
    - LR scheduling (``lr_scheduler``, optional).
    - Memory (``enable_activation_checkpointing``, or selective with
      ``ac_mode``/``ac_option``; ``enable_activation_offloading``).
    - ``torch.compile`` (``compile``): a bool compiles the model and the loss, as in
      0.6.1; a mapping with keys ``model``, ``loss`` and ``optimizer_step`` picks them
      one by one (``optimizer_step`` compiles the plain optimizer's ``step``).
    - Data (``dataset``, one or a list, ``packed`` or not; ``collate_fn``,
      ``batch_size`` per process, ``shuffle``; ``epochs``, ``max_steps_per_epoch``).
    - Checkpointing (``checkpointer``, ``save_adapter_weights_only``,
      ``resume_from_checkpoint``), by :class:`~torchtune.training.CheckpointManager`:
      after every epoch, rank 0 writes the adapter weights and config and (unless
      ``save_adapter_weights_only``) the base weights with the adapter merged into
      them to ``epoch_{N}``, and every rank its shards of a step checkpoint (adapter,
      optimizer, recipe, dataloader and RNG state; written whole or not at all) to
      ``output_dir/step_{global_step}/``. ``save_every_n_steps: N`` also saves one
      every N steps, ``enable_async_checkpointing`` writes them in the background,
      and ``checkpointer.keep_last_n_checkpoints: K`` keeps the newest K of them.
      ``resume_from_checkpoint: True`` continues from the newest whole step
      checkpoint, mid-epoch included (a damaged one is skipped with a warning), or
      from a torchtune 0.6.1 epoch checkpoint, whose adapter comes from
      ``checkpointer.adapter_checkpoint`` (default: the latest ``epoch_*`` folder).
      Saving never changes the model being trained.
    - Logging from rank 0 (``metric_logger``, ``log_every_n_steps``,
      ``log_peak_memory_stats``): ``loss``, ``lr``, ``tokens_per_second_per_gpu``,
      ``grad_norm`` and, on devices that report them, peak memory stats. Profiling
      (``profiler``; its ``profile_memory`` also records a CUDA memory snapshot for
      the profiled steps).
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

        Every refusal but the missing adapter happens here, before the process group,
        the model or any file.
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Every refusal comes before the process group, the model or any file.
        self._opts = training.RecipeOptions.from_config(cfg, distributed=True)
        self._device, self._dtype = self._opts.device, self._opts.dtype
        self._optimizer_in_bwd = self._opts.optimizer_in_bwd
        self._checkpoint = training.CheckpointManager(
            training.CheckpointOptions.from_config(cfg),
            adapter_config=self._adapter_config(cfg.model),
        )
        self._collate_fn = cfg.get("collate_fn", "torchtune.data.padded_collate_sft")

        torch.distributed.init_process_group(self._opts.process_group_backend)
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0

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
        if self._opts.fsdp_cpu_offload:
            # The CPU optimizer step is ~2x faster with every core in intra-op use.
            training.set_torch_num_threads()

        # Every rank reads the full checkpoint (memory-mapped).
        ckpt_dict = self._checkpoint.load_base_checkpoint()
        self._model = self._setup_model(
            cfg, ckpt_dict[training.MODEL_KEY], ckpt_dict.get(training.ADAPTER_KEY)
        )
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(cfg.optimizer)

        self._loss_fn = config.instantiate(cfg.loss)
        if self._opts.compile["loss"]:
            # A new module, except for a chunked loss (compiled in place).
            self._loss_fn = training.compile_loss(
                self._loss_fn, verbose=self._is_rank_zero
            )
        if hasattr(self._loss_fn, "num_output_chunks"):
            # A chunked output loss takes the logits in as many chunks.
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)

        # The collate function pads with the tokenizer's pad id and the loss's ignore
        # index, so data comes after both.
        self._dataloader = self._setup_data(cfg.dataset, cfg.shuffle, cfg.batch_size)
        # One step is gradient_accumulation_steps batches on every rank.
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
        metric_logger = None
        if self._is_rank_zero:
            metric_logger = config.instantiate(cfg.metric_logger)
            metric_logger.log_config(cfg)
        self._step_logger = training.StepLogger.from_options(
            metric_logger, self._opts, world_size=self.world_size
        )
        if self._opts.compile["optimizer_step"]:
            # After the scheduler: it wraps the optimizer's bound step() method,
            # which a compiled step is not.
            self._optimizer.step = torch.compile(
                self._optimizer.step,
                backend=os.environ.get("TORCH_COMPILE_BACKEND", "inductor"),
            )
        # With profile_memory on CUDA, rank 0 also records a memory snapshot of the
        # profiled steps.
        self._profiler = training.setup_profiler(
            cfg.get(training.PROFILER_KEY, None), device=self._device
        )

    def _setup_model(
        self,
        cfg: DictConfig,
        base_model_state_dict: dict[str, Any],
        adapter_state_dict: dict[str, Any] | None,
    ) -> nn.Module:
        """Build the model on the meta device (no memory), freeze all but the
        adapter, shard it, and load the base weights and the adapter (fresh or
        resumed) into the shards: each rank materializes only its own."""
        build = partial(config.instantiate, cfg.model)
        fresh = adapter_state_dict is None
        if fresh:
            with training.set_default_dtype(self._dtype), torch.device("meta"):
                meta_model = build()
            adapter_state_dict = _fresh_adapter_state_dict(meta_model)
        model = training.build_sharded_model(
            build,
            # Strict: every base weight and every adapter weight.
            base_model_state_dict | adapter_state_dict,
            self._opts,
            prepare=_freeze_all_but_the_adapter,
        )
        if fresh:
            # Fresh DoRA magnitudes are the norms of the loaded base weights.
            for m in model.modules():
                if hasattr(m, "initialize_dora_magnitude"):
                    m.initialize_dora_magnitude()
        training.validate_expected_param_dtype(
            get_adapter_params(model).items(), dtype=self._dtype
        )
        # A no-op context when offloading is off.
        self._activations_handling_ctx = training.get_act_offloading_ctx_manager(
            model, self._opts.enable_activation_offloading
        )
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
        """Build the loader over one map-style dataset or the concatenation of a
        list, each rank reading its own share."""
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
            ds,
            batch_size=batch_size,
            shuffle=shuffle,
            collate_fn=collate_fn,
            num_replicas=self.world_size,
            rank=self.rank,
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
        """
        The training loop. Each step sums ``token-mean loss * tokens`` over its
        batches and multiplies the gradients by ``world_size / global token count``
        (FSDP averages them over ranks): inside backward with an in-backward
        optimizer (it updates during backward), after accumulation otherwise.
        """
        training.cleanup_before_training()
        if self._opts.compile["model"]:
            utils.log_rank_zero(
                log, "The model compiles in its first forward: expect a slow step 1."
            )
        gradient_accumulation_steps = self._opts.gradient_accumulation_steps
        self._optimizer.zero_grad(set_to_none=True)
        # This rank's totals over the current step's batches.
        # A step without any target divides them by 1 (clamp): its loss and
        # gradients are exactly zero.
        running_loss = torch.zeros((), device=self._device)
        num_tokens = torch.zeros((), dtype=torch.long, device=self._device)
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
                # Token sums, so batches and ranks add up and divide by the total once.
                loss = loss * batch_tokens
                running_loss += loss.detach()
                num_tokens += batch_tokens
                if self._optimizer_in_bwd:
                    # One batch per step: its global token count is the step's. The
                    # optimizer scales, clips and applies each gradient in backward.
                    torch.distributed.all_reduce(num_tokens)
                    self._optimizer.backward(
                        loss, grad_scale=self.world_size / num_tokens.clamp(min=1)
                    )
                else:
                    loss.backward()
                del loss
                if (idx + 1) % gradient_accumulation_steps != 0:
                    continue

                if self._optimizer_in_bwd:
                    # The update already happened; backward measured the gradients
                    # (a collective: every rank reads it).
                    grad_norm = self._optimizer.grad_norm
                else:
                    torch.distributed.all_reduce(num_tokens)
                    grad_norm = training.scale_and_clip_grads_(
                        self._model.parameters(),
                        self.world_size / num_tokens.clamp(min=1),
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

                torch.distributed.all_reduce(running_loss)
                self._step_logger.log(
                    self.progress.global_step,
                    loss=running_loss.item() / max(num_tokens.item(), 1),
                    num_tokens=num_tokens.item(),
                    lr=training.get_lr(self._optimizer),
                    grad_norm=grad_norm,
                )
                running_loss.zero_()
                num_tokens.zero_()
                # A step checkpoint, when one is due.
                self._checkpoint.save()
                # Once per optimizer step: the profiler's schedule counts those.
                self._profiler.step()

            self.progress.epochs_run += 1
            # The epoch's step checkpoint, then its export (epoch_{N}).
            self._checkpoint.save(epoch_end=True)
        self._profiler.stop()

    def cleanup(self) -> None:
        # An asynchronous save still in flight needs the process group.
        self._checkpoint.close()
        self._step_logger.close()
        destroy_process_group()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run --nproc_per_node N lora_finetune_distributed --config
    <config>``.

    Config values come from the config file, overridden by ``key=value`` arguments on
    the command line.
    """
    config.log_config(recipe_name="LoRAFinetuneRecipeDistributed", cfg=cfg)
    recipe = LoRAFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
