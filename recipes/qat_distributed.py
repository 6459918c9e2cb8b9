"""Quantization-aware full fine-tuning of a decoder LLM with FSDP2.

Run it with ``tune run --nproc_per_node N qat_distributed --config <config>`` (CUDA
with NCCL, or ``device=cpu`` with gloo); multi-node through torchrun's own arguments.
See :class:`QATRecipeDistributed` for features and config keys.
"""

import functools
import sys
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.distributed import destroy_process_group
from torchao.quantization.qat.linear import enable_linear_fake_quant
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtune import config, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset, PackedDataset
from torchtune.recipe_interfaces import FTRecipeInterface

log = utils.get_logger("DEBUG")


class QATRecipeDistributed(FTRecipeInterface):
    """
    Quantization-aware training (QAT) for dense transformer LLMs such as Llama2: full
    fine-tuning in which the linear layers see their weights (and, depending on the
    quantizer, their input activations) fake-quantized, so that the model quantized
    afterwards loses little accuracy. The checkpoints hold the unquantized weights in
    the training dtype; quantize them separately. Runs on one or more processes
    (``tune run --nproc_per_node N``), on CUDA with NCCL and on CPU with gloo.

    Features:
        - QAT. ``quantizer`` names a QAT quantizer, e.g.
          ``torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer`` with its
          ``groupsize``; its ``prepare`` swaps the model's linear layers for
          fake-quantized ones before the weights are loaded (a layer the model
          builder froze stays frozen).
        - Delayed fake quantization. With ``fake_quant_after_n_steps: N`` the first
          N steps train without fake quantization (letting weights and activations
          settle first), every later step with it; a resumed run picks up where the
          interrupted one was.
        - FSDP2. Parameters, gradients and optimizer states are sharded over the
          ranks. ``fsdp_cpu_offload`` offloads them to CPU (ignored on CPU);
          ``fsdp_reshard_after_forward: False`` keeps parameters gathered between
          forward and backward; ``custom_sharded_layers`` names extra modules to
          shard on their own (e.g. ``['tok_embeddings', 'output']``).
        - Optimizer in backward. ``optimizer_in_bwd: True`` builds the optimizer as a
          ``training.OptimizerInBackward``, which updates each parameter as soon as its
          gradient is ready and frees the gradient, so the gradients of the whole model
          never exist at once. Everything else (LR scheduler, logging, checkpoints)
          treats it as the plain optimizer it imitates; checkpoints of either mode
          (and torchtune 0.6.1's in-backward checkpoints) resume in either.
          ``optimizer_in_bwd_bucket_cap_mb`` sets how many MiB of gradients one
          update in backward takes (default 4; 0: each parameter on its own).
        - Activation checkpointing (``enable_activation_checkpointing``, or selective
          with ``ac_mode``/``ac_option``) and activation offloading
          (``enable_activation_offloading``, CUDA only).
        - Precision: fp32 or bf16 (``dtype``). fp16 is refused.
        - Gradient accumulation: the global batch is
          ``batch_size * ranks * gradient_accumulation_steps``.
        - Gradient clipping (``clip_grad_norm``; ``inf`` measures and never clips),
          in every mode: in-backward clipping is exact, at the price of a second
          backward pass. ``grad_norm``, logged in every mode, is the norm before
          clipping.
        - An optional ``lr_scheduler``; without one the lr stays constant.
        - Checkpointing (``checkpointer``, ``resume_from_checkpoint``), by
          :class:`~torchtune.training.CheckpointManager`: after every epoch, rank 0
          writes the weights to ``epoch_{N}`` through the configured checkpointer, and
          every rank its shards of a step checkpoint (the QAT-prepared model's
          weights, whose fake-quantized layers keep the base names and hold no state
          of their own, the optimizer, recipe, dataloader and RNG state; written whole
          or not at all) to ``output_dir/step_{global_step}/``.
          ``save_every_n_steps: N`` also saves one every N steps,
          ``enable_async_checkpointing`` writes them in the background, and
          ``checkpointer.keep_last_n_checkpoints: K`` keeps the newest K of them.
          ``resume_from_checkpoint: True`` continues from the newest whole step
          checkpoint, mid-epoch included (a damaged one is skipped with a warning), on
          as many processes as saved it, or from a torchtune 0.6.1 epoch checkpoint.
          Fake quantization is set from the resumed step count, as in the
          interrupted run.
        - Logging (metrics from rank 0), profiling and memory snapshots as in the other
          recipes.

    Args:
        cfg (DictConfig): OmegaConf object parsed from yaml file

    Raises:
        ValueError: an option :class:`~torchtune.training.RecipeOptions` or
            :class:`~torchtune.training.CheckpointManager` refuses (see theirs).
        PermissionError: ``output_dir`` or ``checkpointer.output_dir`` cannot be
            written.
        RuntimeError: see :class:`~torchtune.training.RecipeOptions`.
        ValueError: ``quantizer`` missing or not a QAT quantizer;
            ``fake_quant_after_n_steps`` not null or an integer >= 0; ``compile``
            turning anything on (fake-quantized layers are not compiled by this
            recipe).

        Every refusal happens here, before the process group, the model or any file.
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Every refusal comes before the process group, the model or any file.
        self._opts = training.RecipeOptions.from_config(cfg, distributed=True)
        self._device, self._dtype = self._opts.device, self._opts.dtype
        self._optimizer_in_bwd = self._opts.optimizer_in_bwd
        if any(self._opts.compile.values()):
            raise ValueError(
                f"compile={cfg.compile} is not supported by qat_distributed: it does "
                "not compile fake-quantized layers. Set compile=False."
            )
        # The quantizer is a small config object; building it here lets a wrong one
        # be refused before anything heavy is built.
        self._quantizer = self._setup_quantizer(cfg.get("quantizer", None))
        self._fake_quant_after_n_steps = cfg.get("fake_quant_after_n_steps", None)
        if self._fake_quant_after_n_steps is not None and not (
            isinstance(self._fake_quant_after_n_steps, int)
            and not isinstance(self._fake_quant_after_n_steps, bool)
            and self._fake_quant_after_n_steps >= 0
        ):
            raise ValueError(
                "fake_quant_after_n_steps must be null or an integer >= 0, got "
                f"{self._fake_quant_after_n_steps!r}."
            )
        self._checkpoint = training.CheckpointManager(
            training.CheckpointOptions.from_config(cfg)
        )

        torch.distributed.init_process_group(self._opts.process_group_backend)
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0

        # All ranks agree on the seed (set_seed broadcasts a random one if it is null).
        self.seed = training.set_seed(
            seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None)
        )
        # Where training stands; a resumed run takes it from the checkpoint.
        self.progress = training.TrainingProgress(total_epochs=cfg.epochs)

    def _setup_quantizer(self, cfg_quantizer: DictConfig | None) -> Any:
        """Builds the QAT quantizer, computing in the training dtype.

        Raises:
            ValueError: if ``cfg_quantizer`` is missing or not a QAT quantizer.
        """
        # ``quantizer=null`` on the command line leaves a section without a component.
        if cfg_quantizer is None or cfg_quantizer.get("_component_") is None:
            raise ValueError(
                "qat_distributed needs a quantizer, e.g. quantizer._component_="
                "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer."
            )
        quantizer = config.instantiate(cfg_quantizer)
        mode = training.quantization.get_quantizer_mode(quantizer)
        if mode is None or "qat" not in mode:
            raise ValueError(
                f"quantizer._component_={cfg_quantizer._component_} is not a QAT "
                f"quantizer (mode {mode}): fine-tuning needs one that fake-quantizes, "
                "e.g. torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer."
            )
        quantizer.precision = self._dtype
        return quantizer

    def setup(self, cfg: DictConfig) -> None:
        """
        Builds, in order: model (fake-quantized, sharded, with the base or resumed
        weights), tokenizer, optimizer (with resumed state), loss, data, metric logger,
        LR scheduler and profiler.
        """
        if self._opts.fsdp_cpu_offload:
            # The CPU optimizer step is ~2x faster with every core in intra-op use.
            training.set_torch_num_threads()

        checkpoint_dict = self._checkpoint.load_base_checkpoint()
        self._model = self._setup_model(cfg.model, checkpoint_dict[training.MODEL_KEY])
        # prepare() leaves fake quantization on; _update_fake_quant may turn it off.
        self._fake_quant_enabled = True
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(cfg.optimizer)

        self._loss_fn = config.instantiate(cfg.loss)
        if hasattr(self._loss_fn, "num_output_chunks"):
            # A chunked output loss takes the logits in as many chunks.
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        utils.log_rank_zero(log, "Loss is initialized.")

        self._dataloader = self._setup_data(
            cfg.dataset,
            shuffle=cfg.shuffle,
            batch_size=cfg.batch_size,
            collate_fn=cfg.get("collate_fn", "torchtune.data.padded_collate_sft"),
        )
        # Full optimizer steps per epoch, at most max_steps_per_epoch (null: all).
        steps = len(self._dataloader) // self._opts.gradient_accumulation_steps
        self._steps_per_epoch = min(steps, cfg.get("max_steps_per_epoch") or steps)
        # Saved with every step checkpoint, and put back on resume: the trained
        # weights, optimizer, data position, LR schedule, RNG and progress; fake
        # quantization follows the resumed step (_update_fake_quant, before each
        # batch).
        cfg_lr_scheduler = cfg.get("lr_scheduler", None)
        self._lr_scheduler = training.setup_lr_scheduler(
            cfg_lr_scheduler
            and functools.partial(config.instantiate, cfg_lr_scheduler),
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
        # With profile_memory on CUDA, also a memory snapshot of the profiled steps.
        self._profiler = training.setup_profiler(
            cfg.get(training.PROFILER_KEY, None), device=self._device
        )

    def _setup_model(
        self, cfg_model: DictConfig, state_dict: dict[str, Any]
    ) -> nn.Module:
        """Build the model, prepared by the quantizer and sharded as ``self._opts``
        ask, with its weights.

        The quantizer swaps in fake-quantized linear layers (on the meta device,
        before sharding); they keep the names and shapes of the layers they replace,
        so the base checkpoint, and a step checkpoint of the prepared model, load as
        they are.
        """
        model = training.build_sharded_model(
            functools.partial(config.instantiate, cfg_model),
            state_dict,
            self._opts,
            prepare=self._prepare_model,
        )
        # A no-op context when offloading is off.
        self._activations_handling_ctx = training.get_act_offloading_ctx_manager(
            model, self._opts.enable_activation_offloading
        )
        return model

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        """The quantizer's ``prepare``, keeping frozen what the model builder froze."""
        # prepare() replaces linear layers with new ones whose weights are all
        # trainable: put back by name what the model builder froze.
        requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
        model = self._quantizer.prepare(model)
        for name, param in model.named_parameters():
            if name in requires_grad:
                param.requires_grad_(requires_grad[name])
        return model

    def _setup_optimizer(self, cfg_optimizer: DictConfig) -> torch.optim.Optimizer:
        """
        The only place that tells the two modes apart. ``OptimizerInBackward`` has the
        plain optimizer's groups, state and state dict format, so the state of either
        mode loads into either, and nothing downstream needs to know which one it got.

        Both get every parameter of the model, as in 0.6.1 and the other recipes:
        frozen ones get no state (and no in-backward hook), and the state dicts of a
        partly frozen model hold the same parameters in both modes, in 0.6.1 and in
        the other recipes.
        """
        return training.build_optimizer(
            self._model.parameters(),
            functools.partial(config.instantiate, cfg_optimizer),
            in_backward=self._optimizer_in_bwd,
            bucket_cap_mb=self._opts.bucket_cap_mb,
            max_norm=self._opts.clip_grad_norm,
        )

    def _setup_data(
        self,
        cfg_dataset: DictConfig | ListConfig,
        *,
        shuffle: bool,
        batch_size: int,
        collate_fn: str,
    ) -> StatefulDataLoader:
        """Map-style dataset (or a list of them, concatenated) split over the ranks."""
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
            collate_fn = functools.partial(
                _get_component_from_path(collate_fn),
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

    def _update_fake_quant(self) -> None:
        """Fake quantization is off for the first ``fake_quant_after_n_steps`` steps
        and on after them; called before each batch, so a resumed run is in the state
        the interrupted one had at the same step."""
        enabled = (
            self._fake_quant_after_n_steps is None
            or self.progress.global_step >= self._fake_quant_after_n_steps
        )
        if enabled == self._fake_quant_enabled:
            return
        utils.log_rank_zero(
            log,
            f"Step {self.progress.global_step}: fake quantization "
            f"{'enabled' if enabled else 'disabled'}.",
        )
        # torchao's generic switch for every fake-quantized linear layer; its
        # per-quantizer 4w helpers also touch an activation quantizer that 4-bit
        # weight-only layers do not have.
        self._model.apply(functools.partial(enable_linear_fake_quant, enabled=enabled))
        self._fake_quant_enabled = enabled

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
                self._update_fake_quant()
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
    """
    Entry point for the recipe.

    Configurable parameters are read in the following order:
        - Parameters specified in config (see available configs through ``tune ls``)
        - Overwritten by arguments from the command-line
    """
    config.log_config(recipe_name="QATRecipeDistributed", cfg=cfg)
    recipe = QATRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
