"""Quantization-aware full fine-tuning of a decoder LLM with FSDP2.

Run it with ``tune run --nproc_per_node N qat_distributed --config <config>`` (CUDA
with NCCL, or ``device=cpu`` with gloo); multi-node through torchrun's own arguments.
See :class:`QATRecipeDistributed` for features and config keys.
"""

import functools
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.distributed import destroy_process_group
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
)
from torch.distributed.tensor import DTensor
from torchao.quantization.qat.linear import enable_linear_fake_quant
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from tqdm import tqdm

from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training import PROFILER_KEY
from torchtune.training.activations import apply_selective_activation_checkpointing
from torchtune.training.checkpointing._checkpoint_client import (
    CheckpointClient,
    TrainingProgress,
)
from torchtune.training.optim_in_bwd_legacy_state_dict import (
    is_legacy_in_bwd_state_dict,
)

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
          fake-quantized ones before the weights are loaded.
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
        - Gradient clipping (``clip_grad_norm``). ``grad_norm`` is logged in every mode.
        - An optional ``lr_scheduler``; without one the lr stays constant.
        - Checkpointing at the end of every epoch, written by rank 0 through the
          configured checkpointer; intermediate checkpoints carry the optimizer and
          recipe state for ``resume_from_checkpoint``. With
          ``enable_async_checkpointing`` intermediate checkpoints are saved
          asynchronously as distributed checkpoints, and resuming reads the latest one.
          ``save_every_n_steps: N`` also saves a step checkpoint every N steps and at
          the end of every epoch to ``output_dir/step_{global_step}/``, written by
          every rank: the QAT-prepared model's weights and the optimizer state (a
          sharded distributed checkpoint), the recipe state, and each rank's
          dataloader and RNG state; written whole or not at all.
          ``checkpointer.keep_last_n_checkpoints: K`` keeps the newest K step
          checkpoints. ``resume_from_checkpoint: True`` without
          ``checkpointer.recipe_checkpoint`` continues from whichever whole
          checkpoint is furthest along, mid-epoch included, on as many processes as
          saved it; a damaged one is skipped with a warning. Fake quantization is set
          from the resumed step count, as in the interrupted run.
        - Logging (metrics from rank 0), profiling and memory snapshots as in the other
          recipes.

    Args:
        cfg (DictConfig): OmegaConf object parsed from yaml file

    Raises:
        ValueError: If ``optimizer_in_bwd`` is True and ``clip_grad_norm`` is set.
        ValueError: If ``optimizer_in_bwd`` is True and ``gradient_accumulation_steps`` > 1.
        ValueError: If ``quantizer`` is missing or is not a QAT quantizer.
        ValueError: If ``fake_quant_after_n_steps`` is not null or an integer >= 0.
        ValueError: If ``compile`` turns anything on (fake-quantized layers are not
            compiled by this recipe).
        ValueError: If ``dtype`` is fp16.
        ValueError: If ``profiler._component_`` is not the torch profiler.
        ValueError: If ``save_every_n_steps`` or ``checkpointer.keep_last_n_checkpoints``
            is not a positive integer or null.
        RuntimeError: If ``enable_activation_offloading`` is True and the device is not
            CUDA or ``enable_activation_checkpointing`` is False.
        RuntimeError: If ``left_pad_sequence`` is set as the data collator.
        RuntimeError: If ``dtype`` is bf16 and the hardware does not support it.
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Every refusal comes before the process group, the model or any file.
        self._optimizer_in_bwd = cfg.get("optimizer_in_bwd", False)
        # MiB of gradients per in-backward optimizer call; None: the default.
        self._bucket_cap_mb = cfg.get("optimizer_in_bwd_bucket_cap_mb", None)
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._gradient_accumulation_steps = cfg.gradient_accumulation_steps
        if self._optimizer_in_bwd:
            training.check_optimizer_in_bwd_options(
                clip_grad_norm=self._clip_grad_norm,
                gradient_accumulation_steps=self._gradient_accumulation_steps,
                bucket_cap_mb=self._bucket_cap_mb,
            )
        compile_targets = training.parse_compile_config(cfg.get("compile", False))
        if any(compile_targets.values()):
            raise ValueError(
                f"compile={cfg.compile} is not supported by qat_distributed: it does "
                "not compile fake-quantized layers. Set compile=False."
            )

        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        if self._dtype == torch.float16:
            raise ValueError(
                "dtype=fp16 is not supported: full fp16 training is unstable without "
                "loss scaling. Set dtype=bf16 or dtype=fp32."
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
        self._collate_fn = cfg.get("collate_fn", "torchtune.data.padded_collate_sft")
        if "left_pad_sequence" in self._collate_fn:
            raise RuntimeError(
                f"collate_fn={self._collate_fn} is for inference only. Use "
                "torchtune.data.padded_collate_sft."
            )
        # Step checkpoints; a bad save_every_n_steps is refused here.
        self._step_checkpointer = training.StepCheckpointer.from_config(cfg)
        # null means the default, as in 0.6.1.
        training.check_profiler_component(cfg.get(PROFILER_KEY))

        # gloo on CPU; NCCL on CUDA, plus gloo for the CPU-side collectives of FSDP's
        # CPU offload and of asynchronous checkpoint saves.
        self._fsdp_cpu_offload = cfg.get("fsdp_cpu_offload", False)
        if self._fsdp_cpu_offload and self._device.type == "cpu":
            # Everything is in CPU memory already (and FSDP's offload pins memory,
            # which needs an accelerator).
            log.info(
                "fsdp_cpu_offload is ignored on CPU, where it has nothing to move."
            )
            self._fsdp_cpu_offload = False
        self._enable_async_checkpointing = cfg.get("enable_async_checkpointing", False)
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
        self._checkpoint_client = CheckpointClient(cfg)

        # Public: updated from the checkpoint on resume, read by tests. The seed is
        # agreed on by all ranks (set_seed broadcasts a random one if null).
        self.seed = training.set_seed(
            seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None)
        )
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.global_step = 0

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
        Builds, in order: metric logger, model (fake-quantized, sharded, with the base
        or resumed weights), tokenizer, optimizer (with resumed state), loss, data, LR
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
        self._model = self._setup_model(
            cfg_model=cfg.model,
            custom_sharded_layers=cfg.get("custom_sharded_layers", None),
            reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
            model_state_dict=checkpoint_dict[training.MODEL_KEY],
            ac_mode=cfg.get("ac_mode", None),
            ac_option=cfg.get("ac_option", None),
        )
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(
            cfg_optimizer=cfg.optimizer,
            opt_state_dict=checkpoint_dict.get(training.OPT_KEY),
        )
        # Mid-epoch resume state: the dataloader position and the RNG state.
        self._resume_dataloader_state = self._resume_rng_state = None
        if self._resume_from_checkpoint:
            if step_checkpoint is not None:
                # Every rank loads its shards (of the QAT-prepared model it saved),
                # its dataloader position and RNG.
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
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
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
        # Fake quantization follows it (_update_fake_quant, before each batch).
        self.global_step = checkpoint_dict.get(
            "global_step", self.epochs_run * self._steps_per_epoch
        )

        self._lr_scheduler = self._setup_lr_scheduler(
            cfg_lr_scheduler=cfg.get("lr_scheduler", None),
            num_training_steps=self.total_epochs * self._steps_per_epoch,
            last_epoch=self.global_step - 1,
        )
        self._profiler = self._setup_profiler(cfg.get(PROFILER_KEY, None))
        # Appended to the shifted labels so logits need no slicing.
        self.ignore_labels_cache = torch.full(
            (cfg.batch_size, 1), self._loss_fn.ignore_index, device=self._device
        )

    def _setup_model(
        self,
        cfg_model: DictConfig,
        custom_sharded_layers: list[str] | None,
        reshard_after_forward: bool,
        model_state_dict: dict[str, Any],
        ac_mode: str | None = None,
        ac_option: int | str | None = None,
    ) -> nn.Module:
        """
        Builds the model on the meta device (no memory), applies activation
        checkpointing, swaps in the quantizer's fake-quantized linear layers, shards
        with FSDP2, then loads the full state dict into the shards; each rank
        materializes only its own shards. Fake-quantized layers keep the names and
        shapes of the layers they replace, so the base checkpoint loads as is.
        """
        init_start = time.perf_counter()
        with training.set_default_dtype(self._dtype), torch.device("meta"):
            model = config.instantiate(cfg_model)

        # Selective AC (ac_mode/ac_option) only applies without full AC.
        if self._enable_activation_checkpointing and ac_mode is None:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
        elif not self._enable_activation_checkpointing and ac_mode is not None:
            apply_selective_activation_checkpointing(model, ac_mode, ac_option)

        model = self._quantizer.prepare(model)
        # prepare() leaves fake quantization on; _update_fake_quant may turn it off.
        self._fake_quant_enabled = True

        training.shard_model(
            model=model,
            shard_conditions=[
                functools.partial(
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
        self.activations_handling_ctx = training.get_act_offloading_ctx_manager(
            model, self._enable_activation_offloading
        )
        training.validate_no_params_on_meta_device(model)
        utils.log_rank_zero(
            log,
            f"Instantiating model and loading checkpoint took {time.perf_counter() - init_start:.2f} secs",
        )
        if self._is_rank_zero and self._device.type != "cpu":
            training.log_memory_stats(training.get_memory_stats(device=self._device))
        torch.distributed.barrier()
        return model

    def _setup_optimizer(
        self, cfg_optimizer: DictConfig, opt_state_dict: dict[str, Any] | None = None
    ) -> torch.optim.Optimizer:
        """
        The only place that tells the two modes apart. ``OptimizerInBackward`` has the
        plain optimizer's groups, state and state dict format, so the state of either
        mode loads here, and nothing downstream needs to know which one it got.
        """
        params = [p for p in self._model.parameters() if p.requires_grad]
        if self._optimizer_in_bwd:
            optimizer = training.OptimizerInBackward(
                params,
                functools.partial(config.instantiate, cfg_optimizer),
                bucket_cap_mb=self._bucket_cap_mb,
            )
        else:
            optimizer = config.instantiate(cfg_optimizer, params)
        if opt_state_dict:
            if is_legacy_in_bwd_state_dict(opt_state_dict):
                # torchtune 0.6.1's in-backward runs saved {parameter name: that
                # parameter's own full optimizer state dict}; merged, it loads into
                # either mode. Its names carry activation checkpointing's wrapper
                # prefix where it was on; the standard format's names never do.
                opt_state_dict = training.convert_legacy_optim_in_bwd_state_dict(
                    {
                        name.replace(_CHECKPOINT_PREFIX, ""): per_param
                        for name, per_param in opt_state_dict.items()
                    }
                )
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
        # CUDA memory history is recorded for the profiler's active steps of epoch 0.
        self._memory_history_steps = None
        if (
            self._is_rank_zero
            and self._device.type == "cuda"
            and profiler_cfg["enabled"]
            and profiler_cfg.get("profile_memory", False)
        ):
            start = profiler_cfg["wait_steps"] + profiler_cfg["warmup_steps"]
            self._memory_history_steps = (start, start + profiler_cfg["active_steps"])
        return profiler

    def _setup_data(
        self, cfg_dataset: DictConfig | ListConfig, shuffle: bool, batch_size: int
    ) -> StatefulDataLoader:
        """Map-style dataset (or a list of them, concatenated) split over the ranks."""
        if isinstance(cfg_dataset, ListConfig):
            ds = ConcatDataset(
                datasets=[config.instantiate(c, self._tokenizer) for c in cfg_dataset]
            )
            packed = getattr(ds, "packed", False)
        else:
            ds = config.instantiate(cfg_dataset, self._tokenizer)
            packed = cfg_dataset.get("packed", False)
        collate = _get_component_from_path(self._collate_fn)
        sampler = StatefulDistributedSampler(
            ds, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle
        )
        return StatefulDataLoader(
            dataset=ds,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=(
                padded_collate_packed
                if packed
                else functools.partial(
                    collate,
                    padding_idx=self._tokenizer.pad_id,
                    ignore_idx=self._loss_fn.ignore_index,
                )
            ),
            # Full batches only: avoids shape changes under flex attention.
            drop_last=True,
        )

    def _update_fake_quant(self) -> None:
        """Fake quantization is off for the first ``fake_quant_after_n_steps`` steps
        and on after them; called before each batch, so a resumed run is in the state
        the interrupted one had at the same step."""
        enabled = (
            self._fake_quant_after_n_steps is None
            or self.global_step >= self._fake_quant_after_n_steps
        )
        if enabled == self._fake_quant_enabled:
            return
        utils.log_rank_zero(
            log,
            f"Step {self.global_step}: fake quantization "
            f"{'enabled' if enabled else 'disabled'}.",
        )
        # torchao's generic switch for every fake-quantized linear layer; its
        # per-quantizer 4w helpers also touch an activation quantizer that 4-bit
        # weight-only layers do not have.
        self._model.apply(functools.partial(enable_linear_fake_quant, enabled=enabled))
        self._fake_quant_enabled = enabled

    def train(self) -> None:
        """
        The training loop. Each step sums ``token-mean loss * tokens`` over its
        batches and normalizes by the step's global token count: before backward with
        an in-backward optimizer (it updates during backward), on the gradients after
        accumulation otherwise.
        """
        training.cleanup_before_training()
        self._optimizer.zero_grad(set_to_none=True)
        if self._resume_rng_state is not None:
            # Resuming mid-run: draw (dropout) what the interrupted run would have.
            training.restore_rng_state(self._resume_rng_state)
        # Summed over the step's batches; all-reduced over ranks once per step.
        running_loss = torch.zeros((), device=self._device)
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
                self._record_memory_history(curr_epoch, idx, start=True)
                self._update_fake_quant()
                utils.batch_to_device(batch, self._device)
                current_num_tokens = (
                    batch["labels"] != self._loss_fn.ignore_index
                ).sum()
                num_tokens += current_num_tokens
                labels = batch.pop("labels")
                with self.activations_handling_ctx:
                    logits = self._model(**batch)
                # Shift labels left by one (next-token targets), ignoring the last.
                labels = torch.hstack(
                    (labels[..., 1:], self.ignore_labels_cache[: labels.shape[0]])
                )
                if not isinstance(logits, list):
                    labels = labels.reshape(-1)
                    logits = logits.reshape(-1, logits.size(-1))
                # The loss fn averages over this batch's tokens; undo it so batches and
                # ranks can be summed and divided by the total once.
                loss = self._loss_fn(logits, labels) * current_num_tokens
                del logits  # frees the logits before backward's peak
                running_loss += loss.detach()
                if self._optimizer_in_bwd:
                    # Parameters are updated inside backward, so the loss must already
                    # be divided by the step's global token count. FSDP averages the
                    # gradients over ranks; world_size undoes that average.
                    torch.distributed.all_reduce(num_tokens)
                    loss = loss * (self.world_size / num_tokens)
                loss.backward()
                if (idx + 1) % self._gradient_accumulation_steps != 0:
                    continue

                if self._optimizer_in_bwd:
                    # Updates already happened; the optimizer measured the gradients
                    # it consumed (a collective: every rank reads it).
                    grad_norm = self._optimizer.grad_norm
                else:
                    torch.distributed.all_reduce(num_tokens)
                    training.scale_grads(self._model, self.world_size / num_tokens)
                    grad_norm = _grad_norm(self._model.parameters())
                    if self._clip_grad_norm is not None:
                        # clip_grad_norm_'s rule, with the norm already computed.
                        clip_coef = float(self._clip_grad_norm) / (grad_norm + 1e-6)
                        training.scale_grads(self._model, clip_coef.clamp(max=1.0))
                # No-ops after an in-backward backward; the plain update otherwise.
                self._optimizer.step()
                self._optimizer.zero_grad(set_to_none=True)
                if self._lr_scheduler is not None:
                    self._lr_scheduler.step()
                self.global_step += 1

                torch.distributed.all_reduce(running_loss)
                loss_to_log = running_loss.item() / num_tokens.item()
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
                    }
                    if self._log_peak_memory_stats:
                        log_dict.update(training.get_memory_stats(device=self._device))
                    self._metric_logger.log_dict(log_dict, step=self.global_step)

                running_loss.zero_()
                num_tokens.zero_()
                epoch_ends = (idx + 1) // self._gradient_accumulation_steps == (
                    self._steps_per_epoch
                )
                if self._step_checkpointer.is_due(self.global_step) and not epoch_ends:
                    self._save_step_checkpoint(curr_epoch, mid_epoch=True)
                t0 = time.perf_counter()
                self._record_memory_history(curr_epoch, idx, start=False)
                # One profiler step per optimizer step (all its batches).
                self._profiler.step()

            self.epochs_run += 1
            if self._step_checkpointer.every_n_steps is not None:
                # Before the epoch checkpoint, whose recipe state is written in place:
                # a crash while it is written leaves this one to resume from.
                self._save_step_checkpoint(self.epochs_run, mid_epoch=False)
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
                epoch=curr_epoch,
            )
        self._profiler.stop()

    def _save_step_checkpoint(self, epochs_run: int, mid_epoch: bool) -> None:
        """Save, from every rank, everything the run needs to continue from this very
        step: the QAT-prepared model (its fake-quantized layers keep the base names,
        and hold no state of their own), which a resumed run loads into the model it
        prepared the same way. At an epoch's end the next epoch starts with a fresh
        loader."""
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

    def _record_memory_history(self, epoch: int, idx: int, start: bool) -> None:
        """Starts/stops the CUDA memory snapshot around the profiler's active steps."""
        if self._memory_history_steps is None or epoch != 0:
            return
        if start and idx == self._memory_history_steps[0]:
            torch.cuda.memory._record_memory_history()
        elif not start and idx == self._memory_history_steps[1]:
            torch.cuda.memory._record_memory_history(enabled=None)

    def cleanup(self) -> None:
        # An asynchronous save still in flight needs the process group.
        self._checkpoint_client.wait_for_async_save()
        if self._is_rank_zero:
            self._metric_logger.close()
        destroy_process_group()


def _grad_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of the gradients; FSDP's sharded norm is reduced to the whole."""
    norm = nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


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
