"""Make the tiny assets of the PPO recipe tests: a reward model and a prompt dataset.

PPO needs four models: the policy and its frozen reference (both the tiny Llama2
checkpoint of ``tests/assets/make_assets.py``, which Mistral's builder loads as is:
the two architectures have the same modules and key names), and a reward model and a
value model, classifiers with one output. This module writes the latter, and prompts:

- ``tiny_reward_hf/``: ``config.json`` + ``model.safetensors``, a seeded random init
  of ``torchtune.models.mistral.mistral_classifier(num_classes=1, ...)`` with the
  tiny model's sizes, converted to Hugging Face keys with
  ``torchtune.rlhf.utils.reward_tune_to_hf``: what
  ``FullModelHFCheckpointer(model_type="REWARD")`` loads. The value model starts from
  the same checkpoint, as PPO configs do.
- ``prompts.json``: ``{"prompt": ...}`` records (the prompts of the tiny instruct
  data) for ``torchtune.datasets.text_completion_dataset(column="prompt")``.

Nothing is downloaded. The outputs go to ``tests/assets/generated/ppo/`` by default
(git-ignored), next to the assets they build on, which are made first if needed. A
stamp records a hash of what the outputs depend on, and a file lock makes concurrent
callers wait for one generator, as in ``make_assets.py``.

Usage::

    python -m tests.assets.make_ppo_assets [--force]
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from tests.assets.make_assets import DEFAULT_OUT as TINY_ASSETS_OUT
from tests.assets.make_assets import (
    TinyAssets,
    asset_cli,
    ensure_assets,
    generate_once,
)

DEFAULT_OUT = TINY_ASSETS_OUT / "ppo"
# Bump to force every existing folder to be rebuilt.
ASSET_VERSION = 1
SEED = 20240602

REWARD_SUBDIR = "tiny_reward_hf"
CHECKPOINT_FILE = "model.safetensors"
PROMPTS_FILE = "prompts.json"
STAMP_FILE = "stamp.json"
INIT_STD = 0.02
# The score head is drawn wider than the other weights, so that the reward model
# tells responses apart by more than the KL penalty does and the policy's gradient
# comes mostly from the rewards.
SCORE_HEAD_STD = 0.5


@dataclass(frozen=True)
class PPOAssets:
    """Paths to the tiny PPO assets, and the tiny assets they build on.

    Attributes:
        root (Path): the folder of the PPO assets.
        tiny (TinyAssets): the tokenizer and the policy's checkpoint.
        prompts (Path): the prompt dataset, a JSON list of ``{"prompt": ...}``.
        reward_checkpoint_dir (Path): the reward (and value) model's Hugging Face
            checkpoint folder.
        reward_checkpoint_files (tuple[str, ...]): its weight files.
        model_kwargs (dict[str, Any]): keyword arguments of
            ``torchtune.models.mistral.mistral`` for the policy; with
            ``num_classes=1`` those of ``mistral_classifier`` for the reward model.
    """

    root: Path
    tiny: TinyAssets
    prompts: Path
    reward_checkpoint_dir: Path
    reward_checkpoint_files: tuple[str, ...]
    model_kwargs: dict[str, Any]

    @property
    def num_prompts(self) -> int:
        """How many records ``prompts`` holds."""
        return len(json.loads(self.prompts.read_text()))

    def paths(self) -> list[Path]:
        """Every file the generator writes (the stamp excluded)."""
        return [
            self.prompts,
            self.reward_checkpoint_dir / "config.json",
            *(self.reward_checkpoint_dir / f for f in self.reward_checkpoint_files),
        ]


def asset_paths(tiny: TinyAssets, out: Path | str = DEFAULT_OUT) -> PPOAssets:
    """Name the PPO assets under ``out`` without generating anything.

    Args:
        tiny (TinyAssets): the tiny assets they build on.
        out (Path | str): the output folder. Default: ``tests/assets/generated/ppo``.

    Returns:
        PPOAssets: the paths the generator writes under ``out``.
    """
    root = Path(out).resolve()
    # Mistral's builder takes every size of the tiny Llama2 (rope_base is the same
    # default in both).
    model_kwargs = {k: v for k, v in tiny.model_kwargs.items() if k != "rope_base"}
    return PPOAssets(
        root=root,
        tiny=tiny,
        prompts=root / PROMPTS_FILE,
        reward_checkpoint_dir=root / REWARD_SUBDIR,
        reward_checkpoint_files=(CHECKPOINT_FILE,),
        model_kwargs=model_kwargs,
    )


def build_reward_model(model_kwargs: dict[str, Any], seed: int = SEED) -> Any:
    """Build the tiny reward model and give it a seeded, version-stable random init.

    Norm scales are ones; every other weight is drawn from a normal distribution
    (``SCORE_HEAD_STD`` for the score head ``output.weight``, ``INIT_STD`` otherwise)
    in sorted parameter-name order from one seeded generator.

    Args:
        model_kwargs (dict[str, Any]): the sizes, as for ``mistral_classifier``.
        seed (int): seed of the generator that draws the weights.

    Returns:
        TransformerDecoder: the classifier with one output, fp32 on CPU.
    """
    import torch

    from torchtune.models.mistral import mistral_classifier

    model = mistral_classifier(num_classes=1, **model_kwargs)
    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            param = params[name]
            if name.endswith("scale"):
                param.fill_(1.0)
                continue
            std = SCORE_HEAD_STD if name == "output.weight" else INIT_STD
            param.copy_(torch.normal(0.0, std, param.shape, generator=generator))
    return model


def write_reward_checkpoint(
    model: Any, model_kwargs: dict[str, Any], checkpoint_dir: Path
) -> None:
    """Write a reward model as a Hugging Face sequence-classification checkpoint.

    Args:
        model (TransformerDecoder): the classifier from :func:`build_reward_model`.
        model_kwargs (dict[str, Any]): its sizes.
        checkpoint_dir (Path): where to write ``config.json`` and
            ``model.safetensors``; created if missing.
    """
    from safetensors.torch import save_file

    from torchtune.rlhf.utils import reward_tune_to_hf

    hf_state_dict = reward_tune_to_hf(
        model.state_dict(),
        num_heads=model_kwargs["num_heads"],
        num_kv_heads=model_kwargs["num_kv_heads"],
        dim=model_kwargs["embed_dim"],
    )
    hf_config = {
        "architectures": ["MistralForSequenceClassification"],
        "model_type": "mistral",
        "num_labels": 1,
        "hidden_act": "silu",
        "hidden_size": model_kwargs["embed_dim"],
        "intermediate_size": model_kwargs["intermediate_dim"],
        "num_attention_heads": model_kwargs["num_heads"],
        "num_key_value_heads": model_kwargs["num_kv_heads"],
        "num_hidden_layers": model_kwargs["num_layers"],
        "max_position_embeddings": model_kwargs["max_seq_len"],
        "rms_norm_eps": model_kwargs["norm_eps"],
        "vocab_size": model_kwargs["vocab_size"],
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    (checkpoint_dir / "config.json").write_text(
        json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
    )
    save_file(
        {key: value.detach().contiguous() for key, value in hf_state_dict.items()},
        str(checkpoint_dir / CHECKPOINT_FILE),
        metadata={"format": "pt"},
    )


def write_prompts(tiny: TinyAssets, path: Path) -> None:
    """Write the tiny instruct data's training prompts as a prompt dataset."""
    records = json.loads(tiny.train_data.read_text())
    prompts = [{"prompt": record["input"]} for record in records]
    path.write_text(json.dumps(prompts, indent=1, ensure_ascii=True) + "\n")


def _stamp_key(tiny: TinyAssets, seed: int) -> str:
    """Hash everything the generated files depend on."""
    digest = hashlib.sha256()
    digest.update(f"version={ASSET_VERSION};seed={seed};".encode())
    for package in ("torch", "safetensors"):
        digest.update(f"{package}={metadata.version(package)};".encode())
    digest.update(Path(__file__).resolve().read_bytes())
    # The prompts come from the tiny data, whose own stamp covers how it was made.
    digest.update(tiny.train_data.read_bytes())
    return digest.hexdigest()


def generate(
    tiny: TinyAssets, out: Path | str = DEFAULT_OUT, seed: int = SEED
) -> PPOAssets:
    """Write every PPO asset under ``out``, overwriting what is there.

    Prefer :func:`ensure_ppo_assets`, which skips the work when ``out`` is up to date
    and locks against concurrent generators.

    Args:
        tiny (TinyAssets): the tiny assets to build on (already generated).
        out (Path | str): the output folder, created if missing.
        seed (int): seed of the reward model's init.

    Returns:
        PPOAssets: the paths of what was written.
    """
    assets = asset_paths(tiny, out)
    assets.root.mkdir(parents=True, exist_ok=True)
    stamp = assets.root / STAMP_FILE
    # The stamp goes last: a generator killed halfway leaves no stamp behind.
    stamp.unlink(missing_ok=True)
    write_prompts(tiny, assets.prompts)
    write_reward_checkpoint(
        build_reward_model(assets.model_kwargs, seed),
        assets.model_kwargs,
        assets.reward_checkpoint_dir,
    )
    stamp.write_text(json.dumps({"key": _stamp_key(tiny, seed)}) + "\n")
    return assets


def ensure_ppo_assets(
    tiny: TinyAssets | None = None,
    out: Path | str = DEFAULT_OUT,
    seed: int = SEED,
    *,
    force: bool = False,
) -> PPOAssets:
    """Return the PPO assets under ``out``, generating them if missing or out of date.

    Args:
        tiny (TinyAssets | None): the tiny assets to build on; made (or found up to
            date) in ``tests/assets/generated`` when None. Default: None.
        out (Path | str): the output folder. Default: ``tests/assets/generated/ppo``.
        seed (int): seed of the reward model's init.
        force (bool): regenerate even when the stamp matches. Default: False.

    Returns:
        PPOAssets: the paths of the assets.
    """
    tiny = tiny if tiny is not None else ensure_assets()
    assets = asset_paths(tiny, out)
    generate_once(
        assets.root,
        assets.paths(),
        _stamp_key(tiny, seed),
        lambda: generate(tiny, assets.root, seed),
        force=force,
    )
    return assets


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: make the assets and print where they are."""
    args = asset_cli(__doc__, DEFAULT_OUT, seed=SEED).parse_args(argv)
    assets = ensure_ppo_assets(out=args.out, seed=args.seed, force=args.force)
    for path in assets.paths():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
