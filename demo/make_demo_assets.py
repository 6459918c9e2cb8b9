"""Make the demo's assets: a digit-reversal dataset, a tokenizer and a tiny Llama2.

The demo teaches a randomly initialised 2-layer Llama2 (about 110K parameters) to
write a 4-digit string backwards: ``"Reverse 4721"`` -> ``"1274"``. Reversal is
learned by attention alone (each answer digit copies one prompt digit, chosen by
position), so a model this small gets it right on strings it has never seen after a
few hundred steps on two CPU cores, and the answer is checkable character by
character. Everything is made here from a seed; nothing is downloaded.

Outputs, under ``outputs/demo/assets/`` by default (git-ignored):

- ``train.json`` / ``test.json``: instruct records ``{"input": ..., "output": ...}``
  with disjoint prompts, read by ``torchtune.datasets.instruct_dataset``.
- ``tokenizer.model``: a sentencepiece model trained on the records with the
  generator of the test assets (``tests/assets/make_assets.py``), so every digit is
  one token; loadable by ``torchtune.models.llama2.llama2_tokenizer``.
- ``tiny_llama2_hf/``: ``config.json`` + ``model.safetensors``, a seeded random
  init of ``torchtune.models.llama2.llama2`` with ``MODEL_KWARGS`` in Hugging Face
  format, loadable by ``FullModelHFCheckpointer(model_type="LLAMA2")``.

A stamp file records a hash of what the outputs depend on; a second call with the
same inputs returns at once.

Usage, from the repository root::

    python -m demo.make_demo_assets [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch, torchtune and sentencepiece are imported where they are used, so that a call
# that finds the assets up to date returns in well under a second.

DEFAULT_OUT = Path("outputs/demo/assets")
SEED = 1234
NUM_DIGITS = 4
# 10**NUM_DIGITS = 10000 strings exist; the two splits never share one.
NUM_TRAIN = 4800  # one epoch of 300 steps at batch size 16
NUM_TEST = 100
# 3 specials + 256 byte pieces + the characters and merges of the records; about
# as large as sentencepiece can make from this little text.
VOCAB_SIZE = 288
INIT_STD = 0.02

# Keyword arguments of ``torchtune.models.llama2.llama2``; the demo configs repeat them.
MODEL_KWARGS: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 64,
    "intermediate_dim": 128,
    "max_seq_len": 64,
    "norm_eps": 1e-5,
}

CHECKPOINT_SUBDIR = "tiny_llama2_hf"
_FILES = (
    "train.json",
    "test.json",
    "tokenizer.model",
    f"{CHECKPOINT_SUBDIR}/config.json",
    f"{CHECKPOINT_SUBDIR}/model.safetensors",
)


def make_records(
    seed: int = SEED, num_train: int = NUM_TRAIN, num_test: int = NUM_TEST
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Draw distinct digit strings and split them into train and test records.

    Args:
        seed (int): seed of the ``random.Random`` that draws the strings.
        num_train (int): number of training records.
        num_test (int): number of held-out records.

    Returns:
        tuple[list[dict[str, str]], list[dict[str, str]]]: train and test records,
        each ``{"input": "Reverse 4721", "output": "1274"}``.
    """
    strings = random.Random(seed).sample(range(10**NUM_DIGITS), num_train + num_test)
    records = [
        {"input": f"Reverse {s:0{NUM_DIGITS}d}", "output": f"{s:0{NUM_DIGITS}d}"[::-1]}
        for s in strings
    ]
    return records[:num_train], records[num_train:]


def build_model(seed: int = SEED) -> torch.nn.Module:
    """Build the tiny Llama2 with a seeded init that does not depend on torch's.

    Norm scales are ones; every other weight is drawn from ``N(0, INIT_STD**2)`` in
    sorted parameter-name order from one seeded generator.

    Args:
        seed (int): seed of the generator that draws the weights.

    Returns:
        torch.nn.Module: the ``TransformerDecoder``, in fp32 on CPU.
    """
    import torch

    from torchtune.models.llama2 import llama2

    model = llama2(**MODEL_KWARGS)
    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            if name.endswith("scale"):
                params[name].fill_(1.0)
            else:
                params[name].normal_(0.0, INIT_STD, generator=generator)
    return model


def write_hf_checkpoint(model: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Write ``model`` as a Hugging Face ``LlamaForCausalLM`` checkpoint.

    Args:
        model (torch.nn.Module): a model built by ``build_model``.
        checkpoint_dir (Path): folder for ``config.json`` and ``model.safetensors``.
    """
    from safetensors.torch import save_file

    from torchtune.models.convert_weights import tune_to_hf

    kw = MODEL_KWARGS
    state_dict = tune_to_hf(
        model.state_dict(),
        num_heads=kw["num_heads"],
        num_kv_heads=kw["num_kv_heads"],
        dim=kw["embed_dim"],
    )
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": kw["embed_dim"],
        "intermediate_size": kw["intermediate_dim"],
        "num_attention_heads": kw["num_heads"],
        "num_key_value_heads": kw["num_kv_heads"],
        "num_hidden_layers": kw["num_layers"],
        "max_position_embeddings": kw["max_seq_len"],
        "rms_norm_eps": kw["norm_eps"],
        "vocab_size": kw["vocab_size"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    (checkpoint_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(
        {k: v.contiguous() for k, v in state_dict.items()},
        str(checkpoint_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )


def _stamp_key(seed: int) -> str:
    digest = hashlib.sha256(f"seed={seed};".encode())
    for package in ("torch", "sentencepiece", "safetensors"):
        digest.update(f"{package}={metadata.version(package)};".encode())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()


def ensure_demo_assets(
    out: Path | str = DEFAULT_OUT, seed: int = SEED, *, force: bool = False
) -> Path:
    """Make the assets under ``out`` unless they are already there and current.

    Args:
        out (Path | str): output folder, created if missing.
        seed (int): seed of the records and of the model init.
        force (bool): make them even when the stamp matches. Default: False.

    Returns:
        Path: ``out``.
    """
    out = Path(out)
    stamp = out / "stamp.json"
    key = _stamp_key(seed)
    if (
        not force
        and stamp.is_file()
        and json.loads(stamp.read_text()).get("key") == key
        and all((out / name).is_file() for name in _FILES)
    ):
        return out
    out.mkdir(parents=True, exist_ok=True)
    # The stamp goes last: a generator killed halfway leaves none behind.
    stamp.unlink(missing_ok=True)

    from tests.assets.make_assets import train_tokenizer

    train, test = make_records(seed)
    for name, records in (("train.json", train), ("test.json", test)):
        (out / name).write_text(json.dumps(records, indent=1) + "\n")
    texts = [r[field] for r in train + test for field in ("input", "output")]
    train_tokenizer(texts, out / "tokenizer.model", vocab_size=VOCAB_SIZE)
    write_hf_checkpoint(build_model(seed), out / CHECKPOINT_SUBDIR)

    stamp.write_text(json.dumps({"key": key}) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: make the assets and say where they are."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="(default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=SEED, help="(default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="remake them anyway")
    args = parser.parse_args(argv)
    out = ensure_demo_assets(args.out, args.seed, force=args.force)
    print(f"Demo assets in {out}/: {', '.join(_FILES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
