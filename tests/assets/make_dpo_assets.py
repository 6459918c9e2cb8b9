"""Make a tiny preference dataset for the DPO recipe tests.

Each record is a pair of conversations with the same user prompt and two assistant
answers, the right one (``chosen``) and a wrong one (``rejected``), in the format
``torchtune.datasets.preference_dataset(source="json", data_files=...)`` reads::

    {"chosen": [{"role": "user", "content": "What is 12 + 7?"},
                {"role": "assistant", "content": "19"}],
     "rejected": [{"role": "user", "content": "What is 12 + 7?"},
                  {"role": "assistant", "content": "21"}]}

The prompts are those of the instruct tasks of ``make_assets.py`` (small integer
addition and word reversal), so the tiny tokenizer and the tiny Llama2 checkpoint made
there fit them; the reference model of a DPO test is that same checkpoint. A wrong
sum is off by a nonzero amount drawn from a seeded generator; a wrong reversal is the
word as it was given. Nothing is downloaded, and the same seed writes the same bytes.

Usage::

    python -m tests.assets.make_dpo_assets [--out DIR]
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

from tests.assets.make_assets import DEFAULT_OUT, asset_cli, make_instruct_examples

PREFERENCE_FILE = "preference_train.json"
SEED = 20240611
# Enough pairs for an epoch of a few global batches of 8, and for one step of the
# shipped config's 4 x 8 = 32 pairs.
NUM_PAIRS = 64
# A wrong sum is off by one of these.
_SUM_ERRORS = (-3, -2, -1, 1, 2, 3)
_ADDITION = re.compile(r"^What is (\d+) \+ (\d+)\?$")
_REVERSAL = re.compile(r"^Reverse the word: (\w+)$")


def wrong_answer(prompt: str, answer: str, rng: random.Random) -> str:
    """A plausible but wrong answer to one of the instruct prompts.

    Args:
        prompt (str): an addition (``"What is 3 + 4?"``) or reversal
            (``"Reverse the word: lamp"``) prompt.
        answer (str): its right answer.
        rng (random.Random): draws how far off a wrong sum is.

    Returns:
        str: an answer different from ``answer``.

    Raises:
        ValueError: if the prompt is of neither task.
    """
    if _ADDITION.match(prompt):
        error = rng.choice(_SUM_ERRORS)
        # A sum of naturals is never negative: err upwards instead.
        return str(int(answer) + (abs(error) if int(answer) + error < 0 else error))
    match = _REVERSAL.match(prompt)
    if match:
        word = match.group(1)
        # A palindrome would make both answers the same: double its last letter.
        return word if word != answer else word + word[-1]
    raise ValueError(f"Not a prompt of the instruct tasks: {prompt!r}")


def make_preference_records(
    seed: int = SEED, num_pairs: int = NUM_PAIRS
) -> list[dict[str, list[dict[str, str]]]]:
    """The preference pairs, one per instruct training record (in its order).

    Args:
        seed (int): seed of the instruct records and of the wrong answers.
        num_pairs (int): number of pairs.

    Returns:
        list[dict[str, list[dict[str, str]]]]: ``{"chosen": ..., "rejected": ...}``
        records, each a user message and an assistant message.
    """
    records, _ = make_instruct_examples(seed, num_train=num_pairs, num_test=0)
    rng = random.Random(seed)
    pairs = []
    for record in records:
        prompt, answer = record["input"], record["output"]
        user = {"role": "user", "content": prompt}
        pairs.append(
            {
                "chosen": [user, {"role": "assistant", "content": answer}],
                "rejected": [
                    dict(user),
                    {
                        "role": "assistant",
                        "content": wrong_answer(prompt, answer, rng),
                    },
                ],
            }
        )
    return pairs


def write_preference_data(
    out: Path | str = DEFAULT_OUT, seed: int = SEED, num_pairs: int = NUM_PAIRS
) -> Path:
    """Write the preference pairs as JSON into ``out`` (created if missing).

    Args:
        out (Path | str): the output folder. Default: ``tests/assets/generated``.
        seed (int): see :func:`make_preference_records`.
        num_pairs (int): see :func:`make_preference_records`.

    Returns:
        Path: the JSON file, for ``preference_dataset``'s ``data_files``.
    """
    path = Path(out).resolve() / PREFERENCE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(make_preference_records(seed, num_pairs), indent=1) + "\n"
    # Written whole and renamed, so a concurrent reader never sees half a file.
    partial = path.with_suffix(".json.partial")
    partial.write_text(text)
    partial.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: write the pairs and print where they are."""
    args = asset_cli(__doc__, DEFAULT_OUT).parse_args(argv)
    print(write_preference_data(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
