"""Training utilities: distributed setup, checkpointing, precision, memory, LR
schedules, and :class:`OptimizerInBackward`."""

from torchtune.training._activation_offloading import (
    NoOpManager,
    OffloadActivations,
    get_act_offloading_ctx_manager,
)
from torchtune.training._compile import compile_loss, compile_model
from torchtune.training._distributed import (
    gather_cpu_state_dict,
    get_distributed_backend,
    get_full_optimizer_state_dict,
    get_shard_conditions,
    get_world_size_and_rank,
    init_distributed,
    is_distributed,
    load_from_full_model_state_dict,
    load_from_full_optimizer_state_dict,
    prepare_mha_for_tp,
    set_torch_num_threads,
    shard_model,
    validate_no_params_on_meta_device,
)
from torchtune.training._grad_scaler import scale_grads
from torchtune.training._model_util import disable_dropout
from torchtune.training._profiler import (
    DEFAULT_PROFILE_DIR,
    DEFAULT_PROFILER_ACTIVITIES,
    DEFAULT_SCHEDULE,
    DEFAULT_TRACE_OPTS,
    PROFILER_KEY,
    DummyProfiler,
    setup_torch_profiler,
)
from torchtune.training.activations import apply_selective_activation_checkpointing
from torchtune.training.checkpointing import (
    ADAPTER_CONFIG,
    ADAPTER_KEY,
    DATALOADER_KEY,
    EPOCHS_KEY,
    MAX_STEPS_KEY,
    MODEL_KEY,
    OPT_KEY,
    RNG_KEY,
    SEED_KEY,
    STEPS_KEY,
    TOTAL_EPOCHS_KEY,
    Checkpointer,
    DistributedCheckpointer,
    FormattedCheckpointFiles,
    FullModelHFCheckpointer,
    FullModelMetaCheckpointer,
    FullModelTorchTuneCheckpointer,
    ModelType,
    update_state_dict_for_classifier,
)
from torchtune.training.checkpointing._checkpoint_manager import (
    CheckpointManager,
    CheckpointOptions,
    TrainingProgress,
)
from torchtune.training.gradients import scale_and_clip_grads_
from torchtune.training.loop import (
    StepLogger,
    epoch_batches,
    next_token_labels,
    setup_lr_scheduler,
    setup_profiler,
    stateful_dataloader,
    stop_if_not_finite,
)
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup, get_lr
from torchtune.training.memory import (
    OptimizerInBackward,
    build_optimizer,
    cleanup_before_training,
    get_memory_stats,
    log_memory_stats,
    set_activation_checkpointing,
)
from torchtune.training.optim_in_bwd_deprecated import (
    OptimizerInBackwardWrapper,
    create_optim_in_bwd_wrapper,
    register_optim_in_bwd_hooks,
)
from torchtune.training.pooling import get_unmasked_sequence_lengths
from torchtune.training.precision import (
    get_dtype,
    set_default_dtype,
    validate_expected_param_dtype,
)
from torchtune.training.quantization import get_quantizer_mode
from torchtune.training.recipe_options import RecipeOptions
from torchtune.training.seed import set_seed
from torchtune.training.sharded_model import build_sharded_model

__all__ = [
    # activation offloading and checkpointing
    "NoOpManager",
    "OffloadActivations",
    "apply_selective_activation_checkpointing",
    "get_act_offloading_ctx_manager",
    "set_activation_checkpointing",
    # compile
    "compile_loss",
    "compile_model",
    # distributed
    "gather_cpu_state_dict",
    "get_distributed_backend",
    "get_full_optimizer_state_dict",
    "get_shard_conditions",
    "get_world_size_and_rank",
    "init_distributed",
    "is_distributed",
    "load_from_full_model_state_dict",
    "load_from_full_optimizer_state_dict",
    "prepare_mha_for_tp",
    "set_torch_num_threads",
    "build_sharded_model",
    "shard_model",
    "validate_no_params_on_meta_device",
    # gradients and models
    "disable_dropout",
    "scale_grads",
    # profiler
    "DEFAULT_PROFILE_DIR",
    "DEFAULT_PROFILER_ACTIVITIES",
    "DEFAULT_SCHEDULE",
    "DEFAULT_TRACE_OPTS",
    "DummyProfiler",
    "PROFILER_KEY",
    "setup_torch_profiler",
    # checkpointing
    "ADAPTER_CONFIG",
    "ADAPTER_KEY",
    "Checkpointer",
    "DATALOADER_KEY",
    "DistributedCheckpointer",
    "EPOCHS_KEY",
    "FormattedCheckpointFiles",
    "FullModelHFCheckpointer",
    "FullModelMetaCheckpointer",
    "FullModelTorchTuneCheckpointer",
    "MAX_STEPS_KEY",
    "MODEL_KEY",
    "ModelType",
    "OPT_KEY",
    "RNG_KEY",
    "SEED_KEY",
    "STEPS_KEY",
    "TOTAL_EPOCHS_KEY",
    "update_state_dict_for_classifier",
    # saving and resuming
    "CheckpointManager",
    "CheckpointOptions",
    "TrainingProgress",
    # training loop
    "StepLogger",
    "epoch_batches",
    "next_token_labels",
    "scale_and_clip_grads_",
    "setup_lr_scheduler",
    "setup_profiler",
    "stateful_dataloader",
    "stop_if_not_finite",
    # learning rate
    "get_cosine_schedule_with_warmup",
    "get_lr",
    # memory and optimizer in backward
    "OptimizerInBackward",
    "build_optimizer",
    "RecipeOptions",
    "cleanup_before_training",
    "get_memory_stats",
    "log_memory_stats",
    # deprecated 0.6.1 optimizer-in-backward API
    "OptimizerInBackwardWrapper",
    "create_optim_in_bwd_wrapper",
    "register_optim_in_bwd_hooks",
    # data, precision, quantization, seed
    "get_unmasked_sequence_lengths",
    "get_dtype",
    "set_default_dtype",
    "validate_expected_param_dtype",
    "get_quantizer_mode",
    "set_seed",
]
