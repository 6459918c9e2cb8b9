"""Make the tiny test assets: a tokenizer, instruct datasets and a Llama2 checkpoint.

Everything is made here from a seed and from ``corpus.txt`` (committed next to this
file); nothing is downloaded. The outputs go to ``tests/assets/generated/`` by default
(git-ignored):

- ``tokenizer.model``: a byte-fallback BPE sentencepiece model trained on the corpus
  and on the instruct texts, loadable by ``torchtune.models.llama2.llama2_tokenizer``.
- ``train.json`` / ``test.json``: instruct records ``{"input": ..., "output": ...}``
  for two synthetic tasks a tiny model learns quickly, small integer addition
  (``"What is 12 + 7?"`` -> ``"19"``) and word reversal
  (``"Reverse the word: lamp"`` -> ``"pmal"``). Use them with
  ``torchtune.datasets.instruct_dataset(source="json", data_files=..., split="train")``.
- ``tiny_llama2_hf/``: ``config.json`` + ``model.safetensors``, a seeded random init
  of ``torchtune.models.llama2.llama2`` with ``TINY_MODEL_KWARGS``, converted to
  Hugging Face keys with ``torchtune.models.convert_weights.tune_to_hf``, loadable by
  ``FullModelHFCheckpointer(model_type="LLAMA2")``.

Generation is idempotent: a stamp file records a hash of everything the outputs
depend on (this file, the corpus, the seed, the torch and sentencepiece versions), and
``ensure_assets`` returns at once when the stamp matches. A file lock makes concurrent
callers wait for one generator.

Usage::

    python tests/assets/make_assets.py [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ASSETS_DIR = Path(__file__).resolve().parent
CORPUS_PATH = ASSETS_DIR / "corpus.txt"
DEFAULT_OUT = ASSETS_DIR / "generated"

# Bump to force every existing ``generated/`` folder to be rebuilt.
ASSET_VERSION = 1
SEED = 20240601

TOKENIZER_FILE = "tokenizer.model"
TRAIN_FILE = "train.json"
TEST_FILE = "test.json"
CHECKPOINT_SUBDIR = "tiny_llama2_hf"
CHECKPOINT_FILE = "model.safetensors"
STAMP_FILE = "stamp.json"

# The sentencepiece vocabulary: 3 specials + 256 byte pieces + characters + merges.
VOCAB_SIZE = 512
NUM_TRAIN_EXAMPLES = 512
NUM_TEST_EXAMPLES = 64
# Addends are drawn from [0, MAX_ADDEND].
MAX_ADDEND = 49
INIT_STD = 0.02

# Keyword arguments of ``torchtune.models.llama2.llama2`` for the tiny model.
TINY_MODEL_KWARGS: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 64,
    "intermediate_dim": 128,
    "max_seq_len": 256,
    "norm_eps": 1e-5,
    "rope_base": 10000.0,
}

# Words for the reversal task, all of them written for this corpus.
_WORDS = (
    "lamp stone river cloud garden bridge boat bread apple pencil kite harbour "
    "market honey cheese violin cello flute forest pine snow tea hut map clock "
    "train ferry tide wave sand bee hive clover field bell oven loaf slice robot "
    "screw jar wind hill card ink shelf bird fox dog cat ball stick net pier moon "
    "sea soup van board chalk digit token word model sum number answer teacher"
).split()


@dataclass(frozen=True)
class TinyAssets:
    """Paths to a generated set of tiny assets.

    Attributes:
        root (Path): the folder that holds everything below.
        tokenizer_path (Path): the sentencepiece ``tokenizer.model``.
        train_data (Path): the training split, a JSON list of ``input``/``output``
            records.
        test_data (Path): the held-out split, same format, disjoint from training.
        checkpoint_dir (Path): the Hugging Face checkpoint folder (``config.json`` and
            ``model.safetensors``).
        checkpoint_files (tuple[str, ...]): the weight files inside ``checkpoint_dir``.
        model_kwargs (dict[str, Any]): keyword arguments of
            ``torchtune.models.llama2.llama2`` that build the matching model.
    """

    root: Path
    tokenizer_path: Path
    train_data: Path
    test_data: Path
    checkpoint_dir: Path
    checkpoint_files: tuple[str, ...]
    model_kwargs: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        """The vocabulary size shared by the tokenizer and the model."""
        return int(self.model_kwargs["vocab_size"])

    def paths(self) -> list[Path]:
        """Every file the generator writes (the stamp excluded)."""
        return [
            self.tokenizer_path,
            self.train_data,
            self.test_data,
            self.checkpoint_dir / "config.json",
            *(self.checkpoint_dir / name for name in self.checkpoint_files),
        ]


def asset_paths(out: Path | str = DEFAULT_OUT) -> TinyAssets:
    """Name the assets under ``out`` without generating anything.

    Args:
        out (Path | str): the output folder. Default: ``tests/assets/generated``.

    Returns:
        TinyAssets: the paths the generator writes under ``out``.
    """
    root = Path(out).resolve()
    return TinyAssets(
        root=root,
        tokenizer_path=root / TOKENIZER_FILE,
        train_data=root / TRAIN_FILE,
        test_data=root / TEST_FILE,
        checkpoint_dir=root / CHECKPOINT_SUBDIR,
        checkpoint_files=(CHECKPOINT_FILE,),
        model_kwargs=dict(TINY_MODEL_KWARGS),
    )


def make_instruct_examples(
    seed: int = SEED,
    num_train: int = NUM_TRAIN_EXAMPLES,
    num_test: int = NUM_TEST_EXAMPLES,
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Make the train and test records of the two synthetic tasks.

    Half the records ask for a sum of two integers in ``[0, MAX_ADDEND]``, half for a
    word spelled backwards. No prompt appears in both splits.

    Args:
        seed (int): seed of the ``random.Random`` that draws the records.
        num_train (int): number of training records.
        num_test (int): number of test records.

    Returns:
        tuple[list[dict[str, str]], list[dict[str, str]]]: the train and test records,
        each ``{"input": prompt, "output": answer}``.

    Raises:
        ValueError: if more distinct prompts are asked for than the tasks can make.
    """
    candidates = [
        (f"What is {a} + {b}?", str(a + b))
        for a in range(MAX_ADDEND + 1)
        for b in range(MAX_ADDEND + 1)
    ]
    reversals = [(f"Reverse the word: {w}", w[::-1]) for w in _WORDS]
    total = num_train + num_test
    num_reversals = min(len(reversals), total // 2)
    if total - num_reversals > len(candidates):
        raise ValueError(
            f"Asked for {total} distinct records but the tasks can make only "
            f"{len(candidates) + len(reversals)}; lower num_train/num_test."
        )
    rng = random.Random(seed)
    picked = rng.sample(candidates, total - num_reversals) + rng.sample(
        reversals, num_reversals
    )
    rng.shuffle(picked)
    records = [{"input": prompt, "output": answer} for prompt, answer in picked]
    return records[:num_train], records[num_train:]


def _write_json(path: Path, records: list[dict[str, str]]) -> None:
    path.write_text(json.dumps(records, indent=1, ensure_ascii=True) + "\n")


def train_tokenizer(texts: list[str], path: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """Train a byte-fallback BPE sentencepiece model and write it to ``path``.

    The ids follow Llama2's layout (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, no pad id),
    which is what ``Llama2Tokenizer`` expects. Digits are split so that numbers are
    spelled one digit per token, and whitespace is kept as is so that newlines
    round-trip. One thread and no sampling make the output byte-for-byte repeatable.

    Args:
        texts (list[str]): training sentences.
        path (Path): where to write the ``.model`` file.
        vocab_size (int): size of the vocabulary. Default: ``VOCAB_SIZE``.
    """
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())


def build_tiny_model(seed: int = SEED) -> Any:
    """Build the tiny Llama2 and give it a seeded, version-stable random init.

    Norm scales are ones; every other weight is drawn from ``N(0, INIT_STD**2)`` in
    sorted parameter-name order from one seeded generator, so the weights do not depend
    on the default initializers of the layers.

    Args:
        seed (int): seed of the generator that draws the weights.

    Returns:
        TransformerDecoder: the model, in fp32 on CPU.
    """
    import torch

    from torchtune.models.llama2 import llama2

    model = llama2(**TINY_MODEL_KWARGS)
    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            param = params[name]
            if name.endswith("scale"):
                param.fill_(1.0)
            else:
                param.copy_(
                    torch.normal(0.0, INIT_STD, param.shape, generator=generator)
                )
    return model


def hf_config(vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    """The Hugging Face ``config.json`` that describes the tiny model.

    Args:
        vocab_size (int): vocabulary size. Default: ``VOCAB_SIZE``.

    Returns:
        dict[str, Any]: a ``LlamaForCausalLM`` configuration.
    """
    kwargs = TINY_MODEL_KWARGS
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": kwargs["embed_dim"],
        "intermediate_size": kwargs["intermediate_dim"],
        "num_attention_heads": kwargs["num_heads"],
        "num_key_value_heads": kwargs["num_kv_heads"],
        "num_hidden_layers": kwargs["num_layers"],
        "max_position_embeddings": kwargs["max_seq_len"],
        "rms_norm_eps": kwargs["norm_eps"],
        "rope_theta": kwargs["rope_base"],
        "vocab_size": vocab_size,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def write_hf_checkpoint(model: Any, checkpoint_dir: Path) -> None:
    """Write ``model`` as a Hugging Face Llama checkpoint into ``checkpoint_dir``.

    Args:
        model (TransformerDecoder): a model built with ``TINY_MODEL_KWARGS``.
        checkpoint_dir (Path): the folder to write ``config.json`` and
            ``model.safetensors`` into; created if missing.
    """
    from safetensors.torch import save_file

    from torchtune.models.convert_weights import tune_to_hf

    kwargs = TINY_MODEL_KWARGS
    hf_state_dict = tune_to_hf(
        model.state_dict(),
        num_heads=kwargs["num_heads"],
        num_kv_heads=kwargs["num_kv_heads"],
        dim=kwargs["embed_dim"],
    )
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    (checkpoint_dir / "config.json").write_text(
        json.dumps(hf_config(kwargs["vocab_size"]), indent=2, sort_keys=True) + "\n"
    )
    save_file(
        {key: value.detach().contiguous() for key, value in hf_state_dict.items()},
        str(checkpoint_dir / CHECKPOINT_FILE),
        metadata={"format": "pt"},
    )


def _stamp_key(seed: int) -> str:
    """Hash everything the generated files depend on."""
    digest = hashlib.sha256()
    digest.update(f"version={ASSET_VERSION};seed={seed};".encode())
    for package in ("torch", "sentencepiece", "safetensors"):
        digest.update(f"{package}={metadata.version(package)};".encode())
    digest.update(Path(__file__).resolve().read_bytes())
    digest.update(CORPUS_PATH.read_bytes())
    return digest.hexdigest()


def _is_current(root: Path, paths: list[Path], key: str) -> bool:
    stamp = root / STAMP_FILE
    if not stamp.is_file() or not all(path.is_file() for path in paths):
        return False
    try:
        return json.loads(stamp.read_text()).get("key") == key
    except (OSError, json.JSONDecodeError):
        return False


def generate_once(
    root: Path,
    paths: list[Path],
    key: str,
    generate: Callable[[], object],
    *,
    force: bool = False,
) -> None:
    """Call ``generate`` unless every one of ``paths`` is there and ``root``'s stamp
    holds ``key`` (the generator writes the stamp last), under a lock on ``root``, so
    that concurrent sessions wait for one generator."""
    from filelock import FileLock

    if not force and _is_current(root, paths, key):
        return
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".lock")):
        # Another process may have finished the job while this one waited.
        if force or not _is_current(root, paths, key):
            generate()


def asset_cli(
    doc: str, default_out: Path, *, seed: int | None = None
) -> argparse.ArgumentParser:
    """The command line of an asset generator: ``--out`` (and ``--seed``,
    ``--force`` for seeded ones)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out,
        help="output folder (default: %(default)s)",
    )
    if seed is not None:
        parser.add_argument(
            "--seed", type=int, default=seed, help="(default: %(default)s)"
        )
        parser.add_argument(
            "--force", action="store_true", help="regenerate even if up to date"
        )
    return parser


def generate(out: Path | str = DEFAULT_OUT, seed: int = SEED) -> TinyAssets:
    """Write every asset under ``out``, overwriting what is there.

    Prefer ``ensure_assets``, which skips the work when ``out`` is up to date and
    locks against concurrent generators.

    Args:
        out (Path | str): the output folder, created if missing.
        seed (int): seed of the datasets and of the model init.

    Returns:
        TinyAssets: the paths of what was written.
    """
    assets = asset_paths(out)
    assets.root.mkdir(parents=True, exist_ok=True)
    stamp = assets.root / STAMP_FILE
    # The stamp goes last: a generator killed halfway leaves no stamp behind.
    stamp.unlink(missing_ok=True)

    train, test = make_instruct_examples(seed)
    _write_json(assets.train_data, train)
    _write_json(assets.test_data, test)

    corpus = CORPUS_PATH.read_text().splitlines()
    instruct_texts = [r[field] for r in train + test for field in ("input", "output")]
    train_tokenizer(corpus + instruct_texts, assets.tokenizer_path)

    write_hf_checkpoint(build_tiny_model(seed), assets.checkpoint_dir)

    stamp.write_text(json.dumps({"key": _stamp_key(seed)}) + "\n")
    return assets


def ensure_assets(
    out: Path | str = DEFAULT_OUT, seed: int = SEED, *, force: bool = False
) -> TinyAssets:
    """Return the assets under ``out``, generating them if missing or out of date.

    Args:
        out (Path | str): the output folder. Default: ``tests/assets/generated``.
        seed (int): seed of the datasets and of the model init.
        force (bool): regenerate even when the stamp matches. Default: False.

    Returns:
        TinyAssets: the paths of the assets.
    """
    assets = asset_paths(out)
    generate_once(
        assets.root,
        assets.paths(),
        _stamp_key(seed),
        lambda: generate(assets.root, seed),
        force=force,
    )
    return assets


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: make the assets and print where they are."""
    args = asset_cli(__doc__, DEFAULT_OUT, seed=SEED).parse_args(argv)
    assets = ensure_assets(args.out, args.seed, force=args.force)
    for path in assets.paths():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
