"""Tests for the generated tiny assets (``tests/assets/make_assets.py``)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.assets import make_assets
from tests.assets.make_assets import TinyAssets
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX
from torchtune.datasets import instruct_dataset
from torchtune.models.llama2 import llama2, llama2_tokenizer
from torchtune.training import FullModelHFCheckpointer


def _records(path: Path) -> list[dict[str, str]]:
    return json.loads(path.read_text())


def _expected_answer(prompt: str) -> str:
    if prompt.startswith("What is "):
        a, b = prompt.removeprefix("What is ").removesuffix("?").split(" + ")
        return str(int(a) + int(b))
    return prompt.removeprefix("Reverse the word: ")[::-1]


def test_instruct_examples_are_seeded_disjoint_and_correct() -> None:
    train, test = make_assets.make_instruct_examples(seed=3)
    assert (train, test) == make_assets.make_instruct_examples(seed=3)
    assert (train, test) != make_assets.make_instruct_examples(seed=4)
    assert len(train) == make_assets.NUM_TRAIN_EXAMPLES
    assert len(test) == make_assets.NUM_TEST_EXAMPLES
    assert not {r["input"] for r in train} & {r["input"] for r in test}
    for record in train + test:
        assert record["output"] == _expected_answer(record["input"])
    kinds = {r["input"].split()[0] for r in train}
    assert kinds == {"What", "Reverse"}


def test_instruct_examples_refuse_more_records_than_the_tasks_make() -> None:
    with pytest.raises(ValueError, match="distinct records"):
        make_assets.make_instruct_examples(num_train=10_000, num_test=0)


def test_generate_is_byte_identical_for_the_same_seed(
    tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    fresh = make_assets.generate(tmp_path / "fresh")
    for ours, theirs in zip(tiny_assets.paths(), fresh.paths(), strict=True):
        assert ours.name == theirs.name
        assert ours.read_bytes() == theirs.read_bytes(), f"{ours.name} differs"


def test_ensure_assets_reuses_current_outputs_and_rebuilds_stale_ones(
    tmp_path: Path,
) -> None:
    out = tmp_path / "assets"
    first = make_assets.ensure_assets(out)
    mtimes = {p: p.stat().st_mtime_ns for p in first.paths()}
    again = make_assets.ensure_assets(out)
    assert {p: p.stat().st_mtime_ns for p in again.paths()} == mtimes

    # A stale stamp (another generator version) makes every file be written again.
    (out / make_assets.STAMP_FILE).write_text(json.dumps({"key": "stale"}))
    past = 1_000_000_000
    for path in first.paths():
        os.utime(path, ns=(past, past))
    make_assets.ensure_assets(out)
    assert all(p.stat().st_mtime_ns != past for p in first.paths())


def test_tokenizer_round_trips_the_dataset_text(tiny_assets: TinyAssets) -> None:
    tokenizer = llama2_tokenizer(str(tiny_assets.tokenizer_path), prompt_template=None)
    assert tokenizer.vocab_size == tiny_assets.vocab_size
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    records = _records(tiny_assets.train_data) + _records(tiny_assets.test_data)
    for record in records:
        for text in (record["input"], record["output"]):
            ids = tokenizer.encode(text, add_bos=False, add_eos=False)
            assert 0 not in ids, f"unknown piece in {text!r}"
            assert tokenizer.decode(ids) == text
    # Digits are single tokens, so an answer is spelled digit by digit.
    assert len(tokenizer.encode("1234", add_bos=False, add_eos=False)) == 5


def test_tokenizer_keeps_newlines_and_unseen_characters(
    tiny_assets: TinyAssets,
) -> None:
    tokenizer = llama2_tokenizer(str(tiny_assets.tokenizer_path))
    text = "Line one\nline two: [INST] ~ 42 ✓"
    ids = tokenizer.encode(text, add_bos=False, add_eos=False)
    assert tokenizer.decode(ids) == text


def test_instruct_dataset_reads_the_json_offline_and_masks_the_prompt(
    tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    tokenizer = llama2_tokenizer(
        str(tiny_assets.tokenizer_path), max_seq_len=128, prompt_template=None
    )
    dataset = instruct_dataset(
        tokenizer,
        source="json",
        data_files=str(tiny_assets.train_data),
        split="train",
        cache_dir=str(tmp_path / "hf_cache"),
    )
    records = _records(tiny_assets.train_data)
    assert len(dataset) == len(records)
    sample = dataset[0]
    tokens, labels = sample["tokens"], sample["labels"]
    assert tokens[0] == tokenizer.bos_id and tokens[-1] == tokenizer.eos_id
    answer = [t for t, label in zip(tokens, labels, strict=True) if label != -100]
    assert CROSS_ENTROPY_IGNORE_IDX == -100
    assert tokenizer.decode(answer[:-1]).strip() == records[0]["output"]


def test_hf_checkpoint_loads_into_the_tiny_llama2_with_the_generated_weights(
    tiny_assets: TinyAssets, tmp_path: Path
) -> None:
    config = json.loads((tiny_assets.checkpoint_dir / "config.json").read_text())
    kwargs = tiny_assets.model_kwargs
    assert config["hidden_size"] == kwargs["embed_dim"]
    assert config["num_attention_heads"] == kwargs["num_heads"]
    assert config["num_key_value_heads"] == kwargs["num_kv_heads"]
    assert config["num_hidden_layers"] == kwargs["num_layers"]
    assert config["vocab_size"] == kwargs["vocab_size"]

    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(tiny_assets.checkpoint_dir),
        checkpoint_files=list(tiny_assets.checkpoint_files),
        model_type="LLAMA2",
        output_dir=str(tmp_path / "out"),
    )
    state_dict = checkpointer.load_checkpoint()["model"]
    model = llama2(**kwargs)
    model.load_state_dict(state_dict, strict=True)

    expected = make_assets.build_tiny_model().state_dict()
    loaded = model.state_dict()
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key


def test_tiny_model_starts_near_the_uniform_loss(tiny_assets: TinyAssets) -> None:
    model = make_assets.build_tiny_model()
    tokens = torch.randint(
        3, tiny_assets.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, tiny_assets.vocab_size), tokens[:, 1:].reshape(-1)
    )
    assert abs(loss.item() - math.log(tiny_assets.vocab_size)) < 0.1
