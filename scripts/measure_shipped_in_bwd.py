"""Peak memory and speed of the shipped ``llama3_2/1B_full_single_device`` config, with
``optimizer_in_bwd`` True (as shipped) and False.

The config runs as shipped (bf16, bitsandbytes ``PagedAdamW8bit``, chunked
cross-entropy, its activation checkpointing setting, batch size and everything
else) on its own model, ``llama3_2_1b`` (1.24B parameters), with only what a machine
without the real assets forces swapped:

- the weights: a seeded random init (``N(0, 0.02)``, norm scales 1) written here as a
  Hugging Face checkpoint, which the config's ``FullModelHFCheckpointer`` reads;
- the tokenizer: the tiny sentencepiece model of ``tests/assets`` (512 ids, all valid
  for the model's 128256-id vocabulary);
- the data: an instruct dataset written here, whose answers are long enough that
  every sample fills ``--seq-len`` tokens, so every step sees the same
  ``batch_size x seq_len`` tokens.

Each mode runs ``--steps`` steps in a fresh ``tune run`` process. The recipe logs,
every step, ``tokens_per_second_per_gpu`` and the step's peak memory
(``torch.cuda.max_memory_allocated``, reset after each log). The report gives, per
mode, the median tokens/s and the largest per-step peak over the steps after
``--warmup`` (the first steps create the optimizer state and warm up kernels), and the
memory in-backward saves: the plain peak minus the in-backward peak, also as a share
of the gradients' bytes (every trainable parameter's size in the training dtype).
bitsandbytes' paged state lives in CUDA managed memory, which
``max_memory_allocated`` does not count, in either mode.

``--model tiny`` swaps the model for a 2-layer ``llama3_2`` (for a dry run on a CPU,
where the recipe logs no memory stats).

Usage (from the repository root; ``scripts/gpu_check.sh`` runs it)::

    python scripts/measure_shipped_in_bwd.py --device cuda --steps 20 \
        --out-json results.json --out-md results.md
    python scripts/measure_shipped_in_bwd.py --device cpu --model tiny --steps 2 ...
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make ``tests`` importable
    sys.path.insert(0, str(REPO_ROOT))

RECIPE = "full_finetune_single_device"
CONFIG = "llama3_2/1B_full_single_device"
CHECKPOINT_FILE = "model.safetensors"
TINY_MODEL: dict[str, Any] = {
    "_component_": "torchtune.models.llama3_2.llama3_2",
    "vocab_size": 512,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 64,
    "intermediate_dim": 128,
    "max_seq_len": 256,
}
GIB = 2**30


def shipped_config_path() -> Path:
    """The YAML file of ``CONFIG`` inside the installed torchtune."""
    import torchtune

    path = Path(torchtune.__file__).parent.parent / "recipes" / "configs"
    return path / f"{CONFIG}.yaml"


def model_section(model: str) -> dict[str, Any]:
    """The config's ``model`` section for ``--model``: the shipped one, or the tiny
    stand-in."""
    from omegaconf import OmegaConf

    if model == "tiny":
        return dict(TINY_MODEL)
    shipped = OmegaConf.load(shipped_config_path())
    return OmegaConf.to_container(shipped.model)


def write_data(path: Path, records: int, seq_len: int, seed: int = 0) -> None:
    """Instruct records whose answers are sentences of ``tests/assets/corpus.txt`` in
    random order, about 6 characters per token of ``seq_len``, so every tokenized
    sample is longer than ``seq_len`` and is cut to it (the tiny tokenizer makes
    about 1 token per 2 to 4 characters)."""
    sentences = [
        s.strip() + "."
        for s in (REPO_ROOT / "tests/assets/corpus.txt").read_text().split(".")
        if s.strip()
    ]
    rng = random.Random(seed)
    data = []
    for _ in range(records):
        text: list[str] = []
        while sum(len(s) + 1 for s in text) < 6 * seq_len:
            text.append(rng.choice(sentences))
        data.append({"input": "Continue the text.", "output": " ".join(text)})
    path.write_text(json.dumps(data))


def write_checkpoint(section: dict[str, Any], device: str, out: Path) -> int:
    """A seeded random init of the model, written as a Hugging Face checkpoint in
    bf16. Returns the number of trainable parameters."""
    import torch
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    from torchtune import config
    from torchtune.models.convert_weights import tune_to_hf

    torch.manual_seed(0)
    with torch.device(device):
        model = config.instantiate(OmegaConf.create(section)).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("scale"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    attn = model.layers[0].attn
    numel = sum(p.numel() for p in model.parameters())
    tied = model.output.__class__.__name__ == "TiedLinear"
    weights = tune_to_hf(
        model.state_dict(),
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        dim=attn.embed_dim,
        head_dim=attn.head_dim,
    )
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in weights.items()},
        str(out / CHECKPOINT_FILE),
        metadata={"format": "pt"},
    )
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": attn.embed_dim,
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "num_hidden_layers": len(model.layers),
        "vocab_size": model.tok_embeddings.num_embeddings,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    del model, weights
    if device == "cuda":
        torch.cuda.empty_cache()
    return numel


def overrides(
    args: argparse.Namespace, assets: Any, data: Path, checkpoint_dir: Path
) -> list[str]:
    """What this machine forces, and the run's length and seed; everything else is as
    shipped."""
    from tests.recipes.utils import format_override

    forced: dict[str, Any] = {
        "tokenizer._component_": "torchtune.models.llama2.llama2_tokenizer",
        "tokenizer.path": assets.tokenizer_path,
        "tokenizer.max_seq_len": args.seq_len,
        "dataset._component_": "torchtune.datasets.instruct_dataset",
        "dataset.source": "json",
        "dataset.data_files": data,
        "dataset.split": "train",
        "checkpointer.checkpoint_dir": checkpoint_dir,
        "checkpointer.checkpoint_files": [CHECKPOINT_FILE],
        "device": args.device,
        # Shipped configs leave the seed to chance; comparing two runs needs one.
        "seed": 0,
        "epochs": 1,
        "max_steps_per_epoch": args.steps,
        "log_every_n_steps": 1,
    }
    if args.model == "tiny":
        forced |= {f"model.{k}": v for k, v in TINY_MODEL.items()}
    return [format_override(k, v) for k, v in forced.items()]


def summarize_run(run: Any, warmup: int) -> dict[str, Any]:
    steps = sorted(run.metrics)
    steady = [s for s in steps if s > warmup] or steps
    metrics = run.metrics

    def values(name: str, which: list[int]) -> list[float]:
        return [metrics[s][name] for s in which if name in metrics[s]]

    tps = values("tokens_per_second_per_gpu", steady)
    peak = values("peak_memory_alloc", steady)
    return {
        "steps": steps,
        "steady_steps": steady,
        "wall_s": run.wall_s,
        "tokens_per_s_median": statistics.median(tps) if tps else None,
        "peak_alloc_gib": max(peak) if peak else None,
        "peak_alloc_gib_step1": metrics[steps[0]].get("peak_memory_alloc"),
        "peak_reserved_gib": max(values("peak_memory_reserved", steady), default=None),
        "losses": values("loss", steps),
        "metrics": {str(s): metrics[s] for s in steps},
    }


def markdown(result: dict[str, Any]) -> str:
    plain, bwd = result["runs"]["plain"], result["runs"]["in_bwd"]

    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    lines = [
        f"### `{CONFIG}` as shipped, plain vs in-backward",
        "",
        f"{result['model']} ({result['params'] / 1e6:,.1f}M parameters, gradients "
        f"{result['grad_bytes'] / GIB:.3f} GiB in bf16) on {result['device_name']}; "
        f"{result['steps']} steps of {result['batch_size']} x {result['seq_len']} "
        f"tokens; medians and peaks over steps {plain['steady_steps'][0]}.."
        f"{plain['steady_steps'][-1]}; torch {result['torch']}.",
        "",
        "| mode | tokens/s (median) | peak allocated (GiB) | step 1 peak (GiB) "
        "| peak reserved (GiB) | wall (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, run in (("plain", plain), ("in-backward", bwd)):
        lines.append(
            f"| {label} | {fmt(run['tokens_per_s_median'], '.0f')} "
            f"| {fmt(run['peak_alloc_gib'], '.2f')} "
            f"| {fmt(run['peak_alloc_gib_step1'], '.2f')} "
            f"| {fmt(run['peak_reserved_gib'], '.2f')} | {run['wall_s']:.0f} |"
        )
    saved = result["saved_gib"]
    lines += [
        "",
        f"Memory saved by in-backward: {fmt(saved, '.2f')} GiB = "
        f"{fmt(result['saved_share_of_grads'], '.0%')} of the gradients' bytes. "
        f"Speed in-backward / plain: {fmt(result['speed_ratio'], '.3f')}. "
        f"Largest relative loss difference between the modes: "
        f"{fmt(result['max_loss_rel_diff'], '.2e')}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--model", default="1b", choices=("1b", "tiny"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/measure_shipped"))
    parser.add_argument("--timeout", type=float, default=300.0, help="per run, s")
    parser.add_argument("--out-json", type=Path, required=True)
    parser.add_argument("--out-md", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch
    from omegaconf import OmegaConf

    from tests.assets.make_assets import DEFAULT_OUT, ensure_assets
    from tests.recipes.utils import run_tune

    start = time.perf_counter()
    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.work_dir.mkdir(parents=True)
    assets = ensure_assets(DEFAULT_OUT)
    batch_size = OmegaConf.load(shipped_config_path()).batch_size
    data = args.work_dir / "data.json"
    write_data(data, records=batch_size * (args.steps + 2), seq_len=args.seq_len)
    section = model_section(args.model)
    params = write_checkpoint(section, args.device, args.work_dir / "checkpoint")
    print(f"checkpoint and data ready in {time.perf_counter() - start:.0f} s")

    runs = {}
    for name, in_bwd in (("plain", False), ("in_bwd", True)):
        out = args.work_dir / name
        run = run_tune(
            RECIPE,
            CONFIG,
            [
                *overrides(args, assets, data, args.work_dir / "checkpoint"),
                f"optimizer_in_bwd={in_bwd}",
            ],
            output_dir=out,
            timeout=args.timeout,
        )
        runs[name] = summarize_run(run, args.warmup)
        print(
            f"{name}: {run.wall_s:.0f} s, median tokens/s "
            f"{runs[name]['tokens_per_s_median']}, peak GiB {runs[name]['peak_alloc_gib']}"
        )
        # The final checkpoint is a copy of the weights: no need to keep it.
        shutil.rmtree(out / "epoch_0", ignore_errors=True)

    plain, bwd = runs["plain"], runs["in_bwd"]
    grad_bytes = params * torch.finfo(torch.bfloat16).bits // 8
    saved = None
    if plain["peak_alloc_gib"] is not None and bwd["peak_alloc_gib"] is not None:
        saved = plain["peak_alloc_gib"] - bwd["peak_alloc_gib"]
    speed = None
    if plain["tokens_per_s_median"] and bwd["tokens_per_s_median"]:
        speed = bwd["tokens_per_s_median"] / plain["tokens_per_s_median"]
    loss_diffs = [
        abs(a - b) / abs(b)
        for a, b in zip(bwd["losses"], plain["losses"], strict=False)
        if b
    ]
    result = {
        "config": CONFIG,
        "model": section["_component_"],
        "device": args.device,
        "device_name": (
            torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
        ),
        "torch": torch.__version__,
        "params": params,
        "grad_bytes": grad_bytes,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size": batch_size,
        "seq_len": args.seq_len,
        "runs": runs,
        "saved_gib": saved,
        "saved_share_of_grads": None if saved is None else saved * GIB / grad_bytes,
        "speed_ratio": speed,
        "max_loss_rel_diff": max(loss_diffs) if loss_diffs else None,
    }
    args.out_json.write_text(json.dumps(result, indent=1))
    args.out_md.write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
