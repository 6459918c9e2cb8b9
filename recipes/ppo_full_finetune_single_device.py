"""RLHF with PPO: full fine-tuning of a policy and a value model on one device.

Run it with ``tune run ppo_full_finetune_single_device --config <config>``; ``tune ls``
lists the shipped configs.
"""

import contextlib
import math
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from tqdm import tqdm

from torchtune import config, generation, modules, rlhf, training, utils
from torchtune.data import padded_collate
from torchtune.datasets import ConcatDataset
from torchtune.modules import local_kv_cache
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.rlhf import PPOStats, Trajectory

log = utils.get_logger("DEBUG")

# Compiled layers meet more shapes here than in supervised fine-tuning (prefill, one
# token at a time with a KV cache, full sequences with and without gradients), more
# than dynamo's default of 8 recompiles per frame.
_COMPILE_CACHE_SIZE_LIMIT = 16


@dataclass
class PPOProgress(training.TrainingProgress):
    """Where a PPO run stands: ``global_step`` counts PPO steps (a batch of
    ``batch_size`` trajectories and its ``ppo_epochs``), of ``total_steps``; ``rng`` is
    the generator sampling and the minibatch order draw from.

    Its state dict keeps the keys of torchtune 0.6.1's PPO recipe state, so that a
    0.6.1 epoch checkpoint resumes; ``total_epochs`` and ``total_steps`` stay the
    config's.
    """

    seed: int = 0
    total_steps: int = 0
    rng: torch.Generator | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            training.SEED_KEY: self.seed,
            training.MAX_STEPS_KEY: self.total_steps,
            training.STEPS_KEY: self.global_step,
            training.RNG_KEY: self.rng.get_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for name, ours, key, effect in (
            ("seed", self.seed, training.SEED_KEY, "its sampling generator goes on"),
            (
                "num_steps // batch_size",
                self.total_steps,
                training.MAX_STEPS_KEY,
                "the run trains to the config's",
            ),
        ):
            if ours != state_dict[key]:
                log.warning(
                    f"{name}={ours} from the config differs from the checkpoint's "
                    f"{state_dict[key]}: {effect}."
                )
        self.seed = state_dict[training.SEED_KEY]
        self.epochs_run = state_dict[training.EPOCHS_KEY]
        # The PPO steps, under 0.6.1's key (its recipe state has no global_step).
        self.global_step = state_dict[training.STEPS_KEY]
        self.rng.set_state(state_dict[training.RNG_KEY])


class PPOFullFinetuneRecipeSingleDevice(FTRecipeInterface):
    """RLHF with PPO for a dense decoder (Llama2, Mistral, ...) on one device.

    Four models take part: the policy being trained, a frozen reference copy of it, a
    frozen reward model, and a value model (a classifier with one output, usually
    initialised from the reward model) trained alongside the policy. Each step draws
    ``batch_size`` prompts, generates responses with the policy, scores them, and then
    optimises the PPO objective over those trajectories for ``ppo_epochs`` passes in
    minibatches of ``ppo_batch_size`` (after "Learning to summarize from human
    feedback", arXiv:2009.01325, and arXiv:2204.05862).

    Features, each driven by the config key named:

    - Models (``policy_model``, ``reward_and_value_model``) and their checkpoints
      (``checkpointer`` for the policy; ``ref_policy_checkpointer``,
      ``value_checkpointer``, ``reward_checkpointer``).
    - Precision (``dtype``): fp32 or bf16 for weights, activations, gradients and
      optimizer state.
    - Optimizer (``optimizer``, ``optimizer_in_bwd``): one optimizer over the policy's
      and the value model's parameters, any ``torch.optim.Optimizer`` including
      bitsandbytes' low-precision ones. With ``optimizer_in_bwd: True`` each parameter
      of both models is updated inside backward as soon as its gradient is ready and
      the gradient is freed at once. The optimizer is then a
      :class:`~torchtune.training.OptimizerInBackward`, which looks like the plain one
      to everything else: ``step``/``zero_grad``, ``get_lr`` and checkpoints are the
      same in both modes, and a checkpoint written in one mode resumes in the other.
      ``optimizer_in_bwd_bucket_cap_mb`` sets how many MiB of gradients one
      update in backward takes (default 4; 0: each parameter on its own).
    - Batch sizes: ``batch_size`` prompts per step, generated ``forward_batch_size`` at
      a time (no gradients, so this can be larger); one optimizer step per
      ``ppo_batch_size`` trajectories, ``ppo_epochs`` times over the step's batch;
      ``gradient_accumulation_steps`` splits each minibatch into that many backward
      passes (plain runs only). The loss backpropagated is the mean over each backward
      pass's trajectories divided by ``gradient_accumulation_steps``, the same in both
      modes, so the two compute the same updates.
    - Gradient clipping (``clip_grad_norm``, over both models' gradients together;
      null, the default, means no clipping), in both modes: in-backward clipping is
      exact, at the price of a second backward pass.
    - Generation (``max_generated_tokens``, ``temperature``, ``top_k``,
      ``enable_kv_cache``, ``stop_token_ids``), reward shaping
      (``min_response_length``, ``penalise_no_eos``, ``reward_penalty``, ``kl_coeff``),
      advantages (``gamma``, ``lmbda``), the PPO loss (``loss``).
    - Run length (``num_steps``: prompts in all; ``num_steps // batch_size`` steps).
      Epochs are as many passes over ``dataset`` as those steps take.
    - Memory (``enable_activation_checkpointing``); ``torch.compile`` (``compile``:
      ``True``, or a mapping with ``model: True``, compiles the layers of all four
      models).
    - Checkpointing (:class:`~torchtune.training.CheckpointManager`): after every
      epoch, the policy's weights in ``epoch_{N}/`` through ``checkpointer`` and the
      value model's through ``value_checkpointer``, and a step checkpoint
      ``output_dir/step_{N}/``, N the PPO step (one batch of ``batch_size``
      trajectories and its ``ppo_epochs``); ``save_every_n_steps: N`` also saves one
      every N PPO steps, ``checkpointer.keep_last_n_checkpoints: K`` keeps the newest
      K. A step checkpoint holds both trained models (``{"policy": ..., "value":
      ...}``), the one optimizer's state, the PPO progress with the sampling
      generator's state, the dataloader's position and the global RNG state.
      ``resume_from_checkpoint: True`` continues from the newest whole one, mid-epoch
      included, with the trajectories and updates the uninterrupted run would have
      had; ``checkpointer`` and ``value_checkpointer`` stay pointed at the weights the
      run started from (read for their format, in which the epochs are saved).
    - A torchtune 0.6.1 epoch checkpoint resumes too: point ``value_checkpointer``'s
      ``checkpoint_files`` at the value weights saved with it. Its optimizer state
      from an ``optimizer_in_bwd`` run, which held the value model's state only, also
      loads; the policy's then starts afresh, as it did in 0.6.1.
    - Logging (``metric_logger``, ``log_every_n_steps``, ``log_peak_memory_stats``):
      rewards, KL, the PPO losses and ratios, ``lr``, ``grad_norm`` (the mean over the
      step's optimizer steps, in both modes) and throughput. Profiling (``profiler``).
    - Determinism (``seed``, ``cudnn_deterministic_mode``): sampling and minibatch
      order come from one generator seeded by ``seed`` and saved with every step
      checkpoint.

    ``whiten_rewards`` is accepted and, as in 0.6.1, has no effect.

    Args:
        cfg (DictConfig): the parsed config, command-line overrides applied.

    Raises:
        ValueError: an option :class:`~torchtune.training.RecipeOptions` or
            :class:`~torchtune.training.CheckpointManager` refuses (see theirs).
        PermissionError: ``output_dir`` or ``checkpointer.output_dir`` cannot be
            written.
        RuntimeError: see :class:`~torchtune.training.RecipeOptions`.
        ValueError: ``batch_size`` not divisible by ``forward_batch_size`` or by
            ``ppo_batch_size``, or ``ppo_batch_size`` not divisible by
            ``gradient_accumulation_steps``.
        ValueError: ``num_steps`` smaller than ``batch_size`` (no step to run).
        ValueError: a fresh run whose ``ref_policy_checkpointer`` reads other files
            than ``checkpointer``: the reference policy must start as the policy.

        Every refusal happens here, before anything is built or written.
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Refuse every unsupported combination before anything is built, so that a
        # refused run leaves output_dir (and the checkpoints in it) as it was.
        self._opts = training.RecipeOptions.from_config(cfg)
        self._device, self._dtype = self._opts.device, self._opts.dtype
        self._optimizer_in_bwd = self._opts.optimizer_in_bwd
        # The policy's checkpointer and the step checkpoints; the other three models
        # have checkpointers of their own.
        self._checkpoint = training.CheckpointManager(
            training.CheckpointOptions.from_config(cfg)
        )
        self._gradient_accumulation_steps = self._opts.gradient_accumulation_steps
        self.batch_size = cfg.batch_size
        self._forward_batch_size = cfg.forward_batch_size
        self._ppo_epochs = cfg.ppo_epochs
        self._ppo_batch_size = cfg.ppo_batch_size
        for name, divisor in (
            ("forward_batch_size", self._forward_batch_size),
            ("ppo_batch_size", self._ppo_batch_size),
        ):
            if self.batch_size % divisor != 0:
                raise ValueError(
                    f"batch_size={self.batch_size} is not a multiple of "
                    f"{name}={divisor}: every step splits its batch_size prompts into "
                    f"batches of {name}. Choose sizes that divide each other."
                )
        if self._ppo_batch_size % self._gradient_accumulation_steps != 0:
            raise ValueError(
                f"ppo_batch_size={self._ppo_batch_size} is not a multiple of "
                f"gradient_accumulation_steps={self._gradient_accumulation_steps}: "
                "each PPO minibatch is split into that many equal backward passes. "
                "Choose sizes that divide each other."
            )
        self._ppo_backward_batch_size = (
            self._ppo_batch_size // self._gradient_accumulation_steps
        )
        self._total_steps = cfg.num_steps // self.batch_size
        if self._total_steps == 0:
            raise ValueError(
                f"num_steps={cfg.num_steps} is smaller than batch_size="
                f"{self.batch_size}: num_steps counts prompts, so this run would have "
                "no step. Set num_steps to at least batch_size."
            )
        policy, ref_policy = cfg.checkpointer, cfg.ref_policy_checkpointer
        if not self._checkpoint.options.resume and (
            policy.checkpoint_dir != ref_policy.checkpoint_dir
            or policy.checkpoint_files != ref_policy.checkpoint_files
        ):
            raise ValueError(
                "ref_policy_checkpointer must read the same checkpoint as "
                "checkpointer at the start of training, got "
                f"{ref_policy.checkpoint_dir} {ref_policy.checkpoint_files} and "
                f"{policy.checkpoint_dir} {policy.checkpoint_files}: the "
                "reference policy is the policy before training. Point both at the "
                "same files (only checkpointer changes when resuming)."
            )

        self.seed = training.set_seed(
            seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None)
        )
        # Sampling and the PPO minibatch order draw from this generator alone, and it
        # is checkpointed: a resumed run draws what the uninterrupted one would.
        self._rng = torch.Generator(self._device).manual_seed(self.seed)
        # Optimizer steps (one per PPO minibatch), at which the metrics are logged.
        self._optimizer_steps = 0

    def setup(self, cfg: DictConfig) -> None:
        """Build everything, in dependency order, restoring the state on resume."""
        # Each model is read from wherever the config points it. Also when resuming
        # from a step checkpoint: the checkpointers learn the models' format from the
        # files they load, and save epochs in it.
        policy_ckpt = self._checkpoint.load_base_checkpoint()
        self._value_checkpointer, value_state_dict = _load(cfg.value_checkpointer)
        _, ref_policy_state_dict = _load(cfg.ref_policy_checkpointer)
        _, reward_state_dict = _load(cfg.reward_checkpointer)

        if self._opts.compile["model"]:
            torch._dynamo.config.cache_size_limit = _COMPILE_CACHE_SIZE_LIMIT
        self._policy_model = self._setup_model(
            cfg.policy_model, policy_ckpt[training.MODEL_KEY], trainable=True
        )
        self._ref_policy_model = self._setup_model(
            cfg.policy_model, ref_policy_state_dict, trainable=False
        )
        self._value_model = self._setup_model(
            cfg.reward_and_value_model,
            value_state_dict,
            trainable=True,
            classifier=True,
        )
        self._reward_model = self._setup_model(
            cfg.reward_and_value_model,
            reward_state_dict,
            trainable=False,
            classifier=True,
        )
        log.info(f"Models are initialized with precision {self._dtype}.")
        if self._device.type != "cpu":
            training.log_memory_stats(training.get_memory_stats(device=self._device))

        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(cfg.optimizer)
        self._loss_fn = config.instantiate(cfg.loss)

        self._dataloader = self._setup_data(cfg.dataset, cfg.shuffle, self.batch_size)
        # One epoch is one pass over the prompts; the run ends after _total_steps.
        self._batches_per_epoch = batches_per_epoch = max(1, len(self._dataloader))
        self.progress = PPOProgress(
            total_epochs=math.ceil(self._total_steps / batches_per_epoch),
            seed=self.seed,
            total_steps=self._total_steps,
            rng=self._rng,
        )
        if self._total_steps < batches_per_epoch:
            log.warning(
                f"num_steps // batch_size = {self._total_steps} steps is less than one "
                f"epoch ({batches_per_epoch} batches): the run ends within epoch 0 and "
                "saves no intermediate epoch checkpoint."
            )
        elif self._total_steps % batches_per_epoch != 0:
            log.warning(
                f"num_steps // batch_size = {self._total_steps} steps is not a "
                f"multiple of the {batches_per_epoch} batches of an epoch: "
                "intermediate checkpoints are saved at epoch ends only."
            )
        log.info(
            f"Total steps to run: {self._total_steps}, "
            f"total epochs to run: {self.progress.total_epochs}."
        )
        self._setup_generation_and_rewards(cfg)
        # Both trained models by name, exported by their own checkpointers. On
        # resume: their weights, the optimizer, data position, RNG and progress.
        self._checkpoint.load(
            {
                "model": {"policy": self._policy_model, "value": self._value_model},
                "optimizer": self._optimizer,
                "dataloader": self._dataloader,
                "progress": self.progress,
            },
            steps_per_epoch=batches_per_epoch,
            exporters={
                "value": (self._value_checkpointer, cfg.value_checkpointer.output_dir)
            },
        )
        # Logs and the config copy are written once every check has passed and
        # output_dir is this run's (load() took its lock).
        self._metric_logger = config.instantiate(cfg.metric_logger)
        self._metric_logger.log_config(cfg)
        self._optimizer_steps = (
            self.progress.global_step
            * self._ppo_epochs
            * (self.batch_size // self._ppo_batch_size)
        )
        self._profiler = training.setup_profiler(
            cfg.get(training.PROFILER_KEY, None), device=self._device
        )

    def _setup_model(
        self,
        cfg_model: DictConfig,
        state_dict: dict[str, Any],
        *,
        trainable: bool,
        classifier: bool = False,
    ) -> nn.Module:
        """Build a model on the device in the training dtype and load its weights.

        Trainable models (the policy and the value model) get activation
        checkpointing if asked; the reference policy and the reward model are frozen
        and in eval mode. Dropout is off everywhere: the policy's log-probabilities
        must be comparable with the reference's, and with its own earlier ones.
        """
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        if self._opts.compile["model"]:
            training.compile_model(model)
        if trainable and self._opts.enable_activation_checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
        if classifier:
            # Keep the model's own head when the checkpoint's has another shape (a
            # language model's), and drop a saved head bias.
            training.update_state_dict_for_classifier(
                state_dict, model.named_parameters()
            )
        model.load_state_dict(state_dict)
        training.validate_expected_param_dtype(
            model.named_parameters(), dtype=self._dtype
        )
        training.disable_dropout(model)
        if not trainable:
            model.eval()
            model.requires_grad_(False)
        return model

    def _setup_optimizer(self, cfg_optimizer: DictConfig) -> torch.optim.Optimizer:
        """Build the optimizer: the one place that tells plain from in-backward.

        One optimizer holds the policy's parameters, then the value model's, in one
        param group (the order 0.6.1's plain optimizer saved). Both kinds have the same
        param groups and state-dict format, so the state of either mode loads into
        either, and so does a torchtune 0.6.1 in-backward state.
        """
        return training.build_optimizer(
            self._trainable_params(),
            partial(config.instantiate, cfg_optimizer),
            in_backward=self._optimizer_in_bwd,
            bucket_cap_mb=self._opts.bucket_cap_mb,
            max_norm=self._opts.clip_grad_norm,
        )

    def _setup_data(
        self, cfg_dataset: DictConfig | ListConfig, shuffle: bool, batch_size: int
    ) -> StatefulDataLoader:
        """Build the prompt dataset (a list is concatenated) and its loader.

        Prompts are padded on the left, so that generation continues every prompt
        from the same position. The loader's state is its position in the epoch,
        which a step checkpoint saves.
        """
        if isinstance(cfg_dataset, ListConfig):
            ds = ConcatDataset(
                [config.instantiate(c, tokenizer=self._tokenizer) for c in cfg_dataset]
            )
        else:
            ds = config.instantiate(cfg_dataset, tokenizer=self._tokenizer)
        # Full batches only: every step generates for exactly batch_size prompts.
        return training.stateful_dataloader(
            ds,
            batch_size=batch_size,
            shuffle=shuffle,
            collate_fn=partial(
                padded_collate,
                pad_direction="left",
                keys_to_pad=["tokens", "labels"],
                padding_idx=self._tokenizer.pad_id,
            ),
        )

    def _setup_generation_and_rewards(self, cfg: DictConfig) -> None:
        """Read the generation, reward and advantage settings; pick the stop tokens."""
        self._kl_coeff = cfg.kl_coeff
        self._gamma = cfg.gamma
        self._lmbda = cfg.lmbda
        if cfg.get("whiten_rewards", False):
            log.warning("whiten_rewards=True has no effect in this recipe (nor 0.6.1).")
        self._temperature = cfg.temperature
        self._top_k = cfg.top_k
        self._max_generated_tokens = cfg.max_generated_tokens
        self._enable_kv_cache = cfg.enable_kv_cache
        self._min_response_length = cfg.min_response_length
        self._penalise_no_eos = cfg.penalise_no_eos
        self._reward_penalty = cfg.reward_penalty

        stop_token_ids = cfg.get("stop_token_ids", None)
        if stop_token_ids:
            if self._tokenizer.eos_id not in stop_token_ids:
                log.warning(
                    f"The tokenizer's eos_id {self._tokenizer.eos_id} is not among "
                    f"stop_token_ids={list(stop_token_ids)}: responses may run past "
                    "their end."
                )
        elif hasattr(self._tokenizer, "stop_tokens"):
            stop_token_ids = self._tokenizer.stop_tokens
        else:
            log.warning(
                "Neither stop_token_ids nor the tokenizer names stop tokens: every "
                "response runs for max_generated_tokens."
            )
            stop_token_ids = []
        self._stop_token_ids = torch.tensor(list(stop_token_ids), device=self._device)

    def _kv_cache(self, decoder_max_seq_len: int) -> contextlib.AbstractContextManager:
        """KV caches on the policy for one generation, if ``enable_kv_cache``."""
        if not self._enable_kv_cache:
            return contextlib.nullcontext()
        return local_kv_cache(
            self._policy_model,
            batch_size=self._forward_batch_size,
            dtype=self._dtype,
            device=self._device,
            decoder_max_seq_len=decoder_max_seq_len,
        )

    def generate_trajectory(self, input_ids: torch.Tensor) -> Trajectory:
        """Generate responses to a batch of prompts and everything PPO needs of them.

        1. Sample responses from the policy, with their logits.
        2. Log-probabilities of the responses under the policy and the reference.
        3. Values of the responses under the value model.
        4. Truncate each response after its first stop token (the rest is padding).
        5. Score each (prompt, truncated response) with the reward model, penalising
           the responses ``penalise_no_eos`` and ``min_response_length`` ask for.
        6. Mask what lies beyond each response: log-probabilities, and values after
           the position that follows the last response token.

        Args:
            input_ids (torch.Tensor): left-padded prompts, shape ``[b, context_length]``.

        Returns:
            Trajectory: the batch's trajectories.
        """
        _, context_length = input_ids.shape
        with self._kv_cache(context_length + self._max_generated_tokens):
            query_responses, logits = generation.generate(
                model=self._policy_model,
                prompt=input_ids,
                max_generated_tokens=self._max_generated_tokens,
                temperature=self._temperature,
                top_k=self._top_k,
                pad_id=self._tokenizer.pad_id,
                rng=self._rng,
            )
        responses = query_responses[:, context_length:].clone()
        # Left padding of the prompts: masks and positions for later full forwards.
        not_padding = query_responses != self._tokenizer.pad_id
        masks = generation.get_causal_mask_from_padding_mask(not_padding)
        position_ids = generation.get_position_ids_from_padding_mask(not_padding)
        del not_padding

        logprobs = rlhf.logits_to_logprobs(logits, responses, self._temperature)
        del logits
        ref_logits = self._ref_policy_model(
            query_responses, input_pos=position_ids, mask=masks
        )
        ref_logits = rlhf.truncate_sequence_for_logprobs(ref_logits, context_length)
        ref_logprobs = rlhf.logits_to_logprobs(ref_logits, responses, self._temperature)
        del ref_logits

        values = self._value_model(query_responses, input_pos=position_ids, mask=masks)
        values = rlhf.truncate_sequence_for_logprobs(values, context_length).squeeze(-1)

        response_padding_masks, responses = rlhf.truncate_sequence_at_first_stop_token(
            responses, self._stop_token_ids, self._tokenizer.pad_id
        )
        scores = self._reward_model(
            torch.cat([input_ids, responses], dim=1),
            input_pos=position_ids,
            mask=masks,
        )
        del responses
        # A response's score is the reward model's output at its last token.
        seq_lens = training.get_unmasked_sequence_lengths(response_padding_masks)
        scores = scores.gather(1, (seq_lens + context_length)[:, None, None]).squeeze(
            (-1, -2)
        )
        if self._penalise_no_eos or self._min_response_length:
            penalised = rlhf.get_reward_penalty_mask(
                response_padding_masks,
                seq_lens,
                self._penalise_no_eos,
                self._min_response_length,
            )
            scores[penalised] = self._reward_penalty

        logprobs[response_padding_masks] = 1.0
        ref_logprobs[response_padding_masks] = 1.0
        # The value of the position after the last response token is kept (it is the
        # value the last reward is bootstrapped against), unless that position is
        # outside the response.
        value_seq_idxs = torch.where(
            (seq_lens > 0) & (seq_lens < self._max_generated_tokens - 1),
            seq_lens + 1,
            seq_lens,
        )
        value_padding_masks = response_padding_masks.clone().scatter_(
            1, value_seq_idxs.unsqueeze(-1), False
        )
        values[value_padding_masks] = 0.0

        return Trajectory(
            query_responses=query_responses,
            logprobs=logprobs,
            ref_logprobs=ref_logprobs,
            values=values,
            masks=masks,
            position_ids=position_ids,
            response_padding_masks=response_padding_masks,
            value_padding_masks=value_padding_masks,
            value_seq_idxs=value_seq_idxs,
            scores=scores,
            seq_lens=seq_lens,
        )

    def generate_trajectory_batched(self, input_ids: torch.Tensor) -> Trajectory:
        """:meth:`generate_trajectory` for ``batch_size`` prompts, run
        ``forward_batch_size`` at a time without gradients, joined into one batch."""
        with torch.no_grad():
            parts = [
                self.generate_trajectory(input_ids[start : start + size])
                for start, size in self._chunks(
                    self.batch_size, self._forward_batch_size
                )
            ]
        return Trajectory(*map(torch.cat, zip(*parts, strict=True)))

    @staticmethod
    def _chunks(total: int, size: int) -> Iterator[tuple[int, int]]:
        return ((start, size) for start in range(0, total, size))

    def train(self) -> None:
        """Run the remaining PPO steps, saving a checkpoint after each epoch and, with
        ``save_every_n_steps``, a step checkpoint when one is due."""
        if self._opts.compile["model"]:
            log.info("The models compile in their first forward: expect a slow step 1.")
        self._optimizer.zero_grad(set_to_none=True)
        self._profiler.start()
        pbar = tqdm(total=self._total_steps, initial=self.progress.global_step)
        for curr_epoch in range(self.progress.epochs_run, self.progress.total_epochs):
            epoch_start = curr_epoch * self._batches_per_epoch
            # The last epoch ends early when the run's steps do not fill it.
            epoch_steps = min(self._batches_per_epoch, self._total_steps - epoch_start)
            # The data order depends only on the seed and the epoch.
            self._dataloader.sampler.set_epoch(curr_epoch)
            for idx, batch in training.epoch_batches(
                self._dataloader,
                steps_done=self.progress.global_step - epoch_start,
                steps_per_epoch=epoch_steps,
            ):
                input_ids = batch["tokens"].to(self._device)
                num_tokens = input_ids.numel()

                t0 = time.perf_counter()
                trajectory = self.generate_trajectory_batched(input_ids)
                trajectory_time = time.perf_counter() - t0

                rewards, kl, kl_rewards = rlhf.get_rewards_ppo(
                    trajectory.scores,
                    trajectory.logprobs,
                    trajectory.ref_logprobs,
                    self._kl_coeff,
                    trajectory.value_seq_idxs,
                )
                advantages, returns = rlhf.estimate_advantages(
                    trajectory.values,
                    rewards,
                    self._gamma,
                    self._lmbda,
                    masks=~trajectory.response_padding_masks,
                )

                t0 = time.perf_counter()
                ppo_stats, grad_norms = self._optimize(
                    trajectory, advantages, returns, input_ids.shape[1]
                )
                ppo_time = time.perf_counter() - t0

                self.progress.global_step += 1
                if self.progress.global_step % self._opts.log_every_n_steps == 0:
                    self._log_metrics(
                        trajectory,
                        ppo_stats,
                        torch.stack(grad_norms),
                        kl,
                        kl_rewards,
                        num_tokens / trajectory_time,
                        num_tokens / ppo_time,
                    )
                pbar.update(1)
                # Free this step's tensors before the next step generates.
                del trajectory, rewards, kl, kl_rewards, advantages, returns, ppo_stats
                # A step checkpoint (step_{PPO step}), when one is due; the epoch's
                # last step, also of a last epoch the run ends early, is saved with
                # the epoch, below.
                if idx + 1 < epoch_steps:
                    self._checkpoint.save()
                # Once per PPO step: the profiler's schedule counts those.
                self._profiler.step()

            self.progress.epochs_run += 1
            # The epoch's step checkpoint, then the policy's and the value model's
            # weights (epoch_{N}).
            self._checkpoint.save(epoch_end=True)
        pbar.close()
        self._profiler.stop()

    def _optimize(
        self,
        trajectory: Trajectory,
        advantages: torch.Tensor,
        returns: torch.Tensor,
        context_length: int,
    ) -> tuple[PPOStats, list[torch.Tensor]]:
        """Optimise the PPO objective over a step's trajectories.

        ``ppo_epochs`` passes, each over the trajectories in a fresh random order, in
        minibatches of ``ppo_batch_size``: one optimizer step per minibatch, after
        ``gradient_accumulation_steps`` backward passes.

        Returns:
            tuple[PPOStats, list[torch.Tensor]]: each statistic stacked over the
            minibatches, and each minibatch's gradient norm.
        """
        minibatch_stats: list[PPOStats] = []
        grad_norms: list[torch.Tensor] = []
        for _ in range(self._ppo_epochs):
            order = torch.randperm(
                self.batch_size, generator=self._rng, device=self._device
            )
            for start, size in self._chunks(self.batch_size, self._ppo_batch_size):
                minibatch = order[start : start + size]
                backward_stats = []
                for micro_start, micro_size in self._chunks(
                    size, self._ppo_backward_batch_size
                ):
                    idxs = minibatch[micro_start : micro_start + micro_size]
                    backward_stats.append(
                        self._ppo_step(
                            Trajectory(*(t.index_select(0, idxs) for t in trajectory)),
                            advantages[idxs],
                            returns[idxs],
                            context_length,
                        )
                    )
                # Each backward pass's statistics are already divided by the number
                # of passes: their sum is the minibatch's.
                minibatch_stats.append(
                    PPOStats(*map(sum, zip(*backward_stats, strict=True)))
                )

                if self._optimizer_in_bwd:
                    # The update already happened; backward measured the gradients.
                    grad_norms.append(self._optimizer.grad_norm)
                else:
                    grad_norms.append(
                        training.scale_and_clip_grads_(
                            self._trainable_params(), max_norm=self._opts.clip_grad_norm
                        )
                    )
                # A no-op after an in-backward backward.
                self._optimizer.step()
                self._optimizer.zero_grad(set_to_none=True)
                self._optimizer_steps += 1
        stacked = PPOStats(*map(torch.stack, zip(*minibatch_stats, strict=True)))
        return stacked, grad_norms

    def _trainable_params(self) -> Iterator[nn.Parameter]:
        """The policy's parameters, then the value model's: the optimizer's order."""
        yield from self._policy_model.parameters()
        yield from self._value_model.parameters()

    def _ppo_step(
        self,
        trajectory: Trajectory,
        advantages: torch.Tensor,
        returns: torch.Tensor,
        context_length: int,
    ) -> PPOStats:
        """One backward pass of the PPO loss over some trajectories.

        The policy's current log-probabilities and the value model's current values
        are compared with those recorded at generation. The loss backpropagated is
        their mean divided by ``gradient_accumulation_steps``, so that the passes of
        a minibatch add up to its mean.

        Returns:
            PPOStats: the loss and its parts, the mean probability ratio, the clipped
            fraction and an estimate of the KL divergence from the policy that
            generated, each divided by ``gradient_accumulation_steps``.
        """
        pi_logits = self._policy_model(
            trajectory.query_responses,
            input_pos=trajectory.position_ids,
            mask=trajectory.masks,
        )
        pi_logits = rlhf.truncate_sequence_for_logprobs(pi_logits, context_length)
        pi_logprobs = rlhf.logits_to_logprobs(
            pi_logits, trajectory.query_responses[:, context_length:], self._temperature
        )
        pi_logprobs[trajectory.response_padding_masks] = 1.0
        del pi_logits

        phi_values = self._value_model(
            trajectory.query_responses,
            input_pos=trajectory.position_ids,
            mask=trajectory.masks,
        )
        phi_values = rlhf.truncate_sequence_for_logprobs(
            phi_values, context_length
        ).squeeze(-1)
        phi_values[trajectory.value_padding_masks] = 0.0

        loss, policy_loss, value_loss, ratios, clipfrac = self._loss_fn(
            trajectory.logprobs,
            pi_logprobs,
            advantages,
            trajectory.values,
            phi_values,
            returns,
            padding_masks=~trajectory.response_padding_masks,
            value_padding_masks=~trajectory.value_padding_masks,
        )
        if self._optimizer_in_bwd:
            # Clips and applies both models' gradients inside backward.
            self._optimizer.backward(loss / self._gradient_accumulation_steps)
        else:
            (loss / self._gradient_accumulation_steps).backward()

        with torch.no_grad():
            approx_policy_kls = (
                0.5 * (pi_logprobs - trajectory.logprobs).pow(2)
            ).mean()
        return PPOStats(
            *(
                stat.detach() / self._gradient_accumulation_steps
                for stat in (
                    loss,
                    policy_loss,
                    value_loss,
                    ratios,
                    clipfrac,
                    approx_policy_kls,
                )
            )
        )

    def _log_metrics(
        self,
        trajectory: Trajectory,
        ppo_stats: PPOStats,
        grad_norms: torch.Tensor,
        kl: torch.Tensor,
        kl_rewards: torch.Tensor,
        tokens_per_second_trajectory: float,
        tokens_per_second_ppo: float,
    ) -> None:
        """Log the step's metrics, as Python numbers, at the current optimizer step."""
        kl_reward = kl_rewards.sum(1).mean()
        log_dict = {
            "scores": trajectory.scores.mean(),
            "num_stop_tokens": trajectory.response_padding_masks.any(-1).sum(),
            "rlhf_reward": trajectory.scores.mean() + kl_reward,
            "kl": kl.sum(1).mean(),
            "kl_reward": kl_reward,
            "loss": ppo_stats.loss.mean(),
            "policy_loss": ppo_stats.policy_loss.mean(),
            "value_loss": ppo_stats.value_loss.mean(),
            "clipfrac": ppo_stats.clipfrac.mean(),
            "ratios": ppo_stats.ratios.mean(),
            "approx_policy_kl": ppo_stats.approx_policy_kls.mean(),
            "response_lengths": trajectory.seq_lens.float().mean(),
            "grad_norm": grad_norms.mean(),
        }
        log_dict = {name: value.item() for name, value in log_dict.items()}
        log_dict |= {
            "lr": training.get_lr(self._optimizer),
            "tokens_per_second_per_gpu_trajectory": tokens_per_second_trajectory,
            "tokens_per_second_per_gpu_ppo": tokens_per_second_ppo,
        }
        if self._opts.log_peak_memory_stats:
            log_dict |= training.get_memory_stats(device=self._device)
        self._metric_logger.log_dict(log_dict, step=self._optimizer_steps)

    def cleanup(self) -> None:
        # Releases output_dir.
        self._checkpoint.close()
        self._metric_logger.close()


def _load(cfg_checkpointer: DictConfig) -> tuple[Any, dict[str, Any]]:
    """A checkpointer that reads no recipe state, and the model weights it read."""
    checkpointer = config.instantiate(cfg_checkpointer, should_load_recipe_state=False)
    return checkpointer, checkpointer.load_checkpoint()[training.MODEL_KEY]


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: the config file, with command-line overrides applied."""
    config.log_config(recipe_name="PPOFullFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = PPOFullFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
