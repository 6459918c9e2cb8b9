"""Full-weight Direct Preference Optimization (DPO) of a decoder LLM with FSDP2.

Run it with ``tune run --nproc_per_node N full_dpo_distributed --config <config>``
(CUDA with NCCL, or ``device=cpu`` with gloo). See :class:`FullDPORecipeDistributed`
for features and config keys.
"""

import contextlib
import os
import sys
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.distributed import destroy_process_group
from torch.distributed.tensor import DTensor
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from tqdm import tqdm

from torchtune import config, modules, rlhf, training, utils
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_dpo
from torchtune.datasets import ConcatDataset
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training import PROFILER_KEY
from torchtune.training.checkpointing._checkpoint_client import (
    CheckpointClient,
    TrainingProgress,
)

log = utils.get_logger("DEBUG")

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
        - Activation checkpointing (``enable_activation_checkpointing``) and
          activation offloading (``enable_activation_offloading``, CUDA only), for
          the policy; the reference runs without autograd and keeps no activations.
        - Precision: fp32 or bf16 (``dtype``). fp16 is refused.
        - Gradient accumulation: the global batch is
          ``batch_size * ranks * gradient_accumulation_steps`` pairs.
        - Gradient clipping (``clip_grad_norm``). ``grad_norm`` is logged in every mode.
        - ``compile``: ``True`` compiles both models and the loss; a mapping with keys
          ``model``, ``loss`` and ``optimizer_step`` chooses each.
        - Checkpointing at the end of every epoch (policy weights only), written by
          rank 0 through ``checkpointer``; intermediate checkpoints carry the
          optimizer and recipe state for ``resume_from_checkpoint``. With
          ``enable_async_checkpointing`` intermediate checkpoints are saved
          asynchronously as distributed checkpoints, and resuming reads the latest.
          ``save_every_n_steps: N`` also saves a step checkpoint every N steps and at
          the end of every epoch to ``output_dir/step_{global_step}/``, written by
          every rank: the policy's weights and optimizer state (a sharded distributed
          checkpoint), the recipe state, and each rank's dataloader and RNG state;
          written whole or not at all. The reference is never in it: it is frozen,
          and read from ``ref_checkpointer`` again on resume.
          ``checkpointer.keep_last_n_checkpoints: K`` keeps the newest K step
          checkpoints. ``resume_from_checkpoint: True`` without
          ``checkpointer.recipe_checkpoint`` continues from whichever whole
          checkpoint is furthest along, mid-epoch included, on as many processes as
          saved it; a damaged one is skipped with a warning.
        - Logging from rank 0: loss, lr, grad_norm, tokens per second and the pair
          metrics ``rewards/{chosen,rejected,accuracies,margins}``,
          ``log_probs/{chosen,rejected}`` and ``logits/{chosen,rejected}``, each a
          mean over the step's global batch (the logit means take in every position
          of the padded batch, as in 0.6.1).

    Args:
        cfg (DictConfig): OmegaConf object parsed from yaml file

    Raises:
        ValueError: If ``optimizer_in_bwd`` is True and ``clip_grad_norm`` is set.
        ValueError: If ``optimizer_in_bwd`` is True and ``gradient_accumulation_steps`` > 1.
        ValueError: If ``optimizer_in_bwd`` is True and ``compile.optimizer_step`` is True.
        ValueError: If ``compile`` is a mapping with keys other than ``model``,
            ``loss`` and ``optimizer_step``.
        ValueError: If ``dtype`` is fp16.
        ValueError: If ``profiler._component_`` is not the torch profiler.
        ValueError: If ``save_every_n_steps`` or ``checkpointer.keep_last_n_checkpoints``
            is not a positive integer or null.
        RuntimeError: If ``enable_activation_offloading`` is True and the device is not
            CUDA or ``enable_activation_checkpointing`` is False.
        RuntimeError: If ``dtype`` is bf16 and the hardware does not support it.
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Every refusal comes before the process group, the models or any file.
        self._optimizer_in_bwd = cfg.get("optimizer_in_bwd", False)
        # MiB of gradients per in-backward optimizer call; None: the default.
        self._bucket_cap_mb = cfg.get("optimizer_in_bwd_bucket_cap_mb", None)
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self._compile = training.parse_compile_config(cfg.get("compile", False))
        if self._optimizer_in_bwd:
            training.check_optimizer_in_bwd_options(
                clip_grad_norm=self._clip_grad_norm,
                gradient_accumulation_steps=self._gradient_accumulation_steps,
                compile_optimizer_step=self._compile["optimizer_step"],
                bucket_cap_mb=self._bucket_cap_mb,
            )

        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        if self._dtype == torch.float16:
            raise ValueError(
                "dtype=fp16 is not supported by this recipe: full fp16 training needs "
                "loss scaling, which it does not do. Set dtype=bf16 or dtype=fp32."
            )
        self._enable_activation_checkpointing = cfg.get(
            "enable_activation_checkpointing", False
        )
        self._enable_activation_offloading = cfg.get(
            "enable_activation_offloading", False
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
        # The policy's step checkpoints; a bad save_every_n_steps is refused here.
        self._step_checkpointer = training.StepCheckpointer.from_config(cfg)
        # null means the default, as in 0.6.1.
        training.check_profiler_component(cfg.get(PROFILER_KEY))

        self._fsdp_cpu_offload = cfg.get("fsdp_cpu_offload", False)
        if self._fsdp_cpu_offload and self._device.type == "cpu":
            # Everything is in CPU memory already, and FSDP's offload pins memory,
            # which needs an accelerator.
            log.info(
                "fsdp_cpu_offload is ignored on CPU, where it has nothing to move."
            )
            self._fsdp_cpu_offload = False
        self._enable_async_checkpointing = cfg.get("enable_async_checkpointing", False)
        # gloo on CPU; NCCL on CUDA, plus gloo for the CPU-side collectives of FSDP's
        # CPU offload and of asynchronous checkpoint saves.
        torch.distributed.init_process_group(
            "gloo"
            if self._device.type == "cpu"
            else training.get_distributed_backend(
                self._device.type,
                offload_ops_to_cpu=self._fsdp_cpu_offload
                or self._enable_async_checkpointing,
            )
        )
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0

        self._log_every_n_steps = cfg.get("log_every_n_steps", 1)
        self._log_peak_memory_stats = cfg.get("log_peak_memory_stats", False)
        if self._log_peak_memory_stats and self._device.type == "cpu":
            utils.log_rank_zero(
                log, "log_peak_memory_stats is ignored on CPU, which has no such stats."
            )
            self._log_peak_memory_stats = False
        if self._enable_activation_checkpointing and not (
            self._enable_activation_offloading
        ):
            utils.log_rank_zero(
                log,
                "Hint: enable_activation_offloading=True would lower memory further "
                "than enable_activation_checkpointing alone.",
            )
        self._resume_from_checkpoint = cfg.resume_from_checkpoint
        # The policy's checkpoints; the reference is read once and never saved.
        self._checkpoint_client = CheckpointClient(cfg)

        # Public: updated from the checkpoint on resume, read by tests. All ranks
        # agree on the seed (set_seed broadcasts a random one if it is null).
        self.seed = training.set_seed(
            seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None)
        )
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.global_step = 0

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
        """
        Builds, in order: metric logger, policy and reference models (sharded, with
        their weights), tokenizer, optimizer (with resumed state), loss, data, LR
        scheduler and profiler.
        """
        if self._fsdp_cpu_offload:
            # The CPU optimizer step is ~2x faster with every core in intra-op use.
            training.set_torch_num_threads()
        if self._is_rank_zero:
            self._metric_logger = config.instantiate(cfg.metric_logger)
            self._metric_logger.log_config(cfg)

        # A step checkpoint further along than the epoch checkpoint wins.
        step_checkpoint = (
            self._step_checkpointer.resume_point(
                cfg.checkpointer.get("recipe_checkpoint", None)
            )
            if self._resume_from_checkpoint
            else None
        )
        checkpoint_dict = self._checkpoint_client.load_base_checkpoint(
            resume_from_epoch=step_checkpoint is None
        )
        # The reference always starts from the original weights, never from a
        # resumed policy, so its checkpointer never loads recipe state.
        ref_checkpointer = config.instantiate(
            cfg.ref_checkpointer, should_load_recipe_state=False
        )
        ref_state_dict = ref_checkpointer.load_checkpoint()[training.MODEL_KEY]
        setup_model = partial(
            self._setup_model,
            cfg_model=cfg.model,
            custom_sharded_layers=cfg.get("custom_sharded_layers", None),
            reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
        )
        self._model = setup_model(
            model_state_dict=checkpoint_dict[training.MODEL_KEY], reference=False
        )
        self._ref_model = setup_model(model_state_dict=ref_state_dict, reference=True)
        del ref_state_dict
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(
            cfg_optimizer=cfg.optimizer,
            opt_state_dict=checkpoint_dict.get(training.OPT_KEY),
        )
        # Mid-epoch resume state: the dataloader position and the RNG state.
        self._resume_dataloader_state = self._resume_rng_state = None
        if self._resume_from_checkpoint:
            if step_checkpoint is not None:
                # Every rank loads its shards of the policy and its optimizer, its
                # dataloader position and RNG; the reference has its weights already.
                checkpoint_dict, rank_state = self._step_checkpointer.load(
                    step_checkpoint, self._model, self._optimizer
                )
                utils.log_rank_zero(log, f"Resumed from {step_checkpoint}.")
                self._resume_dataloader_state = rank_state[training.DATALOADER_KEY]
                self._resume_rng_state = rank_state["rng"]
            elif self._enable_async_checkpointing:
                # Intermediate checkpoints were written by DCP, not by the configured
                # checkpointer: take weights, optimizer and progress from the latest.
                checkpoint_dict = self._checkpoint_client.load_distributed_checkpoint(
                    self._model, self._optimizer
                )
            self._update_recipe_state(checkpoint_dict)

        self._loss_fn = config.instantiate(cfg.loss)
        if self._compile["loss"]:
            training.compile_loss(self._loss_fn, verbose=self._is_rank_zero)
        utils.log_rank_zero(log, "Loss is initialized.")

        self._dataloader = self._setup_data(
            cfg_dataset=cfg.dataset, shuffle=cfg.shuffle, batch_size=cfg.batch_size
        )
        # A step is one optimizer update: gradient_accumulation_steps batches.
        self._steps_per_epoch = (
            len(self._dataloader) // self._gradient_accumulation_steps
        )
        if self.max_steps_per_epoch is not None:
            self._steps_per_epoch = min(self._steps_per_epoch, self.max_steps_per_epoch)
        # A step checkpoint knows its step; an epoch checkpoint is at an epoch's end.
        self.global_step = checkpoint_dict.get(
            "global_step", self.epochs_run * self._steps_per_epoch
        )

        self._lr_scheduler = self._setup_lr_scheduler(
            cfg_lr_scheduler=cfg.get("lr_scheduler", None),
            num_training_steps=self.total_epochs * self._steps_per_epoch,
            last_epoch=self.global_step - 1,
        )
        if self._compile["optimizer_step"]:
            # After the scheduler, which wraps the bound step() to check call order.
            self._optimizer.step = torch.compile(
                self._optimizer.step,
                backend=os.environ.get("TORCH_COMPILE_BACKEND", "inductor"),
            )
        self._profiler = self._setup_profiler(cfg.get(PROFILER_KEY, None))

    def _setup_model(
        self,
        cfg_model: DictConfig,
        custom_sharded_layers: list[str] | None,
        reshard_after_forward: bool,
        model_state_dict: dict[str, Any],
        reference: bool,
    ) -> nn.Module:
        """
        Builds one model on the meta device (no memory), shards it with FSDP2 and
        loads the full state dict into the shards; each rank materializes only its
        own. The policy (``reference=False``) gets activation checkpointing and
        offloading as configured; the reference is frozen and put in eval mode.
        Dropout is off in both, so that their log-probabilities are comparable.
        """
        name = "Reference model" if reference else "Policy model"
        start = time.perf_counter()
        with training.set_default_dtype(self._dtype), torch.device("meta"):
            model = config.instantiate(cfg_model)
        if self._compile["model"]:
            training.compile_model(model, verbose=self._is_rank_zero)
        if self._enable_activation_checkpointing and not reference:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
        training.shard_model(
            model=model,
            shard_conditions=[
                partial(
                    training.get_shard_conditions, names_to_match=custom_sharded_layers
                )
            ],
            cpu_offload=self._fsdp_cpu_offload,
            reshard_after_forward=reshard_after_forward,
        )
        with training.set_default_dtype(self._dtype), self._device:
            for m in model.modules():
                # RoPE buffers are not in the state dict: compute them on the device.
                if hasattr(m, "rope_init"):
                    m.rope_init()
        training.load_from_full_model_state_dict(
            model,
            model_state_dict,
            self._device,
            strict=True,
            cpu_offload=self._fsdp_cpu_offload,
        )
        training.validate_no_params_on_meta_device(model)
        training.disable_dropout(model)
        if reference:
            for p in model.parameters():
                p.requires_grad = False
            model.eval()
        else:
            # A no-op context when offloading is off.
            self._activations_handling_ctx = training.get_act_offloading_ctx_manager(
                model, self._enable_activation_offloading
            )
        utils.log_rank_zero(
            log,
            f"{name} is initialized with precision {self._dtype} in "
            f"{time.perf_counter() - start:.2f} secs",
        )
        if self._is_rank_zero and self._device.type != "cpu":
            training.log_memory_stats(training.get_memory_stats(device=self._device))
        torch.distributed.barrier()
        return model

    def _setup_optimizer(
        self, cfg_optimizer: DictConfig, opt_state_dict: dict[str, Any] | None = None
    ) -> torch.optim.Optimizer:
        """
        The only place that tells the two modes apart. Only the policy is optimized.
        ``OptimizerInBackward`` has the plain optimizer's groups, state and state dict
        format, so the state of either mode loads here, and nothing downstream needs
        to know which one it got.
        """
        params = list(self._model.parameters())
        make_optimizer = partial(config.instantiate, cfg_optimizer)
        optimizer = (
            training.OptimizerInBackward(
                params, make_optimizer, bucket_cap_mb=self._bucket_cap_mb
            )
            if self._optimizer_in_bwd
            else make_optimizer(params)
        )
        if opt_state_dict:
            training.load_from_full_optimizer_state_dict(
                self._model, optimizer, opt_state_dict, self._device
            )
        utils.log_rank_zero(
            log, f"Optimizer is initialized: {type(optimizer).__name__}."
        )
        return optimizer

    def _setup_lr_scheduler(
        self,
        cfg_lr_scheduler: DictConfig | None,
        num_training_steps: int,
        last_epoch: int,
    ) -> torch.optim.lr_scheduler.LRScheduler | None:
        """Builds the scheduler on the optimizer; ``None`` keeps the lr constant."""
        if cfg_lr_scheduler is None:
            utils.log_rank_zero(log, "No learning rate scheduler configured.")
            return None
        # A scheduler resumed at last_epoch >= 0 reads each group's initial_lr, which
        # a DCP checkpoint cannot restore: DCP loads only the keys that a freshly built
        # optimizer has. The base lr is what the optimizer was built with.
        for group in self._optimizer.param_groups:
            group.setdefault("initial_lr", self._optimizer.defaults["lr"])
        lr_scheduler = config.instantiate(
            cfg_lr_scheduler,
            self._optimizer,
            num_training_steps=num_training_steps,
            last_epoch=last_epoch,
        )
        utils.log_rank_zero(log, "Learning rate scheduler is initialized.")
        return lr_scheduler

    def _setup_profiler(
        self, cfg_profiler: DictConfig | None = None
    ) -> torch.profiler.profile | training.DummyProfiler:
        """
        Builds the torch profiler from the ``profiler`` section (see
        ``training.setup_torch_profiler`` for its keys); a missing or disabled section
        gives a ``DummyProfiler`` whose methods do nothing.
        """
        if cfg_profiler is None:
            cfg_profiler = DictConfig({"enabled": False})
        cfg_profiler["_component_"] = training.TORCH_PROFILER  # checked in __init__
        profiler, profiler_cfg = config.instantiate(cfg_profiler)
        utils.log_rank_zero(
            log, f" Profiler config after instantiation: {profiler_cfg}"
        )
        return profiler

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
        sampler = StatefulDistributedSampler(
            ds, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle
        )
        dataloader = StatefulDataLoader(
            dataset=ds,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=partial(
                padded_collate_dpo,
                padding_idx=self._tokenizer.pad_id,
                ignore_idx=CROSS_ENTROPY_IGNORE_IDX,
            ),
            # Full batches only: every batch holds batch_size pairs, so a step's mean
            # over pairs is the mean of its batches' means (and no shape changes
            # under compile).
            drop_last=True,
        )
        utils.log_rank_zero(log, "Dataset and Sampler are initialized.")
        return dataloader

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
        modes backpropagate the same loss. Only the gradient norm (read from the
        in-backward optimizer, or measured and clipped after backward) differs.
        """
        training.cleanup_before_training()
        self._optimizer.zero_grad(set_to_none=True)
        if self._resume_rng_state is not None:
            # Resuming mid-run: draw what the interrupted run would have.
            training.restore_rng_state(self._resume_rng_state)
        # Summed over the step's batches (each already divided by the number of
        # batches in the step); averaged over ranks once per step.
        running = torch.zeros(1 + len(_PAIR_METRICS), device=self._device)
        num_tokens = torch.zeros((), dtype=torch.long, device=self._device)
        t0 = time.perf_counter()

        self._profiler.start()
        for curr_epoch in range(self.epochs_run, self.total_epochs):
            self._dataloader.sampler.set_epoch(curr_epoch)
            if self._resume_dataloader_state:
                # Resuming mid-epoch: the loader continues where the saved one was.
                self._dataloader.load_state_dict(self._resume_dataloader_state)
                self._resume_dataloader_state = None
            steps_done = self.global_step - curr_epoch * self._steps_per_epoch
            pbar = tqdm(
                total=self._steps_per_epoch,
                initial=steps_done,
                disable=not self._is_rank_zero,
            )
            first_batch = steps_done * self._gradient_accumulation_steps
            for idx, batch in enumerate(self._dataloader, start=first_batch):
                # Batches past the epoch's last full step are left unused.
                if idx // self._gradient_accumulation_steps == self._steps_per_epoch:
                    break
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
                loss = losses.mean() / self._gradient_accumulation_steps
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
                running += batch_metrics / self._gradient_accumulation_steps
                # Updates the policy's parameters on the way with an in-backward
                # optimizer.
                loss.backward()
                if (idx + 1) % self._gradient_accumulation_steps != 0:
                    continue

                if self._optimizer_in_bwd:
                    # Updates already happened; the optimizer measured the gradients
                    # it consumed (a collective: every rank reads it).
                    grad_norm = self._optimizer.grad_norm
                else:
                    grad_norm = _grad_norm(self._model.parameters())
                    if self._clip_grad_norm is not None:
                        # clip_grad_norm_'s rule, on the norm just measured.
                        clip_coef = float(self._clip_grad_norm) / (grad_norm + 1e-6)
                        training.scale_grads(self._model, clip_coef.clamp(max=1.0))
                # No-ops after an in-backward backward; the plain update otherwise.
                self._optimizer.step()
                self._optimizer.zero_grad(set_to_none=True)
                if self._lr_scheduler is not None:
                    self._lr_scheduler.step()
                self.global_step += 1

                # gloo has no AVG reduction: sum, then divide.
                torch.distributed.all_reduce(running)
                torch.distributed.all_reduce(num_tokens)
                step_metrics = dict(
                    zip(
                        ("loss", *_PAIR_METRICS),
                        (running / self.world_size).tolist(),
                        strict=True,
                    )
                )
                loss_to_log = step_metrics["loss"]
                pbar.update(1)
                pbar.set_description(
                    f"{curr_epoch + 1}|{self.global_step}|Loss: {loss_to_log}"
                )
                if (
                    self._is_rank_zero
                    and self.global_step % self._log_every_n_steps == 0
                ):
                    time_per_step = time.perf_counter() - t0
                    log_dict = {
                        "loss": loss_to_log,
                        "lr": training.get_lr(self._optimizer),
                        "grad_norm": grad_norm.item(),
                        "tokens_per_second_per_gpu": num_tokens.item()
                        / (time_per_step * self.world_size),
                        **step_metrics,
                        "rewards/margins": step_metrics["rewards/chosen"]
                        - step_metrics["rewards/rejected"],
                    }
                    if self._log_peak_memory_stats:
                        log_dict.update(training.get_memory_stats(device=self._device))
                    self._metric_logger.log_dict(log_dict, step=self.global_step)

                running.zero_()
                num_tokens.zero_()
                epoch_ends = (idx + 1) // self._gradient_accumulation_steps == (
                    self._steps_per_epoch
                )
                if self._step_checkpointer.is_due(self.global_step) and not epoch_ends:
                    self._save_step_checkpoint(curr_epoch, mid_epoch=True)
                t0 = time.perf_counter()
                # One profiler step per optimizer step (all its batches).
                self._profiler.step()

            self.epochs_run += 1
            if self._step_checkpointer.every_n_steps is not None:
                # Before the epoch checkpoint, whose recipe state is written in place:
                # a crash while it is written leaves this one to resume from.
                self._save_step_checkpoint(self.epochs_run, mid_epoch=False)
            self.save_checkpoint(epoch=curr_epoch)
        self._profiler.stop()

    def save_checkpoint(self, epoch: int) -> None:
        """
        Saves the policy at the end of ``epoch`` (on every rank; rank 0 writes):
        its weights, and for an intermediate checkpoint its optimizer state and the
        training progress too. The reference is never saved: a resumed run reads it
        from ``ref_checkpointer`` again.
        """
        self._checkpoint_client.save_checkpoint(
            model=self._model,
            optimizer=self._optimizer,
            training_progress=TrainingProgress(
                seed=self.seed,
                epochs_run=self.epochs_run,
                total_epochs=self.total_epochs,
                max_steps_per_epoch=self.max_steps_per_epoch,
                dataloader_state_dict=self._dataloader.state_dict(),
            ),
            epoch=epoch,
        )

    def _save_step_checkpoint(self, epochs_run: int, mid_epoch: bool) -> None:
        """Save, from every rank, everything the run needs to continue from this very
        step: the policy and its optimizer, never the frozen reference. At an epoch's
        end the next epoch starts with a fresh loader."""
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

    def cleanup(self) -> None:
        # An asynchronous save still in flight needs the process group.
        self._checkpoint_client.wait_for_async_save()
        if self._is_rank_zero:
            self._metric_logger.close()
        destroy_process_group()


def _grad_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of the gradients: FSDP2's sharded gradients are DTensors whose
    norm is reduced over the ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = nn.utils.get_total_norm(grads)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


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
