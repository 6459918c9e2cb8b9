"""Ask the demo model the held-out questions, before and after fine-tuning.

Reads the same config as the ``tune run`` that trained the model, so the tokenizer,
the model and both checkpoints are exactly the ones the run used. It loads the
initial checkpoint (``checkpointer.checkpoint_dir``) and the fine-tuned one
(``<output_dir>/epoch_<epochs - 1>/``) through torchtune's checkpointer, decodes
greedily with ``torchtune.generation.generate``, and prints:

- the loss the run logged, every few steps (from its ``DiskLogger`` file, if any);
- a few held-out prompts with the expected, untrained and fine-tuned answers;
- the exact-match accuracy of both models on the whole held-out set.

Usage, from the repository root, after the training run::

    python -m demo.ask --config demo/single_device.yaml [--show N] [key=value ...]

``key=value`` overrides are the ones given to ``tune run`` (``output_dir=...``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from torchtune import config, training
from torchtune.data import Message
from torchtune.generation import generate

_LOSS = re.compile(r"^Step (\d+) \| .*?\bloss:([-+0-9.eE]+|nan|inf)")


def load_config(path: str, overrides: list[str]) -> DictConfig:
    """Read a YAML config and apply ``key=value`` overrides as ``tune run`` does."""
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(overrides))
    OmegaConf.resolve(cfg)
    return cfg


def load_model(cfg: DictConfig, checkpoint_dir: Path, files: list[str]) -> Any:
    """Build ``cfg.model`` and load a Hugging Face checkpoint into it.

    Args:
        cfg (DictConfig): the training config.
        checkpoint_dir (Path): the folder of ``config.json`` and the weight files.
        files (list[str]): the weight files.

    Returns:
        TransformerDecoder: the model in eval mode.
    """
    # The checkpointer wants an output folder; loading writes nothing into it.
    with tempfile.TemporaryDirectory() as scratch:
        checkpointer = config.instantiate(
            cfg.checkpointer,
            checkpoint_dir=str(checkpoint_dir),
            checkpoint_files=files,
            recipe_checkpoint=None,
            output_dir=scratch,
        )
        state_dict = checkpointer.load_checkpoint()[training.MODEL_KEY]
    model = config.instantiate(cfg.model)
    model.load_state_dict(state_dict)
    return model.eval()


@torch.inference_mode()
def answer(
    model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int
) -> list[str]:
    """Greedily decode an answer to each prompt, all in one batch.

    Args:
        model (TransformerDecoder): the model.
        tokenizer (ModelTokenizer): the tokenizer of the training run.
        prompts (list[str]): user messages.
        max_new_tokens (int): the most tokens to generate per answer.

    Returns:
        list[str]: the decoded answers, cut at the first stop token.
    """
    # Tokenized as in training, up to where the assistant's answer begins.
    tokens = [
        tokenizer(
            {
                "messages": [
                    Message(role="user", content=p, masked=True),
                    Message(role="assistant", content=""),
                ]
            },
            inference=True,
        )["tokens"]
        for p in prompts
    ]
    # Left-pad to one length; generate() masks the padding out.
    width = max(len(t) for t in tokens)
    batch = torch.tensor([[tokenizer.pad_id] * (width - len(t)) + t for t in tokens])
    output, _ = generate(
        model,
        batch,
        max_generated_tokens=max_new_tokens,
        pad_id=tokenizer.pad_id,
        top_k=1,  # greedy
        stop_tokens=tokenizer.stop_tokens,
    )
    answers = []
    for row in output[:, width:].tolist():
        stops = [i for i, t in enumerate(row) if t in tokenizer.stop_tokens]
        answers.append(tokenizer.decode(row[: stops[0]] if stops else row).strip())
    return answers


def loss_summary(cfg: DictConfig, points: int = 7) -> str | None:
    """The run's loss at a few evenly spaced steps, read from its ``DiskLogger`` file."""
    log_dir = cfg.get("metric_logger", {}).get("log_dir")
    logs = (
        sorted(Path(log_dir).glob("*.txt"), key=lambda p: p.stat().st_mtime)
        if log_dir
        else []
    )
    if not logs:
        return None
    losses = {}
    for line in logs[-1].read_text().splitlines():
        match = _LOSS.match(line.strip())
        if match:
            losses[int(match.group(1))] = float(match.group(2))
    if not losses:
        return None
    steps = sorted(losses)
    picked = sorted(
        {steps[round(i * (len(steps) - 1) / (points - 1))] for i in range(points)}
    )
    return "  ".join(f"step {s}: {losses[s]:.3f}" for s in picked)


def _show(text: str, width: int) -> str:
    """One line of at most ``width`` characters, whatever an untrained model says."""
    text = "".join(c if c.isprintable() and c != "\ufffd" else "?" for c in text)
    return text if len(text) <= width else text[: width - 1] + "~"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the training run's YAML")
    parser.add_argument(
        "--data",
        help="held-out JSON records (default: <assets_dir>/test.json)",
    )
    parser.add_argument(
        "--show", type=int, default=8, help="prompts to print (default: %(default)s)"
    )
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    torch.manual_seed(0)

    records = json.loads(
        Path(args.data or Path(cfg.assets_dir) / "test.json").read_text()
    )
    prompts = [r["input"] for r in records]
    expected = [r["output"] for r in records]
    tokenizer = config.instantiate(cfg.tokenizer)
    # Room for the longest expected answer, and a few tokens more.
    max_new_tokens = (
        max(len(tokenizer.encode(e, add_bos=False, add_eos=False)) for e in expected)
        + 3
    )

    trained_dir = Path(cfg.output_dir) / f"epoch_{cfg.epochs - 1}"
    trained_files = sorted(p.name for p in trained_dir.glob("model-*.safetensors"))
    if not trained_files:
        print(f"No fine-tuned checkpoint in {trained_dir}: run tune run first.")
        return 1
    base = load_model(
        cfg,
        Path(cfg.checkpointer.checkpoint_dir),
        list(cfg.checkpointer.checkpoint_files),
    )
    trained = load_model(cfg, trained_dir, trained_files)
    before = answer(base, tokenizer, prompts, max_new_tokens)
    after = answer(trained, tokenizer, prompts, max_new_tokens)

    summary = loss_summary(cfg)
    if summary:
        print(f"\nTraining loss  {summary}")
    print(
        f"\nHeld-out prompts (never seen in training), greedy decoding of {trained_dir}/:\n"
    )
    print(f"  {'prompt':<16} {'expected':<10} {'untrained':<12} fine-tuned")
    for p, e, b, a in list(zip(prompts, expected, before, after, strict=True))[
        : args.show
    ]:
        mark = "ok" if a == e else "WRONG"
        print(
            f"  {_show(p, 16):<16} {e:<10} {_show(b, 12):<12} {_show(a, 12):<12} {mark}"
        )
    n = len(records)
    right_before = sum(b == e for b, e in zip(before, expected, strict=True))
    right_after = sum(a == e for a, e in zip(after, expected, strict=True))
    print(
        f"\nExact-match accuracy on {n} held-out prompts: untrained "
        f"{right_before}/{n} ({right_before / n:.0%}), fine-tuned "
        f"{right_after}/{n} ({right_after / n:.0%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
