"""Full-weight Direct Preference Optimization (DPO) of a decoder LLM with FSDP2.

Run it with ``tune run --nproc_per_node N full_dpo_distributed --config <config>``
(CUDA with NCCL, or ``device=cpu`` with gloo). See :class:`FullDPORecipeDistributed`
for features and config keys.
"""

import contextlib
import os
import sys
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.distributed import destroy_process_group
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtune import config, rlhf, training, utils
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_dpo
from torchtune.datasets import ConcatDataset
from torchtune.recipe_interfaces import FTRecipeInterface

# Per-step means over the global batch of preference pairs, logged as named.
_PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "log_probs/chosen",
    "log_probs/rejected",
    "logits/chosen",
    "logits/rejected",
)


class FullDPORecipeDistributed(FTRecipeInterface):
    """
    Full-weight preference alignment (DPO and its variants) of dense transformer LLMs
    such as Llama2 and Llama3, on one or more processes (``tune run --nproc_per_node
    N``). Runs on CUDA with NCCL and on CPU with gloo.

    Two copies of the model are built from the configured ``model``: the policy,
    initialized from ``checkpointer`` and trained, and the reference, initialized
    from ``ref_checkpointer`` (the original weights, also when resuming), frozen and
    in eval mode. Each batch holds ``batch_size`` preference pairs; both models score
    the chosen and the rejected response of each pair in one forward pass, and the
    loss compares the policy's log-probability ratio with the reference's.

    Losses (``loss``):
        - :class:`~torchtune.rlhf.loss.DPOLoss`: Direct Preference Optimization.
        - :class:`~torchtune.rlhf.loss.RSOLoss`: Statistical Rejection Sampling
          Optimization (hinge loss).

    Features:
        - FSDP2. Both models are sharded over the ranks; ``fsdp_cpu_offload``
          offloads the parameters, gradients and optimizer states to CPU (ignored on
          CPU); ``fsdp_reshard_after_forward: False`` keeps parameters gathered
          between forward and backward; ``custom_sharded_layers`` names extra modules
          to shard on their own.
        - Optimizer in backward. ``optimizer_in_bwd: True`` builds the policy's
          optimizer as a ``training.OptimizerInBackward``, which updates each
          parameter as soon as its gradient is ready and frees the gradient, so the
          policy's gradients never exist all at once. The LR scheduler, logging and
          checkpoints treat it as the plain optimizer it imitates; checkpoints of
          either mode resume in the other.
          ``optimizer_in_bwd_bucket_cap_mb`` sets how many MiB of gradients one
          update in backward takes (default 4; 0: each parameter on its own).
        - Activation checkpointing (``enable_activation_checkpointing``, or selective
          with ``ac_mode``/``ac_option``) and activation offloading
          (``enable_activation_offloading``, CUDA only), for the policy; the
          reference runs without autograd and keeps no activations.
        - Precision: fp32 or bf16 (``dtype``). fp16 is refused.
        - Gradient accumulation: the global batch is
          ``batch_size * ranks * gradient_accumulation_steps`` pairs.
        - Gradient clipping (``clip_grad_norm``; ``inf`` measures and never clips),
          in every mode: in-backward clipping is exact, at the price of a second
          backward pass. ``grad_norm``, logged in every mode, is the norm before
          clipping.
        - ``compile``: ``True`` compiles both models and the loss; a mapping with keys
          ``model``, ``loss`` and ``optimizer_step`` chooses each.
        - Checkpointing (``checkpointer``, ``resume_from_checkpoint``), by
          :class:`~torchtune.training.CheckpointManager`, of the policy only: after
          every epoch, rank 0 writes its weights to ``epoch_{N}`` through
          ``checkpointer``, and every rank its shards of a step checkpoint (the
          policy's weights and optimizer state, the recipe state, each rank's
          dataloader and RNG state; written whole or not at all) to
          ``output_dir/step_{global_step}/``. ``save_every_n_steps: N`` also saves one
          every N steps, ``enable_async_checkpointing`` writes them in the background,
          and ``checkpointer.keep_last_n_checkpoints: K`` keeps the newest K of them.
          ``resume_from_checkpoint: True`` continues from the newest whole step
          checkpoint, mid-epoch included (a damaged one is skipped with a warning), on
          as many processes as saved it, or from a torchtune 0.6.1 epoch checkpoint
          (an optimizer state saved by a 0.6.1 ``optimizer_in_bwd`` run loads too).
          The reference is never saved: it is frozen, and read from
          ``ref_checkpointer`` again on resume.
        - Logging from rank 0: loss, lr, grad_norm, tokens per second and the pair
          metrics ``rewards/{chosen,rejected,accuracies,margins}``,
          ``log_probs/{chosen,rejected}`` and ``logits/{chosen,rejected}``, each a
          mean over the step's global batch (the logit means take in every position
          of the padded batch, as in 0.6.1). Profiling (``profiler``; its
          ``profile_memory`` also records a CUDA memory snapshot of the profiled
          steps).

    Args:
        cfg (DictConfig): OmegaConf object parsed from yaml file

    Raises:
        ValueError: an option :class:`~torchtune.training.RecipeOptions` or
            :class:`~torchtune.training.CheckpointManager` refuses (see theirs).
        PermissionError: ``output_dir`` or ``checkpointer.output_dir`` cannot be
            written.
        RuntimeError: see :class:`~torchtune.training.RecipeOptions`.

        Every refusal happens here, before the process group, the models or any file.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._opts = training.RecipeOptions.from_config(cfg, distributed=True)
        self._device, self._dtype = self._opts.device, self._opts.dtype
        self._optimizer_in_bwd = self._opts.optimizer_in_bwd
        # The policy's checkpoints; the reference is read once and never saved.
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

    def setup(self, cfg: DictConfig) -> None:
        """
        Builds, in order: policy and reference models (sharded, with their weights),
        tokenizer, optimizer (with resumed state), loss, data, metric logger, LR
        scheduler and profiler.
        """
        if self._opts.fsdp_cpu_offload:
            # The CPU optimizer step is ~2x faster with every core in intra-op use.
            training.set_torch_num_threads()

        checkpoint_dict = self._checkpoint.load_base_checkpoint()
        # The reference always starts from the original weights, never from a
        # resumed policy, so its checkpointer never loads recipe state.
        ref_state_dict = config.instantiate(
            cfg.ref_checkpointer, should_load_recipe_state=False
        ).load_checkpoint()[training.MODEL_KEY]
        self._model = self._setup_model(
            cfg.model, checkpoint_dict[training.MODEL_KEY], trainable=True
        )
        # A no-op context when offloading is off.
        self._activations_handling_ctx = training.get_act_offloading_ctx_manager(
            self._model, self._opts.enable_activation_offloading
        )
        self._ref_model = self._setup_model(cfg.model, ref_state_dict, trainable=False)
        del ref_state_dict
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(cfg.optimizer)

        self._loss_fn = config.instantiate(cfg.loss)
        if self._opts.compile["loss"]:
            # A new module, except for a chunked loss (compiled in place).
            self._loss_fn = training.compile_loss(
                self._loss_fn, verbose=self._is_rank_zero
            )
        self._dataloader = self._setup_data(
            cfg_dataset=cfg.dataset, shuffle=cfg.shuffle, batch_size=cfg.batch_size
        )
        # Full optimizer steps per epoch, at most max_steps_per_epoch (null: all).
        steps = len(self._dataloader) // self._opts.gradient_accumulation_steps
        self._steps_per_epoch = min(steps, cfg.get("max_steps_per_epoch") or steps)
        # Saved with every step checkpoint, and put back on resume: the policy's
        # trained weights, optimizer, data position, LR schedule, RNG and progress
        # (the reference is never saved).
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
        self._profiler = training.setup_profiler(
            cfg.get(training.PROFILER_KEY, None), device=self._device
        )

    def _setup_model(
        self, cfg_model: DictConfig, state_dict: dict[str, Any], *, trainable: bool
    ) -> nn.Module:
        """Build the policy (``trainable``) or the reference, compiled and sharded as
        ``self._opts`` ask, with its weights. The reference runs without autograd:
        no activation checkpointing, frozen, in eval mode. Dropout is off in both, so
        that their log-probabilities are comparable."""
        model = training.build_sharded_model(
            partial(config.instantiate, cfg_model),
            state_dict,
            self._opts,
            checkpoint_activations=trainable,
        )
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        training.disable_dropout(model)
        return model

    def _setup_optimizer(self, cfg_optimizer: DictConfig) -> torch.optim.Optimizer:
        """
        The only place that tells the two modes apart. Only the policy is optimized.
        ``OptimizerInBackward`` has the plain optimizer's groups, state and state dict
        format, so the state of either mode loads into either.
        """
        return training.build_optimizer(
            self._model.parameters(),
            partial(config.instantiate, cfg_optimizer),
            in_backward=self._optimizer_in_bwd,
            bucket_cap_mb=self._opts.bucket_cap_mb,
            max_norm=self._opts.clip_grad_norm,
        )

    def _setup_data(
        self, cfg_dataset: DictConfig, shuffle: bool, batch_size: int
    ) -> StatefulDataLoader:
        """
        Map-style preference dataset (or a list of them, concatenated) split over the
        ranks. Each batch is ``(input_ids, labels)`` of ``2 * batch_size`` rows: the
        chosen responses, then the rejected ones, right-padded to one length.
        """
        if isinstance(cfg_dataset, ListConfig):
            ds = ConcatDataset(
                datasets=[config.instantiate(c, self._tokenizer) for c in cfg_dataset]
            )
        else:
            ds = config.instantiate(cfg_dataset, self._tokenizer)
        return training.stateful_dataloader(
            ds,
            batch_size=batch_size,
            shuffle=shuffle,
            collate_fn=partial(
                padded_collate_dpo,
                padding_idx=self._tokenizer.pad_id,
                ignore_idx=CROSS_ENTROPY_IGNORE_IDX,
            ),
            num_replicas=self.world_size,
            rank=self.rank,
        )

    def concatenated_forward(
        self,
        model: nn.Module,
        batch: tuple[torch.Tensor, torch.Tensor],
        context: AbstractContextManager | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """
        One forward pass of ``model`` over the chosen and rejected responses of the
        batch together.

        Args:
            model (nn.Module): the policy or the reference model.
            batch (tuple[torch.Tensor, torch.Tensor]): ``input_ids`` and ``labels``,
                the chosen rows first, then as many rejected ones.
            context (AbstractContextManager | None): entered around the model's
                forward (the policy's activation offloading). Default: None (none).

        Returns:
            tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: the summed
            log-probabilities of the chosen and of the rejected responses (one per
            pair), and the mean logit over the chosen and over the rejected rows
            (detached, for logging).
        """
        input_ids, labels = batch
        num_chosen = input_ids.shape[0] // 2
        with contextlib.nullcontext() if context is None else context:
            logits = model(input_ids)
        log_probs = rlhf.get_batch_log_probs(
            logits, labels, return_average_logprobs=False
        )
        logits = logits.detach()
        return (
            log_probs[:num_chosen],
            log_probs[num_chosen:],
            logits[:num_chosen].mean(),
            logits[num_chosen:].mean(),
        )

    def train(self) -> None:
        """
        The training loop. The loss of a batch is the mean over its pairs, divided by
        ``gradient_accumulation_steps``; FSDP averages the gradients over ranks. Every
        batch holds ``batch_size`` pairs, so the step's gradient is the mean over its
        global batch of pairs, and that normalization is known before backward: both
        modes backpropagate the same loss. Only where the gradients are measured and
        clipped differs: inside backward with an in-backward optimizer, after it
        otherwise.
        """
        training.cleanup_before_training()
        gradient_accumulation_steps = self._opts.gradient_accumulation_steps
        self._optimizer.zero_grad(set_to_none=True)
        # Summed over the step's batches (each already divided by the number of
        # batches in the step); averaged over ranks once per step.
        running = torch.zeros(1 + len(_PAIR_METRICS), device=self._device)
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
                batch = tuple(t.to(self._device) for t in batch)
                # Padding included, chosen and rejected rows alike, as in 0.6.1.
                num_tokens += batch[0].numel()
                (
                    policy_chosen_log_probs,
                    policy_rejected_log_probs,
                    policy_chosen_logits,
                    policy_rejected_logits,
                ) = self.concatenated_forward(
                    self._model, batch, self._activations_handling_ctx
                )
                with torch.no_grad():
                    ref_chosen_log_probs, ref_rejected_log_probs, _, _ = (
                        self.concatenated_forward(self._ref_model, batch)
                    )
                losses, chosen_rewards, rejected_rewards = self._loss_fn(
                    policy_chosen_log_probs,
                    policy_rejected_log_probs,
                    ref_chosen_log_probs,
                    ref_rejected_log_probs,
                )
                loss = losses.mean() / gradient_accumulation_steps
                # The loss, then _PAIR_METRICS in order; in fp32 whatever the dtype.
                batch_metrics = torch.stack(
                    [
                        m.float()
                        for m in (
                            losses.detach().mean(),
                            chosen_rewards.mean(),
                            rejected_rewards.mean(),
                            (chosen_rewards > rejected_rewards).float().mean(),
                            policy_chosen_log_probs.detach().mean(),
                            policy_rejected_log_probs.detach().mean(),
                            policy_chosen_logits,
                            policy_rejected_logits,
                        )
                    ]
                )
                running += batch_metrics / gradient_accumulation_steps
                if self._optimizer_in_bwd:
                    # Clips and applies the policy's gradients inside backward.
                    self._optimizer.backward(loss)
                else:
                    loss.backward()
                if (idx + 1) % gradient_accumulation_steps != 0:
                    continue

                if self._optimizer_in_bwd:
                    # Updates already happened; the optimizer measured the gradients
                    # it used (a collective: every rank reads it).
                    grad_norm = self._optimizer.grad_norm
                else:
                    grad_norm = training.scale_and_clip_grads_(
                        self._model.parameters(), max_norm=self._opts.clip_grad_norm
                    )
                # Stop before a non-finite step updates (plain) or is saved; the
                # first of the metrics is the loss.
                training.stop_if_not_finite(
                    running[0],
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

                # gloo has no AVG reduction: sum, then divide.
                torch.distributed.all_reduce(running)
                torch.distributed.all_reduce(num_tokens)
                step_loss, *pair_means = (running / self.world_size).tolist()
                pair_metrics = dict(zip(_PAIR_METRICS, pair_means, strict=True))
                pair_metrics["rewards/margins"] = (
                    pair_metrics["rewards/chosen"] - pair_metrics["rewards/rejected"]
                )
                # num_tokens is summed over the ranks: the logger divides the
                # throughput by world_size.
                self._step_logger.log(
                    self.progress.global_step,
                    loss=step_loss,
                    num_tokens=num_tokens.item(),
                    lr=training.get_lr(self._optimizer),
                    grad_norm=grad_norm,
                    **pair_metrics,
                )
                running.zero_()
                num_tokens.zero_()
                # A step checkpoint, when one is due.
                self._checkpoint.save()
                # Once per optimizer step: the profiler's schedule counts those.
                self._profiler.step()

            # The policy's checkpoints; the reference is read from ref_checkpointer
            # again on resume.
            self.progress.epochs_run += 1
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
    config.log_config(recipe_name="FullDPORecipeDistributed", cfg=cfg)
    recipe = FullDPORecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
