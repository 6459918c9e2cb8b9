"""LoRA, QLoRA and DoRA fine-tuning of a decoder LLM over several processes (FSDP2).

Run it with ``tune run --nproc_per_node N lora_finetune_distributed --config <config>``
(multi-node through torchrun's own arguments); ``tune ls`` lists the shipped configs.
"""

import math
import os
import sys
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.distributed import destroy_process_group
from torch.distributed.tensor import DTensor
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from tqdm import tqdm

from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.modules.peft import (
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    set_trainable_params,
    validate_missing_and_unexpected_for_lora,
)
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training.checkpointing._checkpoint_client import TrainingProgress

log = utils.get_logger("DEBUG")


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
      ``training.check_fsdp_optimizer``).
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
      token sum; plain runs divide the accumulated gradients by the all-reduced token
      count, in-backward runs divide the loss by it before backward (there is one
      batch per step). Both multiply by the world size, which undoes FSDP's average
      over processes, and compute the same update up to float rounding.
    - Gradient accumulation (``gradient_accumulation_steps``; the global batch is
      ``batch_size * processes * gradient_accumulation_steps``) and clipping
      (``clip_grad_norm``; null means no clipping). ``grad_norm`` is logged in both
      modes: the pre-clipping norm in plain runs, the norm the optimizer recorded in
      in-backward runs.
    - LR scheduling (``lr_scheduler``, optional).
    - Memory (``enable_activation_checkpointing``, ``enable_activation_offloading``).
    - ``torch.compile`` (``compile``): a bool compiles the model and the loss, as in
      0.6.1; a mapping with keys ``model``, ``loss`` and ``optimizer_step`` picks them
      one by one (``optimizer_step`` compiles the plain optimizer's ``step``).
    - Data (``dataset``, one or a list, ``packed`` or not; ``collate_fn``,
      ``batch_size`` per process, ``shuffle``; ``epochs``, ``max_steps_per_epoch``).
    - Checkpointing (``checkpointer``, ``save_adapter_weights_only``,
      ``resume_from_checkpoint``): after every epoch, rank 0 writes the adapter
      weights and config, and (unless ``save_adapter_weights_only``) the base weights
      with the adapter merged into them; for every epoch but the last, also the
      optimizer and recipe state. A resumed run reads the base weights from
      ``checkpoint_dir`` and the adapter from ``checkpointer.adapter_checkpoint``
      (default: the latest ``epoch_*`` folder), and starts at an epoch boundary.
      Saving never changes the model being trained. ``save_every_n_steps: N`` also
      saves a step checkpoint every N steps and at the end of every epoch to
      ``output_dir/step_{global_step}/``, sharded from every rank (adapter, optimizer,
      recipe, dataloader and RNG state; written whole or not at all), and
      ``checkpointer.keep_last_n_checkpoints: K`` keeps the newest K of those.
      ``resume_from_checkpoint: True`` without ``checkpointer.recipe_checkpoint``
      continues from whichever whole checkpoint is furthest along, mid-epoch
      included; a damaged one is skipped with a warning.
    - Logging from rank 0 (``metric_logger``, ``log_every_n_steps``,
      ``log_peak_memory_stats``): ``loss``, ``lr``, ``tokens_per_second_per_gpu``,
      ``grad_norm`` and, on devices that report them, peak memory stats. Profiling
      (``profiler``; its ``profile_memory`` also records a CUDA memory snapshot for
      the profiled steps).
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
        ValueError: ``profiler._component_`` is not ``setup_torch_profiler`` (null
            means it).
        ValueError: ``optimizer`` is a bitsandbytes optimizer (its kernels cannot step
            FSDP2's sharded parameters), or a torchao low-bit one with ``epochs > 1``
            (its state cannot be saved from them); see ``training.check_fsdp_optimizer``.
        ValueError: ``save_every_n_steps`` or ``checkpointer.keep_last_n_checkpoints``
            is not a positive integer or null.
        ValueError: ``resume_from_checkpoint=True`` and no adapter checkpoint found.
        RuntimeError: ``dtype=bf16`` on hardware without bf16.
        RuntimeError: ``enable_activation_offloading=True`` on a non-CUDA device, or
            without ``enable_activation_checkpointing``.
        RuntimeError: a ``left_pad_sequence`` collate function (inference only).

        Every refusal but the missing adapter happens here, before the process group,
        the model or any file.
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
        # bitsandbytes' optimizers cannot step sharded (DTensor) parameters, and
        # torchao's low-bit ones cannot save their state from them.
        training.check_fsdp_optimizer(cfg.optimizer._component_, epochs=cfg.epochs)
        # save_every_n_steps and checkpointer.keep_last_n_checkpoints.
        self._step_checkpointer = training.StepCheckpointer.from_config(cfg)
        if self._dtype == torch.float16:
            raise ValueError(
                "dtype=fp16 is not supported by this recipe (it has no loss scaling). "
                "Use dtype=fp32 or dtype=bf16."
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

        self._fsdp_cpu_offload = cfg.get("fsdp_cpu_offload", False)
        if self._fsdp_cpu_offload and self._device.type == "cpu":
            # Everything is in CPU memory already, and FSDP's offload pins memory,
            # which needs an accelerator.
            log.info(
                "fsdp_cpu_offload is ignored on CPU, where it has nothing to move."
            )
            self._fsdp_cpu_offload = False
        # gloo on CPU; NCCL on CUDA, plus gloo for the CPU-side collectives of
        # offloaded parameters and optimizer state.
        torch.distributed.init_process_group(
            "gloo"
            if self._device.type == "cpu"
            else training.get_distributed_backend(
                self._device.type, offload_ops_to_cpu=self._fsdp_cpu_offload
            )
        )
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0

        self._output_dir = cfg.output_dir
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
        self._save_adapter_weights_only = cfg.get("save_adapter_weights_only", False)

        # Public: updated from the checkpoint on resume, and read by tests. The seed
        # is agreed on by all ranks (set_seed broadcasts a random one if null).
        self.seed = training.set_seed(
            seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None)
        )
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.global_step = 0

    def load_checkpoint(self, cfg_checkpointer: DictConfig) -> dict[str, Any]:
        """Load the base weights; when resuming, also the adapter, optimizer and
        recipe state. Every rank reads the full checkpoint (memory-mapped). When a
        step checkpoint is further along than the epoch checkpoint, only the base
        weights are read here; the recipe loads the step checkpoint once the model is
        sharded (``self._step_checkpoint``)."""
        cfg_checkpointer = training.StepCheckpointer.checkpointer_config(
            cfg_checkpointer
        )
        self._step_checkpoint = (
            self._step_checkpointer.resume_point(cfg_checkpointer.recipe_checkpoint)
            if self._resume_from_checkpoint
            else None
        )
        self._resume_from_epoch = self._resume_from_checkpoint and (
            self._step_checkpoint is None
        )
        self._checkpointer = config.instantiate(
            cfg_checkpointer, should_load_recipe_state=self._resume_from_epoch
        )
        checkpoint_dict = self._checkpointer.load_checkpoint()
        if self._resume_from_epoch:
            if training.ADAPTER_KEY not in checkpoint_dict:
                raise ValueError(
                    "resume_from_checkpoint=True, but no adapter weights were found. "
                    "Set checkpointer.adapter_checkpoint, or resume from an output_dir "
                    "whose latest epoch_* folder holds adapter_model.pt."
                )
            self._update_recipe_state(checkpoint_dict)
        return checkpoint_dict

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
        """Build the model, tokenizer, optimizer, loss, data, LR scheduler and
        profiler, from the checkpoint's state when resuming."""
        if self._fsdp_cpu_offload:
            # The CPU optimizer step is ~2x faster with every core in intra-op use.
            training.set_torch_num_threads()
        if self._is_rank_zero:
            self._metric_logger = config.instantiate(cfg.metric_logger)
            self._metric_logger.log_config(cfg)

        checkpoint_dict = self.load_checkpoint(cfg_checkpointer=cfg.checkpointer)
        # The epoch checkpoint's adapter and optimizer state, when resuming from it.
        resumed = checkpoint_dict if self._resume_from_epoch else {}
        self._model = self._setup_model(
            cfg_model=cfg.model,
            custom_sharded_layers=cfg.get("custom_sharded_layers", None),
            reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
            base_model_state_dict=checkpoint_dict[training.MODEL_KEY],
            lora_weights_state_dict=resumed.get(training.ADAPTER_KEY),
        )
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(
            cfg_optimizer=cfg.optimizer, opt_state_dict=resumed.get(training.OPT_KEY)
        )
        # Mid-epoch resume state: the dataloader position and the RNG state.
        self._resume_dataloader_state = self._resume_rng_state = None
        if self._step_checkpoint is not None:
            # Every rank loads its shards, its dataloader position and RNG.
            checkpoint_dict, rank_state = self._step_checkpointer.load(
                self._step_checkpoint, self._model, self._optimizer
            )
            utils.log_rank_zero(log, f"Resumed from {self._step_checkpoint}.")
            self._update_recipe_state(checkpoint_dict)
            self._resume_dataloader_state = rank_state[training.DATALOADER_KEY]
            self._resume_rng_state = rank_state["rng"]

        self._loss_fn = config.instantiate(cfg.loss)
        if self._compile["loss"]:
            # Compiles in place for chunked losses, returns a new module for others.
            self._loss_fn = training.compile_loss(
                self._loss_fn, verbose=self._is_rank_zero
            )
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            # The model returns its output in as many chunks as the loss expects.
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)

        # The collate function pads with the tokenizer's pad id and the loss's ignore
        # index, so it comes after both.
        self._dataloader = self._setup_data(
            cfg_dataset=cfg.dataset, shuffle=cfg.shuffle, batch_size=cfg.batch_size
        )

        # One step is gradient_accumulation_steps batches on every rank.
        self._steps_per_epoch = (
            len(self._dataloader) // self._gradient_accumulation_steps
        )
        if self.max_steps_per_epoch is not None:
            self._steps_per_epoch = min(self._steps_per_epoch, self.max_steps_per_epoch)
        # A step checkpoint knows its step; an epoch checkpoint is at an epoch's end.
        self.global_step = checkpoint_dict.get(
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

        With ``profile_memory`` on CUDA, rank 0 also records a memory snapshot over
        the profiled (active) steps of the first epoch: ``self._memory_window`` holds
        their first and last batch index, or is None.
        """
        cfg_profiler = cfg_profiler or DictConfig({"enabled": False})
        cfg_profiler["_component_"] = training.TORCH_PROFILER  # checked in __init__
        profiler, profiler_cfg = config.instantiate(cfg_profiler)
        utils.log_rank_zero(log, f"Profiler config after instantiation: {profiler_cfg}")

        self._memory_window = None
        if (
            self._is_rank_zero
            and profiler_cfg["enabled"]
            and profiler_cfg.get("profile_memory", False)
            and self._device.type == "cuda"
        ):
            first = profiler_cfg["wait_steps"] + profiler_cfg["warmup_steps"]
            self._memory_window = (first, first + profiler_cfg["active_steps"])
        return profiler

    def _setup_model(
        self,
        cfg_model: DictConfig,
        custom_sharded_layers: list[str] | None,
        reshard_after_forward: bool,
        base_model_state_dict: dict[str, Any],
        lora_weights_state_dict: dict[str, Any] | None,
    ) -> nn.Module:
        """Build the model on the meta device (no memory), freeze all but the
        adapter, shard it, then load the adapter (fresh or resumed) and the base
        weights into the shards: each rank materializes only its own."""
        start = time.perf_counter()
        with training.set_default_dtype(self._dtype), torch.device("meta"):
            model = config.instantiate(cfg_model)
        self._lora_rank = cfg_model.lora_rank
        self._lora_alpha = cfg_model.lora_alpha
        self._lora_attn_modules = list(cfg_model.lora_attn_modules)
        self._apply_lora_to_mlp = cfg_model.apply_lora_to_mlp
        self._apply_lora_to_output = cfg_model.get("apply_lora_to_output", False)
        set_trainable_params(model, get_adapter_params(model))

        if self._compile["model"]:
            training.compile_model(model, verbose=self._is_rank_zero)
        if self._enable_activation_checkpointing:
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

        load = partial(
            training.load_from_full_model_state_dict,
            model,
            device=self._device,
            cpu_offload=self._fsdp_cpu_offload,
        )
        lora_missing, lora_unexpected = load(
            lora_weights_state_dict or self._fresh_adapter_state_dict(model)
        )
        base_missing, base_unexpected = load(base_model_state_dict)
        if lora_weights_state_dict is None:
            # Fresh DoRA magnitudes are the norms of the loaded base weights.
            for m in model.modules():
                if hasattr(m, "initialize_dora_magnitude"):
                    m.initialize_dora_magnitude()
        validate_missing_and_unexpected_for_lora(
            lora_attn_modules=self._lora_attn_modules,
            apply_lora_to_mlp=self._apply_lora_to_mlp,
            apply_lora_to_output=self._apply_lora_to_output,
            base_missing=base_missing,
            base_unexpected=base_unexpected,
            lora_missing=lora_missing,
            lora_unexpected=lora_unexpected,
        )
        training.validate_no_params_on_meta_device(model)
        training.validate_expected_param_dtype(
            get_adapter_params(model).items(), dtype=self._dtype
        )
        # A no-op context when offloading is off.
        self._activations_handling_ctx = training.get_act_offloading_ctx_manager(
            model, self._enable_activation_offloading
        )
        utils.log_rank_zero(
            log,
            f"Model is initialized with precision {self._dtype} in "
            f"{time.perf_counter() - start:.2f} seconds.",
        )
        if self._is_rank_zero and self._device.type != "cpu":
            training.log_memory_stats(training.get_memory_stats(device=self._device))
        torch.distributed.barrier()
        return model

    def _fresh_adapter_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Initial adapter weights as full tensors, as the LoRA modules initialize
        them: ``lora_a`` Kaiming-uniform, ``lora_b`` zero (and DoRA magnitudes zero,
        until they are computed from the base weights).

        Initializing the shards in place would draw different numbers for every
        world size (and, on CPU, the same numbers on every rank); these are drawn
        from the seeded generator in one fixed order and sharded on loading.
        """
        fresh = {}
        # Names as the state dict spells them (no wrapper prefixes); shapes global.
        for name, param in model.state_dict().items():
            if not ("lora" in name or "magnitude" in name):
                continue
            fresh[name] = torch.zeros(param.shape, dtype=param.dtype)
            if "lora_a" in name:
                nn.init.kaiming_uniform_(fresh[name], a=math.sqrt(5))
        return fresh

    def _setup_optimizer(
        self, cfg_optimizer: DictConfig, opt_state_dict: dict[str, Any] | None
    ) -> torch.optim.Optimizer:
        """Build the optimizer: the one place that tells plain from in-backward.

        Both get every parameter of the model, as in 0.6.1: the frozen ones get no
        state (and no in-backward hook), and the param groups, hence the state dicts,
        are the same in both modes, so the state of either loads into either.
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
        if opt_state_dict is not None:
            training.load_from_full_optimizer_state_dict(
                self._model, optimizer, opt_state_dict, self._device
            )
        utils.log_rank_zero(
            log, f"Optimizer is initialized: {type(optimizer).__name__}."
        )
        return optimizer

    def _setup_data(
        self, cfg_dataset: DictConfig | ListConfig, shuffle: bool, batch_size: int
    ) -> StatefulDataLoader:
        """Build the loader over one map-style dataset or the concatenation of a
        list, each rank reading its own share."""
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
        # The shuffle depends only on the seed and the epoch (set_epoch), so a run
        # resumed at an epoch boundary sees the batches the uninterrupted run saw,
        # and a step reads the same samples for any world size (rank r takes every
        # world_size-th one).
        sampler = StatefulDistributedSampler(
            ds, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle, seed=0
        )
        # drop_last keeps every batch the same shape (compile, flex attention).
        return StatefulDataLoader(
            ds,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=True,
        )

    def save_checkpoint(self, epoch: int) -> None:
        """Gather the weights on rank 0 and save the adapter weights and config, and
        unless ``save_adapter_weights_only`` the merged weights; for every epoch but
        the last, also what resuming needs. Every rank must call it (it gathers).
        The model being trained is left unchanged.
        """
        start = time.perf_counter()
        intermediate = epoch + 1 < self.total_epochs
        # Full tensors on rank 0's CPU, empty elsewhere.
        state_dict = training.gather_cpu_state_dict(
            self._model,
            self._is_rank_zero,
            device=self._device,
            adapter_weights_only=self._save_adapter_weights_only,
        )
        opt_state_dict = (
            training.get_full_optimizer_state_dict(
                self._model, self._optimizer, self._is_rank_zero, device=self._device
            )
            if intermediate
            else None
        )
        if self._is_rank_zero:
            ckpt_dict = {
                training.ADAPTER_KEY: get_adapter_state_dict(state_dict),
                training.ADAPTER_CONFIG: {
                    "r": self._lora_rank,
                    "lora_alpha": self._lora_alpha,
                    "target_modules": get_lora_module_names(
                        self._lora_attn_modules,
                        self._apply_lora_to_mlp,
                        self._apply_lora_to_output,
                    ),
                    "peft_type": "LORA",
                },
            }
            if not self._save_adapter_weights_only:
                # get_merged_lora_ckpt adds each adapter into its base weight in
                # place. With one process on CPU the gathered "full" tensors are the
                # live shards themselves (and .cpu() returns them as they are), so
                # copy the weights it merges into: saving must never merge the
                # adapter into the model being trained (0.6.1 did).
                for name in list(state_dict):
                    if name.endswith("lora_a.weight"):
                        base = name.removesuffix("lora_a.weight") + "weight"
                        state_dict[base] = state_dict[base].clone()
                ckpt_dict[training.MODEL_KEY] = get_merged_lora_ckpt(
                    state_dict, rank=self._lora_rank, alpha=self._lora_alpha
                )
            if intermediate:
                ckpt_dict |= {
                    training.OPT_KEY: opt_state_dict,
                    training.SEED_KEY: self.seed,
                    training.EPOCHS_KEY: self.epochs_run,
                    training.TOTAL_EPOCHS_KEY: self.total_epochs,
                    training.MAX_STEPS_KEY: self.max_steps_per_epoch,
                    # Saved for the record only: training resumes at an epoch
                    # boundary, where a fresh loader with the epoch's sampler seed is
                    # what the uninterrupted run uses too.
                    training.DATALOADER_KEY: self._dataloader.state_dict(),
                }
            self._checkpointer.save_checkpoint(
                ckpt_dict,
                epoch=epoch,
                intermediate_checkpoint=intermediate,
                adapter_only=self._save_adapter_weights_only,
            )
            log.info(f"Checkpoint saved in {time.perf_counter() - start:.2f} seconds.")
        torch.distributed.barrier()

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
        training.cleanup_before_training()
        if self._compile["model"]:
            utils.log_rank_zero(
                log, "The model compiles in its first forward: expect a slow step 1."
            )
        self._optimizer.zero_grad(set_to_none=True)
        if self._resume_rng_state is not None:
            # Resuming mid-run: draw (dropout) what the interrupted run would have.
            training.restore_rng_state(self._resume_rng_state)
        # This rank's totals over the current step's batches.
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
                record_memory = curr_epoch == 0 and self._memory_window is not None
                if record_memory and idx == self._memory_window[0]:
                    torch.cuda.memory._record_memory_history()
                utils.batch_to_device(batch, self._device)

                loss, batch_tokens = self._loss_step(batch)
                # Token sums, so batches and ranks add up and divide by the total once.
                loss = loss * batch_tokens
                running_loss += loss.detach()
                num_tokens += batch_tokens
                if self._optimizer_in_bwd:
                    # Parameters are updated as their gradients arrive, so those must
                    # already be means over the step's tokens on all ranks; world_size
                    # undoes FSDP's average of the gradients over ranks.
                    torch.distributed.all_reduce(num_tokens)
                    loss = loss * (self.world_size / num_tokens)
                loss.backward()
                del loss

                if (idx + 1) % self._gradient_accumulation_steps == 0:
                    if self._optimizer_in_bwd:
                        # The update already happened; backward recorded the norm (a
                        # collective: every rank reads it).
                        grad_norm = self._optimizer.grad_norm
                    else:
                        torch.distributed.all_reduce(num_tokens)
                        training.scale_grads(self._model, self.world_size / num_tokens)
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
                        # The norm of sharded gradients is a partial sum per rank.
                        if isinstance(grad_norm, DTensor):
                            grad_norm = grad_norm.full_tensor()
                    # A no-op after an in-backward backward.
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
                        log_dict = {
                            "loss": loss_to_log,
                            "lr": training.get_lr(self._optimizer),
                            "tokens_per_second_per_gpu": num_tokens.item()
                            / ((time.perf_counter() - t0) * self.world_size),
                            "grad_norm": grad_norm.item(),
                        }
                        if self._log_peak_memory_stats:
                            log_dict |= training.get_memory_stats(device=self._device)
                        self._metric_logger.log_dict(log_dict, step=self.global_step)
                    running_loss.zero_()
                    num_tokens.zero_()
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
                    # One profiler step per optimizer step (all its batches), as in
                    # 0.6.1.
                    self._profiler.step()

            pbar.close()
            self.epochs_run += 1
            if self._step_checkpointer.every_n_steps is not None:
                # Before the epoch checkpoint, whose recipe state is written in place:
                # a crash while it is written leaves this one to resume from.
                self._save_step_checkpoint(self.epochs_run, mid_epoch=False)
            self.save_checkpoint(epoch=curr_epoch)
        self._profiler.stop()

    def _save_step_checkpoint(self, epochs_run: int, mid_epoch: bool) -> None:
        """Save, from every rank, everything the run needs to continue from this very
        step (the adapter: the frozen base is the checkpoint's). At an epoch's end the
        next epoch starts with a fresh loader."""
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
        if self._is_rank_zero:
            self._metric_logger.close()
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
