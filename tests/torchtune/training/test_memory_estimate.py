"""Tests for torchtune/training/memory_estimate.py: the estimate, made on fake
tensors, against the same training step run on real CPU tensors.

The real step's memory is read from the profiler's allocation events (every
allocation and free of the CPU allocator, in order), independently of the
estimate's own counting: the bytes alive when the step starts (parameters,
buffers, optimizer state) plus the largest sum of the step's allocations and
frees. The estimate runs the same recipe code on fake tensors, so the two must
agree but for what real kernels allocate inside themselves (workspaces), which
fake kernels do not: a few KiB per step at these sizes.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from omegaconf import OmegaConf
from torch.profiler import profile

from tests.helpers import one_process_group
from torchtune.training import memory_estimate as me

RECIPE = "full_finetune_single_device"
SEQ_LEN = 16
# Real kernels' own workspaces, which fake kernels do not allocate: measured at
# under 8 KiB per step for these models (e.g. 1,548 B with AdamW); 1% of the step's
# allocations or 64 KiB, whichever is larger, leaves room for other CPU kernels.
RTOL, ATOL = 0.01, 64 * 1024


def tiny_config(
    optimizer: str = "torch.optim.AdamW", *, checkpointing: bool = True, **model
) -> OmegaConf:
    """A 2-layer Llama 3.2 (embedding tied to the output) whose parameters outweigh
    its activations at ``SEQ_LEN`` tokens, so that the plain peak is the optimizer
    step's and in-backward has something to save."""
    section = {
        "_component_": "torchtune.models.llama3_2.llama3_2",
        "vocab_size": 4096,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "embed_dim": 256,
        "intermediate_dim": 512,
        "max_seq_len": 256,
    } | model
    return OmegaConf.create(
        {
            "model": section,
            "optimizer": {"_component_": optimizer, "lr": 1e-3},
            "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
            "batch_size": 1,
            "device": "cpu",
            "dtype": "fp32",
            "enable_activation_checkpointing": checkpointing,
            "tokenizer": {"max_seq_len": SEQ_LEN},
        }
    )


_MEASURED: dict = {}


def measured(name: str, cfg, in_backward: bool) -> tuple[int, int, dict[str, int]]:
    """:func:`measure_real_step`, once per config and mode."""
    key = (name, in_backward)
    if key not in _MEASURED:
        _MEASURED[key] = measure_real_step(cfg, in_backward)
    return _MEASURED[key]


def measure_real_step(
    cfg, in_backward: bool, seq_len: int = SEQ_LEN, recipe: str = RECIPE
) -> tuple[int, int, dict[str, int]]:
    """The second training step of ``cfg`` on real tensors: bytes alive at its start,
    its peak, and what the first step left (parameter, gradient and state bytes)."""
    # The distributed recipes shard their models with FSDP2 even on one process.
    with one_process_group() if me.RECIPES[recipe] else contextlib.nullcontext():
        return _measure_real_step(cfg, in_backward, seq_len, recipe)


def _measure_real_step(
    cfg, in_backward: bool, seq_len: int, recipe: str
) -> tuple[int, int, dict[str, int]]:
    estimator = me._Estimator(
        OmegaConf.merge(cfg, {"optimizer_in_bwd": in_backward}), recipe, 1, seq_len
    )
    torch.manual_seed(0)
    setup = estimator.build_real(in_backward)
    params = [p for model in setup.models for p in model.parameters()]
    grad_bytes = {}

    def record(param: torch.Tensor) -> None:
        # After an in-backward update the gradient is gone (and not counted).
        if param.grad is not None:
            grad_bytes[param] = param.grad.untyped_storage().nbytes()

    for p in params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(record)
    estimator.step_real(setup, in_backward)  # creates the optimizer state
    state = [
        v
        for s in setup.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    alive = {}
    buffers = [b for model in setup.models for b in model.buffers()]
    for t in [*params, *buffers, *state]:
        for storage in me._storages(t):
            alive[id(storage)] = storage.nbytes()
    with profile(profile_memory=True) as prof:
        estimator.step_real(setup, in_backward)
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    start = sum(alive.values())
    parts = {
        "parameters": sum(p.untyped_storage().nbytes() for p in params),
        "gradients": sum(grad_bytes.values()),
        "optimizer state": sum(
            {id(s): s.nbytes() for t in state for s in me._storages(t)}.values()
        ),
    }
    return start, start + peak, parts


@pytest.fixture(scope="module")
def estimates() -> dict:
    """Estimates of the configs the tests measure, made once."""
    out = {}
    for name, cfg in {
        "adamw": tiny_config(),
        "adamw8bit": tiny_config("bitsandbytes.optim.AdamW8bit"),
        "activations": tiny_config(checkpointing=False, vocab_size=512),
        # In-backward clipping runs backward twice over a retained graph.
        "clipped": OmegaConf.merge(tiny_config(), {"clip_grad_norm": 1.0}),
    }.items():
        out[name] = (cfg, me.estimate(cfg, recipe=RECIPE, seq_len=SEQ_LEN))
    return out


@pytest.mark.parametrize("in_backward", [False, True], ids=["plain", "in_bwd"])
@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "activations", "clipped"])
def test_estimated_peak_is_the_real_steps_peak(estimates, name, in_backward):
    cfg, est = estimates[name]
    mode = est.in_backward if in_backward else est.plain
    start, peak, _ = measured(name, cfg, in_backward)
    # What is alive before the step is counted by the same storages: exactly.
    assert mode.step_start == start
    torch.testing.assert_close(
        mode.peak.total - start, peak - start, rtol=RTOL, atol=ATOL
    )


def recipe_configs() -> dict[str, OmegaConf]:
    """A tiny config of each recipe with a step of its own, run on one process."""
    return {
        "full_dpo_distributed": OmegaConf.merge(
            tiny_config(), {"loss": {"_component_": "torchtune.rlhf.loss.DPOLoss"}}
        ),
        "qat_distributed": OmegaConf.merge(
            tiny_config(),
            {
                "quantizer": {
                    "_component_": "torchtune.training.quantization."
                    "Int8DynActInt4WeightQATQuantizer",
                    "groupsize": 32,
                }
            },
        ),
        "dev/early_exit_finetune_distributed": OmegaConf.merge(
            tiny_config(checkpointing=False),
            {
                "loss": {"_component_": "torch.nn.CrossEntropyLoss"},
                "early_exit_loss": {"layers": ":"},
            },
        ),
        "ppo_full_finetune_single_device": OmegaConf.load(
            "tests/recipes/configs/tiny_ppo_single_device.yaml"
        ),
    }


@pytest.fixture(scope="module")
def recipe_estimates() -> dict:
    return {
        recipe: (cfg, me.estimate(cfg, recipe=recipe, seq_len=SEQ_LEN))
        for recipe, cfg in recipe_configs().items()
    }


@pytest.mark.parametrize("in_backward", [False, True], ids=["plain", "in_bwd"])
@pytest.mark.parametrize("recipe", list(recipe_configs()))
def test_each_recipes_estimated_peak_is_its_real_steps_peak(
    recipe_estimates, recipe, in_backward
):
    # DPO's two models, QAT's fake quantization, the early-exit read-outs and PPO's
    # generation and minibatch steps, run on real tensors as on fake ones.
    cfg, est = recipe_estimates[recipe]
    mode = est.in_backward if in_backward else est.plain
    start, peak, _ = measure_real_step(cfg, in_backward, SEQ_LEN, recipe)
    torch.testing.assert_close(
        mode.peak.total - start, peak - start, rtol=RTOL, atol=ATOL
    )


def test_tracking_keeps_nothing_alive_that_the_step_frees():
    # torch's trackers hook every module's outputs, which kept a chunk of the
    # logits' gradient alive past its use (4 MB here): large enough a vocabulary
    # and sequence to show it against the tolerance.
    seq_len = 128
    cfg = OmegaConf.merge(
        tiny_config(vocab_size=32000),
        {"batch_size": 2, "tokenizer": {"max_seq_len": seq_len}},
    )
    est = me.estimate(cfg, recipe=RECIPE, seq_len=seq_len)
    start, peak, _ = measure_real_step(cfg, False, seq_len)
    assert est.plain.step_start == start
    torch.testing.assert_close(
        est.plain.peak.total - start, peak - start, rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
def test_estimated_saving_is_the_real_saving(estimates, name):
    cfg, est = estimates[name]
    plain = measured(name, cfg, False)[1]
    in_bwd = measured(name, cfg, True)[1]
    torch.testing.assert_close(est.saving, plain - in_bwd, rtol=RTOL, atol=2 * ATOL)
    # The model is parameter-bound: in-backward saves at least a third of the
    # gradients (the tied embedding's gradient sum, alive through backward, is
    # about half of them).
    assert est.saving > est.gradient_bytes / 3


def test_breakdown_of_the_plain_peak_is_the_real_steps(estimates):
    # The plain step peaks in the optimizer step: every parameter, every gradient
    # and the whole state are alive, in the bytes the real step holds.
    cfg, est = estimates["adamw"]
    _, _, real = measured("adamw", cfg, False)
    peak = est.plain.peak
    assert peak.phase == "optimizer step"
    for part in ("parameters", "gradients", "optimizer state"):
        assert peak.by_category[part] == real[part], part
    assert est.gradient_bytes == real["gradients"]
    assert est.optimizer_state_bytes == real["optimizer state"]
    # AdamW's state is two moments per parameter and a step count each.
    assert real["optimizer state"] >= 2 * real["parameters"]


def test_in_backward_peak_holds_at_most_one_bucket_of_gradients(estimates):
    _, est = estimates["adamw"]
    peak = est.in_backward.peak
    # The tied embedding (4096 x 256 fp32, 4 MiB) is the largest parameter: no more
    # than a 4 MiB bucket of gradients is alive at once.
    assert peak.by_category["gradients"] <= 4 * 2**20
    assert est.bound <= peak.total
    assert sum(b for _, b, _ in peak.held_gradients) == peak.total - est.bound
    report = me.format_report(est)
    assert "in-backward saves" in report and "ESTIMATED" in report


def test_bitsandbytes_state_is_its_documented_layout(estimates):
    # uint8 per element and an fp32 absmax per block of 256 for each of the two
    # moments; fp32 moments for parameters under 4096 elements (the norm scales).
    _, est = estimates["adamw8bit"]
    model = me._Estimator(
        OmegaConf.merge(estimates["adamw8bit"][0], {"optimizer_in_bwd": False}),
        RECIPE,
        1,
        SEQ_LEN,
    ).build_real(False)
    expected = 0
    for p in model.model.parameters():
        n = p.numel()
        expected += 2 * 4 * n if n < 4096 else 2 * (n + 4 * -(-n // 256))
    # Plus the two 256-entry fp32 quantization maps every 8-bit parameter's state
    # names, one pair shared by all of them.
    assert est.optimizer_state_bytes == expected + 2 * 256 * 4


@pytest.fixture(scope="module")
def distributed(estimates) -> me.Estimate:
    """The ``adamw`` config's estimate for FSDP2 over 2 ranks."""
    cfg, _ = estimates["adamw"]
    return me.estimate(
        cfg, recipe="full_finetune_distributed", nproc=2, seq_len=SEQ_LEN
    )


def test_distributed_estimate_is_per_rank(estimates, distributed):
    _, single = estimates["adamw"]
    est = distributed
    # Every dimension is even: each of 2 ranks holds half of every parameter.
    assert est.param_bytes * 2 == single.param_bytes
    assert est.gradient_bytes * 2 == single.gradient_bytes
    # In-backward keeps a few scalars more (the gradient scale), nothing else.
    assert est.in_backward.peak.total <= est.plain.peak.total + 64
    assert est.plain.peak.by_category["parameters"] == est.param_bytes


@pytest.mark.parametrize("where", ["one device", "FSDP2"])
def test_in_backward_state_is_optimizer_state_and_step_temporaries_are_not(
    estimates, distributed, where
):
    # torch's trackers label state through the optimizers' step hooks: whatever a
    # step allocates (its temporaries too) as state, and under FSDP2 only the
    # state of the optimizer they are given, so an in-backward optimizer's state,
    # made by the optimizers inside it in backward, as temporaries. The estimate
    # labels what the optimizer's state holds after a step instead.
    est = estimates["adamw"][1] if where == "one device" else distributed
    for mode in (est.plain, est.in_backward):
        assert mode.peak.by_category["optimizer state"] == est.optimizer_state_bytes


def test_a_change_in_the_recipes_step_moves_the_estimate(estimates, monkeypatch):
    # The estimate runs the recipe's own _loss_step: a recipe that averages the
    # loss of two forward passes over the batch (both kept for backward) has
    # twice the activations at a peak in backward, and the estimate says so.
    cfg, before = estimates["activations"]
    recipe = me._recipe_class(RECIPE)
    loss_step = recipe._loss_step

    def two_forward_passes(self, batch):
        first, num_tokens = loss_step(self, dict(batch))
        second, _ = loss_step(self, batch)
        return (first + second) / 2, num_tokens

    monkeypatch.setattr(recipe, "_loss_step", two_forward_passes)
    after = me.estimate(cfg, recipe=RECIPE, seq_len=SEQ_LEN)
    activations = before.plain.peak.by_category["activations"]
    assert after.plain.peak.by_category["activations"] >= 2 * activations > 0
    assert after.plain.peak.total > before.plain.peak.total


def test_a_change_in_the_recipes_model_build_moves_the_estimate(estimates, monkeypatch):
    # The estimate builds with the recipe's own _setup_model: a recipe edited to
    # freeze the (tied) embedding trains, and keeps optimizer state for, the rest.
    cfg, before = estimates["adamw"]
    recipe = me._recipe_class(RECIPE)
    setup_model = recipe._setup_model

    def frozen_embedding(self, *args, **kwargs):
        model = setup_model(self, *args, **kwargs)
        model.tok_embeddings.requires_grad_(False)
        return model

    monkeypatch.setattr(recipe, "_setup_model", frozen_embedding)
    after = me.estimate(cfg, recipe=RECIPE, seq_len=SEQ_LEN)
    embedding = 4096 * 256
    assert after.trainable_params == before.trainable_params - embedding
    # AdamW's two fp32 moments per trained element, and one step count fewer.
    assert (
        after.optimizer_state_bytes
        == before.optimizer_state_bytes - 2 * 4 * (embedding) - 4
    )
    assert after.plain.peak.total < before.plain.peak.total


def test_command_line_reads_a_config_file_and_overrides(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    OmegaConf.save(tiny_config(), path)
    out = tmp_path / "estimate.json"
    me.main(
        [
            "--config",
            str(path),
            "--recipe",
            RECIPE,
            "--json",
            str(out),
            "batch_size=2",
            "optimizer_in_bwd_bucket_cap_mb=0",
        ]
    )
    report = capsys.readouterr().out
    assert "batch 2 x 16 tokens" in report
    saved = json.loads(out.read_text())
    assert saved["batch_size"] == 2 and saved["bucket_cap_mb"] == 0
    assert (
        saved["saving"]
        == saved["plain"]["peak"]["total"] - (saved["in_backward"]["peak"]["total"])
    )


def test_refuses_a_recipe_it_does_not_reproduce():
    with pytest.raises(ValueError, match="not one the estimate reproduces"):
        me.estimate(tiny_config(), recipe="lora_dpo_single_device")
    with pytest.raises(ValueError, match="--nproc must be 1"):
        me.estimate(tiny_config(), recipe=RECIPE, nproc=2)
    # NF4 weights cannot be made on fake tensors: refused before anything is built.
    qlora = {"_component_": "torchtune.models.llama3_2.qlora_llama3_2_1b"}
    with pytest.raises(ValueError, match="qlora_llama3_2_1b quantizes its base"):
        me.estimate(
            OmegaConf.create({"model": qlora}), recipe="lora_finetune_single_device"
        )


def test_fits_keeps_a_reserve_free():
    # 20 GiB: 20 * 1.1 + 2 = 24 GiB = 25.8 GB: not in 24 GB, in 40 GB.
    assert me.fits(20 * me.GIB) == [40, 48, 80]
    assert me.fits(100 * me.GIB) == []
    # Paged optimizer state can live in host memory: 100 GiB of which 90 paged.
    assert me.fits(100 * me.GIB, on_host=90 * me.GIB) == [24, 40, 48, 80]


def test_torchao_8bit_state_is_its_own_layout():
    # torchao's AdamW8bit: for a parameter of 4096 elements or more (a multiple of
    # its 256-element block), each moment is uint8 codes, an fp32 scale per block
    # and its own 256-entry fp32 map; smaller ones get fp32 moments; each parameter
    # has a 4-byte step count.
    est = me.estimate(
        tiny_config("torchao.optim.AdamW8bit"), recipe=RECIPE, seq_len=SEQ_LEN
    )
    setup = me._Estimator(
        OmegaConf.merge(tiny_config(), {"optimizer_in_bwd": False}), RECIPE, 1, 1
    ).build_real(False)
    expected = 0
    for p in setup.model.parameters():
        n = p.numel()
        quantized = n >= 4096 and n % 256 == 0
        expected += 4 + 2 * ((n + 4 * n // 256 + 256 * 4) if quantized else 4 * n)
    assert est.optimizer_state_bytes == expected


def test_lora_trains_only_the_adapter():
    cfg = tiny_config()
    cfg.model = OmegaConf.merge(
        cfg.model,
        {
            "_component_": "torchtune.models.llama3_2.lora_llama3_2",
            "lora_attn_modules": ["q_proj", "v_proj"],
            "apply_lora_to_mlp": False,
            "lora_rank": 8,
            "lora_alpha": 16,
        },
    )
    est = me.estimate(cfg, recipe="lora_finetune_single_device", seq_len=SEQ_LEN)
    # Rank-8 A and B for q and v (256 -> 256 and 256 -> 128) in each of 2 layers.
    assert est.trainable_params == 2 * (8 * 256 + 256 * 8 + 8 * 256 + 128 * 8)
    assert est.gradient_bytes == 4 * est.trainable_params
    # AdamW's state: two fp32 moments and a step count per adapter parameter.
    assert est.optimizer_state_bytes == 2 * est.gradient_bytes + 4 * 8


def test_dpo_counts_the_frozen_reference_beside_the_policy():
    cfg = OmegaConf.merge(
        tiny_config(), {"loss": {"_component_": "torchtune.rlhf.loss.DPOLoss"}}
    )
    est = me.estimate(cfg, recipe="full_dpo_distributed", nproc=2, seq_len=SEQ_LEN)
    # The reference is the policy's twin and trains nothing.
    assert est.params == 2 * est.trainable_params
    assert est.param_bytes == 2 * est.gradient_bytes
    assert est.plain.peak.by_category["parameters"] == est.param_bytes
    assert est.in_backward.peak.total <= est.plain.peak.total


def test_ppo_counts_its_four_models_and_trains_two(recipe_estimates):
    cfg, est = recipe_estimates["ppo_full_finetune_single_device"]
    # Policy and value model train; their frozen twins (reference, reward) do not.
    assert est.params == 2 * est.trainable_params
    assert est.plain.peak.by_category["parameters"] == est.param_bytes
    # AdamW's two fp32 moments and a step count for each trained parameter.
    trained = len([p for m in (0, 2) for p in cfg_models(cfg)[m]])
    assert est.optimizer_state_bytes == 2 * est.gradient_bytes + 4 * trained
    assert est.in_backward.peak.total <= est.plain.peak.total
    assert any("responses of 8 (max_generated_tokens)" in n for n in est.notes)


def cfg_models(cfg) -> list[list[str]]:
    """The parameter names of PPO's four models, in the recipe's order."""
    from torchtune import config

    with torch.device("meta"):
        policy = config.instantiate(cfg.policy_model)
        value = config.instantiate(cfg.reward_and_value_model)
    names = [[n for n, _ in m.named_parameters()] for m in (policy, value)]
    return [names[0], names[0], names[1], names[1]]


def test_qat_counts_the_fake_quantization(distributed):
    cfg = OmegaConf.merge(
        tiny_config(),
        {
            "quantizer": {
                "_component_": "torchtune.training.quantization."
                "Int8DynActInt4WeightQATQuantizer",
                "groupsize": 32,
            }
        },
    )
    est = me.estimate(cfg, recipe="qat_distributed", nproc=2, seq_len=SEQ_LEN)
    # The same model and step as full fine-tuning, plus the fake-quantized
    # weights and activations the quantizer's layers make in forward.
    assert est.param_bytes == distributed.param_bytes
    assert est.plain.peak.total > distributed.plain.peak.total


def test_early_exit_counts_the_hidden_states_it_reads_out():
    cfg = OmegaConf.merge(
        tiny_config(checkpointing=False),
        {"loss": {"_component_": "torch.nn.CrossEntropyLoss"}},
    )
    recipe = "dev/early_exit_finetune_distributed"
    plain = me.estimate(cfg, recipe=recipe, nproc=2, seq_len=SEQ_LEN)
    cfg.early_exit_loss = {"layers": ":", "include_last_layer": True}
    early = me.estimate(cfg, recipe=recipe, nproc=2, seq_len=SEQ_LEN)
    # Every layer's output is read out through the norm and output projection.
    assert early.plain.peak.total > plain.plain.peak.total


def test_optimizer_note_gives_bitsandbytes_state_layout_by_class():
    from bitsandbytes import optim

    assert "fp32 per element" in me._optimizer_note(optim.PagedAdamW)
    assert "uint8 per element" in me._optimizer_note(optim.PagedAdamW8bit)
