"""How much the recipes repeat each other: code lines per recipe, and the share of
them that sit in a run of ``--window`` consecutive code lines (default 5) which also
appears, to the letter after stripping indentation, in another recipe.

Code lines leave out blank lines, comments, docstrings and import statements, so
the figures measure logic, not prose. Run from the repository root::

    python scripts/recipe_metrics.py            # this tree's recipes/
    python scripts/recipe_metrics.py DIR ...    # any folders of recipes
"""

import argparse
import ast
import io
import tokenize
from collections import defaultdict
from pathlib import Path


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped text) of each code line of ``path``."""
    source = path.read_text()
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            skipped.update(range(node.lineno, node.end_lineno + 1))
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            skipped.update(range(body[0].lineno, body[0].end_lineno + 1))
    has_code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (
            tokenize.COMMENT,
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            has_code.update(range(tok.start[0], tok.end[0] + 1))
    lines = source.splitlines()
    return [
        (n, lines[n - 1].strip()) for n in sorted(has_code - skipped) if n <= len(lines)
    ]


def measure(
    files: list[Path],
    window: int,
    same_step: list[tuple[str, str]] = (),
) -> dict[Path, tuple[int, int]]:
    """{file: (code lines, code lines in a run repeated in another file)}.

    A run shared only with a file of a ``same_step`` pair (two recipes that keep
    the same step on purpose) does not count as repeated."""
    exempt = {frozenset(pair) for pair in same_step}
    per_file = {f: code_lines(f) for f in files}
    owners: dict[tuple[str, ...], set[Path]] = defaultdict(set)
    for f, lines in per_file.items():
        texts = [t for _, t in lines]
        for i in range(len(texts) - window + 1):
            owners[tuple(texts[i : i + window])].add(f)
    result = {}
    for f, lines in per_file.items():
        texts = [t for _, t in lines]
        repeated = set()
        for i in range(len(texts) - window + 1):
            others = owners[tuple(texts[i : i + window])] - {f}
            if any(frozenset((f.stem, o.stem)) not in exempt for o in others):
                repeated.update(range(i, i + window))
        result[f] = (len(texts), len(repeated))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="*", default=["recipes"])
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument(
        "--same-step",
        action="append",
        default=[],
        metavar="A,B",
        help="two recipes (file stems) whose shared lines do not count",
    )
    args = parser.parse_args()
    files = sorted(
        p for d in args.dirs for p in Path(d).rglob("*.py") if p.name != "__init__.py"
    )
    same_step = [tuple(pair.split(",")) for pair in args.same_step]
    result = measure(files, args.window, same_step)
    total = repeated = 0
    for f, (n, r) in result.items():
        total += n
        repeated += r
        print(f"{str(f):60s} {n:5d} code lines, {r / max(n, 1):4.0%} repeated")
    print(
        f"{'all':60s} {total:5d} code lines, {repeated / max(total, 1):4.0%} repeated"
    )


if __name__ == "__main__":
    main()
