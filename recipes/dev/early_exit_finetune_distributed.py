"""Full fine-tuning of a decoder LLM with FSDP2, layer dropout and early-exit loss
(LayerSkip-style training: every chosen layer learns to predict the next token).

Run it with ``tune run --nproc_per_node N dev/early_exit_finetune_distributed
--config <config>`` (CUDA with NCCL, or ``device=cpu`` with gloo). See
:class:`EarlyExitFinetuneRecipeDistributed` for features and config keys.
"""

import functools
import os
import sys
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.distributed import destroy_process_group, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtune import config, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset, PackedDataset
from torchtune.modules.common_utils import slice_str_to_array
from torchtune.modules.early_exit_loss import EarlyExitCurriculum, early_exit_loss
from torchtune.modules.layer_dropout import LayerDropout, prepare_layer_dropout
from torchtune.recipe_interfaces import FTRecipeInterface

log = utils.get_logger("DEBUG")


class EarlyExitFinetuneRecipeDistributed(FTRecipeInterface):
    """
    Full finetuning recipe for dense transformer LLMs such as Llama2 with layer dropout
    and early-exit loss, on one or more processes (``tune run --nproc_per_node N``).
    Runs on CUDA with NCCL and on CPU with gloo. It is ``full_finetune_distributed``
    plus the two features below; the rest is the same.

    Features:
        - Early-exit loss (``early_exit_loss``; off when absent or null). The loss is a
          weighted sum of the next-token losses of the hidden states of chosen layers,
          each read out through the model's final norm and output projection (the
          exit of layer i reads layer i's output; 0.6.1 read its input, so its last
          layer never got a gradient and its earliest exit read the embeddings):
          ``early_exit_loss.layers`` picks them with numpy-like slice syntax (``":"``
          all, ``"0,4,8"``, ``"1::2"``); ``include_last_layer`` (default True) always
          adds the last; ``scale`` (default 1.0) weighs the early layers against the
          last; ``scale_fn`` (default
          ``torchtune.modules.early_exit_loss.sum_l_loss_scale``) spreads the weights
          over layers; ``curriculum`` (a class path, e.g.
          ``torchtune.modules.early_exit_loss.RotationalEarlyExitCurriculum``) changes
          the chosen layers every step; ``verbose`` is passed to it. Resuming builds
          the curriculum anew at the resumed step, as 0.6.1 did.
        - Layer dropout (``layer_dropout``; off when absent or null): each sample skips
          a layer with probability ``prob``, scaled over depth by ``layers_scale``
          (``uniform``, ``linear`` or ``exp``), on the layers that ``layers`` picks (same
          syntax, default all); ``disable_on_eval`` (default True). The draws are
          seeded from ``seed``, the step and the layer, and are the same on every rank
          (so every rank runs, or skips, each layer's collectives together): the same
          config draws the same in either optimizer mode and after a resume.
        - FSDP2. Parameters, gradients and optimizer states are sharded over the data
          parallel ranks. ``fsdp_cpu_offload`` offloads them to CPU;
          ``fsdp_reshard_after_forward: False`` keeps parameters gathered between
          forward and backward (SHARD_GRAD_OP); ``custom_sharded_layers`` names extra
          modules to shard on their own (e.g. ``['tok_embeddings', 'output']``).
        - Tensor parallelism. ``tensor_parallel_dim`` > 1 splits each model over that
          many ranks with ``tensor_parallel_plan``; FSDP shards over the rest.
        - Optimizer in backward. ``optimizer_in_bwd: True`` builds the optimizer as a
          ``training.OptimizerInBackward``, which updates each parameter as soon as its
          gradient is ready and frees the gradient, so the gradients of the whole model
          never exist at once. Everything else (LR scheduler, logging, checkpoints)
          treats it as the plain optimizer it imitates; checkpoints of either mode
          resume in the other.
          ``optimizer_in_bwd_bucket_cap_mb`` sets how many MiB of gradients one
          update in backward takes (default 4; 0: each parameter on its own).
        - Activation checkpointing (``enable_activation_checkpointing``, or selective
          with ``ac_mode``/``ac_option``) and activation offloading
          (``enable_activation_offloading``, CUDA only).
        - Precision: fp32 or bf16 (``dtype``). fp16 is refused.
        - Gradient accumulation: the global batch is
          ``batch_size * data parallel ranks * gradient_accumulation_steps``.
        - Gradient clipping (``clip_grad_norm``; ``inf`` measures and never clips),
          in every mode: in-backward clipping is exact, at the price of a second
          backward pass. ``grad_norm``, logged in every mode, is the norm before
          clipping.
        - ``compile``: ``True`` compiles model and loss; a mapping with keys ``model``,
          ``loss`` and ``optimizer_step`` chooses each.
        - Checkpointing (``checkpointer``, ``resume_from_checkpoint``), by
          :class:`~torchtune.training.CheckpointManager`: after every epoch, rank 0
          writes the weights to ``epoch_{N}`` through the configured checkpointer,
          and every rank its shards of a step checkpoint (trainable weights,
          optimizer, recipe, dataloader and RNG state; written whole or not at all) to
          ``output_dir/step_{global_step}/``. ``save_every_n_steps: N`` also saves one
          every N steps, ``enable_async_checkpointing`` writes them in the background,
          and ``checkpointer.keep_last_n_checkpoints: K`` keeps the newest K of them.
          ``resume_from_checkpoint: True`` continues from the newest whole step
          checkpoint, mid-epoch included (a damaged one is skipped with a warning), or
          from a torchtune 0.6.1 epoch checkpoint.
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
        ValueError: ``early_exit_loss`` set with a ``loss`` whose ``reduction`` is not
            ``"mean"`` (e.g. ``CEWithChunkedOutputLoss``): the early-exit loss reads
            per-token losses from a copy of it with ``reduction="none"``.
        ValueError: ``tensor_parallel_dim`` > 1 without a ``tensor_parallel_plan``,
            with a fused optimizer, or not dividing the world size.

        Every refusal but the world size's happens here, before the process group,
        the model or any file.
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Every refusal comes before the process group, the model or any file.
        self._opts = training.RecipeOptions.from_config(cfg, distributed=True)
        self._device, self._dtype = self._opts.device, self._opts.dtype
        self._optimizer_in_bwd = self._opts.optimizer_in_bwd
        # The early-exit loss takes per-token losses from a copy of the loss with
        # reduction="none", and a token mean from them: only a mean-reducing loss
        # module can be copied so. Building one is cheap and touches nothing.
        self._cfg_early_exit_loss = cfg.get("early_exit_loss", None)
        if self._cfg_early_exit_loss:
            reduction = getattr(config.instantiate(cfg.loss), "reduction", None)
            if reduction != "mean":
                raise ValueError(
                    f"early_exit_loss needs a loss with reduction='mean', but "
                    f"loss._component_={cfg.loss._component_} has reduction="
                    f"{reduction!r}: the early-exit loss computes per-token losses "
                    "of every chosen layer from a copy of it. Set "
                    "loss._component_=torch.nn.CrossEntropyLoss (with "
                    "ignore_index=-100), or early_exit_loss=null."
                )
        self._tp_dim = cfg.get("tensor_parallel_dim", 1)
        self._tp_plan = config.instantiate(cfg.get("tensor_parallel_plan", None))
        if self._tp_dim > 1 and self._tp_plan is None:
            raise ValueError(
                "Tensor Parallel plan needs to be provided when tensor parallel is enabled."
            )
        if self._tp_dim > 1 and cfg.optimizer.get("fused", False):
            raise ValueError(
                "Tensor parallelism is currently incompatible with fused optimizer."
            )
        self._checkpoint = training.CheckpointManager(
            training.CheckpointOptions.from_config(cfg)
        )

        torch.distributed.init_process_group(self._opts.process_group_backend)
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0
        if self.world_size % self._tp_dim != 0:
            raise ValueError(
                f"world_size {self.world_size} must be divisible by tensor_parallel_dim {self._tp_dim}"
            )

        # All ranks agree on the seed (set_seed broadcasts a random one if it is null).
        self.seed = training.set_seed(
            seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None)
        )
        # Where training stands; a resumed run takes it from the checkpoint.
        self.progress = training.TrainingProgress(total_epochs=cfg.epochs)

    def setup(self, cfg: DictConfig) -> None:
        """
        Builds, in order: model (sharded, with the base or resumed weights, and its
        layer dropout), tokenizer, optimizer (with resumed state), loss, data, early-
        exit layers, LR scheduler and profiler.
        """
        if self._opts.fsdp_cpu_offload:
            # The CPU optimizer step is ~2x faster with every core in intra-op use.
            training.set_torch_num_threads()

        checkpoint_dict = self._checkpoint.load_base_checkpoint()
        self._model = self._setup_model(cfg, checkpoint_dict[training.MODEL_KEY])
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(cfg.optimizer)

        self._loss_fn = config.instantiate(cfg.loss)
        # The early-exit loss copies the loss module with reduction="none", which a
        # compiled module would not pass on: with it, the loss stays uncompiled.
        if self._opts.compile["loss"] and not self._cfg_early_exit_loss:
            # A new module, except for a chunked loss (compiled in place).
            self._loss_fn = training.compile_loss(
                self._loss_fn, verbose=self._is_rank_zero
            )
        if hasattr(self._loss_fn, "num_output_chunks"):
            # A chunked output loss takes the logits in as many chunks.
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        utils.log_rank_zero(log, "Loss is initialized.")

        self._dataloader = self._setup_data(
            cfg_dataset=cfg.dataset,
            shuffle=cfg.shuffle,
            batch_size=cfg.batch_size,
            collate_fn=cfg.get("collate_fn", "torchtune.data.padded_collate_sft"),
        )
        # Full optimizer steps per epoch, at most max_steps_per_epoch (null: all).
        steps = len(self._dataloader) // self._opts.gradient_accumulation_steps
        self._steps_per_epoch = min(steps, cfg.get("max_steps_per_epoch") or steps)
        # Saved with every step checkpoint, and put back on resume: the trained
        # weights, optimizer, data position, LR schedule, RNG and progress.
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

        # The curriculum knows the total steps and continues from the resumed one.
        self._early_exit_layers, self._early_exit_curriculum = (
            self._setup_early_exit_loss(self._cfg_early_exit_loss)
        )
        if self._early_exit_layers is not None:
            self._final_hidden = None
            self._model.norm.register_forward_pre_hook(self._keep_final_hidden)
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
        self, cfg: DictConfig, model_state_dict: dict[str, Any]
    ) -> nn.Module:
        """
        Builds the model on the meta device (no memory), applies tensor parallelism,
        activation checkpointing and FSDP2, loads the full state dict into the
        shards (each rank materializes only its own), then prepares what the
        early-exit loss and layer dropout need.
        """
        dp_dim = self.world_size // self._tp_dim
        device_mesh = init_device_mesh(
            self._device.type,
            mesh_shape=(dp_dim, self._tp_dim),
            mesh_dim_names=("dp", "tp"),
        )
        self.dp_size = device_mesh["dp"].size()
        self.dp_rank = device_mesh["dp"].get_local_rank()
        # Compile, activation checkpointing and FSDP2 as self._opts ask.
        model = training.build_sharded_model(
            functools.partial(config.instantiate, cfg.model),
            model_state_dict,
            self._opts,
            device_mesh=device_mesh,
            tp_plan=self._tp_plan,
        )
        self._activations_handling_ctx = training.get_act_offloading_ctx_manager(
            model, self._opts.enable_activation_offloading
        )
        if self._cfg_early_exit_loss and isinstance(model, FSDPModule):
            # The early-exit loss calls the model's norm and output projection after
            # forward, so the root's parameters (those not in a layer) must stay
            # gathered until backward; FSDP frees them after forward when asked to
            # reshard, as the recipe does.
            model.set_reshard_after_forward(False, recurse=False)
        cfg_layer_dropout = cfg.get("layer_dropout", None)
        if cfg_layer_dropout:
            # Before the optimizer: the wrapper puts ".module" in the parameters'
            # names, which the optimizer's state dict is keyed by, on save and load.
            prepare_layer_dropout(
                model.layers,
                prob_max=cfg_layer_dropout.get("prob", 0.0),
                prob_layer_scale=cfg_layer_dropout.get("layers_scale", "uniform"),
                layers_str=cfg_layer_dropout.get("layers", ":"),
                disable_on_eval=cfg_layer_dropout.get("disable_on_eval", True),
            )
        self._layer_dropouts = [
            m for m in model.modules() if isinstance(m, LayerDropout)
        ]
        return model

    def _setup_optimizer(self, cfg_optimizer: DictConfig) -> torch.optim.Optimizer:
        """
        The only place that tells the two modes apart. ``OptimizerInBackward`` has the
        plain optimizer's groups, state and state dict format, so the state of either
        mode loads into either, and nothing downstream needs to know which one it got.

        Both get every parameter of the model, as in 0.6.1 and the other recipes:
        frozen ones get no state (and no in-backward hook), and the state dicts of a
        partly frozen model hold the same parameters in both modes and in 0.6.1.
        """
        return training.build_optimizer(
            self._model.parameters(),
            functools.partial(config.instantiate, cfg_optimizer),
            in_backward=self._optimizer_in_bwd,
            bucket_cap_mb=self._opts.bucket_cap_mb,
            max_norm=self._opts.clip_grad_norm,
        )

    def _setup_early_exit_loss(
        self, cfg_early_exit_loss: DictConfig | None
    ) -> tuple[list[bool] | None, EarlyExitCurriculum | None]:
        """
        Which layers' hidden states the early-exit loss reads (one flag per layer;
        ``None`` when it is off), and the curriculum that changes them, if any.
        """
        if not cfg_early_exit_loss:
            return None, None
        self._early_exit_loss_scale = cfg_early_exit_loss.get("scale", 1.0)
        self._early_exit_loss_scale_fn = _get_component_from_path(
            cfg_early_exit_loss.get(
                "scale_fn", "torchtune.modules.early_exit_loss.sum_l_loss_scale"
            )
        )
        num_layers = len(self._model.layers)
        layers = slice_str_to_array(cfg_early_exit_loss.get("layers", ":"), num_layers)
        include_last_layer = cfg_early_exit_loss.get("include_last_layer", True)
        curriculum_path = cfg_early_exit_loss.get("curriculum", None)
        if not curriculum_path:
            if include_last_layer:
                layers[num_layers - 1] = True
            return layers, None
        curriculum = _get_component_from_path(curriculum_path)(
            do_output_hidden_states=layers,
            max_steps=self.progress.total_epochs * self._steps_per_epoch,
            train_last_layer=include_last_layer,
            last_step=self.progress.global_step,
            verbose=cfg_early_exit_loss.get("verbose", False),
        )
        return curriculum.get(), curriculum

    def _set_output_hidden_states(self) -> None:
        """
        Makes the model return the hidden states the early-exit loss reads now. The
        model returns the *input* of each layer it is asked for, so layer i's output
        is asked for as layer i + 1's; the last layer's output is the final norm's
        input, which ``_keep_final_hidden`` keeps.
        """
        if self._early_exit_layers is not None:
            self._model.output_hidden_states = [
                i + 1 for i, chosen in enumerate(self._early_exit_layers[:-1]) if chosen
            ]

    def _keep_final_hidden(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook of the model's final norm: keeps the last layer's output."""
        self._final_hidden = args[0]

    def _exit_hidden_states(self, outputs: Any) -> tuple[Any, dict[int, Any]]:
        """
        Splits the model's outputs into the logits and {layer: that layer's output}
        for the early-exit loss (in layer order; empty when it is off).
        """
        if self._early_exit_layers is None:
            return outputs, {}
        logits = outputs
        hidden_states = {}
        if self._model.output_hidden_states:
            # With hidden states requested the model returns [*hidden, logits].
            logits = outputs.pop(-1)
            hidden_states = {
                i - 1: h
                for i, h in zip(self._model.output_hidden_states, outputs, strict=True)
            }
        if self._early_exit_layers[-1]:
            hidden_states[len(self._early_exit_layers) - 1] = self._final_hidden
        self._final_hidden = None
        return logits, hidden_states

    def _seed_layer_dropout(self) -> None:
        """
        Seeds each layer dropout's generator from (seed, step, layer): a step draws
        the same in both optimizer modes and when resumed, and on every rank, which
        FSDP needs (a layer all of whose samples are dropped is not run, so neither
        are its all-gather and reduce-scatter: every rank must skip it alike).
        """
        for layer, dropout in enumerate(self._layer_dropouts):
            dropout.generator.manual_seed(
                hash((self.seed, self.progress.global_step, layer)) & (2**63 - 1)
            )

    def _setup_data(
        self,
        cfg_dataset: DictConfig,
        shuffle: bool,
        batch_size: int,
        collate_fn: str,
    ) -> StatefulDataLoader:
        """
        Map-style dataset (or a list of them, concatenated) split over the data
        parallel ranks; tensor parallel ranks of one replica read the same batches.
        """
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
            num_replicas=self.dp_size,
            rank=self.dp_rank,
        )

    def train(self) -> None:
        """
        The training loop. Each step sums ``token-mean loss * tokens`` over its
        batches and multiplies the gradients by ``world_size / global token count``
        (FSDP averages them over ranks): inside backward with an in-backward
        optimizer (it updates during backward), after accumulation otherwise.
        """
        training.cleanup_before_training()
        gradient_accumulation_steps = self._opts.gradient_accumulation_steps
        self._optimizer.zero_grad(set_to_none=True)
        # Summed over the step's batches; all-reduced over ranks once per step.
        # A step without any target divides them by 1 (clamp): its loss and
        # gradients are exactly zero.
        running_loss = torch.zeros((), device=self._device)
        num_tokens = torch.zeros((), dtype=torch.long, device=self._device)

        self._set_output_hidden_states()
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
                if idx % gradient_accumulation_steps == 0:
                    self._seed_layer_dropout()
                utils.batch_to_device(batch, self._device)
                # Position t predicts token t + 1 (a batch without targets: see the
                # helper).
                labels, current_num_tokens = training.next_token_labels(
                    batch.pop("labels"), self._loss_fn.ignore_index
                )
                num_tokens += current_num_tokens
                with self._activations_handling_ctx:
                    outputs = self._model(**batch)
                logits, hidden_states = self._exit_hidden_states(outputs)
                if not isinstance(logits, list):
                    labels = labels.reshape(-1)
                    logits = logits.reshape(-1, logits.size(-1))
                if hidden_states:
                    # It reads out the last layer itself when it counts, so the
                    # model's own logits are not used.
                    loss = early_exit_loss(
                        self._model,
                        hidden_states,
                        labels,
                        self._loss_fn,
                        self._early_exit_loss_scale,
                        self._early_exit_loss_scale_fn,
                    )
                else:
                    loss = self._loss_fn(logits, labels)
                # Both average over this batch's tokens; undo it so batches and ranks
                # can be summed and divided by the total once.
                loss = loss * current_num_tokens
                del logits, outputs, hidden_states  # free them before backward's peak
                running_loss += loss.detach()
                if self._optimizer_in_bwd:
                    # One batch per step: its global token count is the step's. The
                    # optimizer scales, clips and applies each gradient in backward.
                    torch.distributed.all_reduce(num_tokens)
                    self._optimizer.backward(
                        loss,
                        grad_scale=self.world_size / num_tokens.clamp(min=1),
                        # Clipping backpropagates twice; the early-exit loss reads
                        # out hidden states with the root unit's norm and output
                        # outside its forward: gather them again for the second
                        # (one process leaves the model unsharded: nothing to do).
                        before_update_pass=(
                            self._model.unshard
                            if isinstance(self._model, FSDPModule)
                            else None
                        ),
                    )
                else:
                    loss.backward()
                if (idx + 1) % gradient_accumulation_steps != 0:
                    continue

                if self._optimizer_in_bwd:
                    # Updates already happened; the optimizer measured the gradients
                    # it used (a collective: every rank reads it).
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
                if self._early_exit_curriculum is not None:
                    self._early_exit_curriculum.step()
                    self._early_exit_layers = self._early_exit_curriculum.get()
                    self._set_output_hidden_states()

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
            # The epoch's step checkpoint, then its weights (epoch_{N}).
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
    config.log_config(recipe_name="EarlyExitFinetuneRecipeDistributed", cfg=cfg)
    recipe = EarlyExitFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
