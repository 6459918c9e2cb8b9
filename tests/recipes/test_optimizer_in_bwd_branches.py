"""``optimizer_in_bwd`` changes a recipe's behaviour only where it must.

In every recipe the flag (``self._optimizer_in_bwd``, stored once in ``__init__``
from :class:`~torchtune.training.RecipeOptions`) is passed to
``training.build_optimizer`` in ``_setup_optimizer`` and tested by exactly two
``if`` statements of the training step: one chooses how to backpropagate (the
in-backward optimizer normalizes and updates inside backward), one where the
gradient norm comes from (the optimizer measured it, or ``scale_and_clip_grads_``
measures and clips). Neither steps, zeroes, schedules, logs or saves anything:
those treat both modes alike. Nothing else reads the flag.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").rglob("*.py"))
FLAG = "_optimizer_in_bwd"
# What both modes do the same way, so no branch on the flag may call it.
SHARED = {"step", "zero_grad", "save", "log", "get_lr", "log_dict", "instantiate"}


def _flag_reads(tree: ast.AST) -> list[ast.Attribute]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in {FLAG, FLAG.lstrip("_")}
        and isinstance(node.ctx, ast.Load)
    ]


def _calls(node: ast.AST) -> set[str]:
    return {
        getattr(call.func, "attr", getattr(call.func, "id", None))
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
    }


def check(source: str) -> list[str]:
    """What ``source`` does with the flag that the rule above does not allow."""
    tree = ast.parse(source)
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}

    def enclosing(node: ast.AST, kind: type) -> ast.AST | None:
        while node in parents and not isinstance(node, kind):
            node = parents[node]
        return node if isinstance(node, kind) else None

    problems, branches = [], []
    for read in _flag_reads(tree):
        function = enclosing(read, ast.FunctionDef)
        name = function.name if function else "<module>"
        test = read
        if isinstance(parents[test], ast.UnaryOp) and isinstance(
            parents[test].op, ast.Not
        ):
            test = parents[test]
        statement = parents[test]
        if name == "__init__" and isinstance(statement, ast.Assign):
            continue  # storing it
        if name == "_setup_optimizer" and isinstance(statement, ast.keyword):
            continue  # build_optimizer(..., in_backward=flag)
        if isinstance(statement, ast.If) and statement.test is test:
            branches.append(statement)
            shared = _calls(statement) & SHARED
            if shared:
                problems.append(f"line {read.lineno}: a branch calls {sorted(shared)}")
            continue
        problems.append(f"line {read.lineno} in {name}: read outside the rule")
    kinds = sorted(
        "backward"
        if "backward" in _calls(b)
        else "grad_norm"
        if "scale_and_clip_grads_" in _calls(b)
        else "other"
        for b in branches
    )
    if kinds != ["backward", "grad_norm"]:
        problems.append(f"branches on the flag: {kinds}, not one of each")
    # Nor is the mode told from the optimizer (isinstance) outside its construction.
    for node in ast.walk(tree):
        name = getattr(node, "attr", getattr(node, "id", None))
        if name in {"OptimizerInBackward", "build_optimizer"}:
            function = enclosing(node, ast.FunctionDef)
            if function is None or function.name != "_setup_optimizer":
                problems.append(f"line {node.lineno}: {name} outside _setup_optimizer")
    return problems


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_branches_on_optimizer_in_bwd_only_in_its_two_places(
    recipe: Path,
) -> None:
    problems = check(recipe.read_text())
    assert not problems, f"{recipe.name}:\n" + "\n".join(problems)


def test_the_rule_refuses_a_branch_that_steps_and_a_mode_told_from_the_optimizer():
    recipe = (REPO / "recipes" / "full_finetune_single_device.py").read_text()
    step = "                self._optimizer.step()\n"
    assert step in recipe
    stepping = recipe.replace(
        step, "                if not self._optimizer_in_bwd:\n    " + step
    )
    assert [p.split(": ", 1)[1] for p in check(stepping)] == [
        "a branch calls ['step']",
        "['backward', 'grad_norm', 'other'], not one of each",
    ]
    sniffing = recipe.replace(
        step,
        "                if isinstance(self._optimizer, training.OptimizerInBackward):"
        "\n    " + step,
    )
    assert [p.split(": ", 1)[1] for p in check(sniffing)] == [
        "OptimizerInBackward outside _setup_optimizer"
    ]


def test_no_installed_recipe_calls_the_deprecated_0_6_1_functions() -> None:
    # Every recipe torchtune ships, ours and upstream's, as installed: the 0.6.1
    # functions stay only for users' own recipes.
    import torchtune

    installed = Path(torchtune.__file__).resolve().parent.parent / "recipes"
    deprecated = ("create_optim_in_bwd_wrapper", "register_optim_in_bwd_hooks")
    callers = sorted(
        str(path.relative_to(installed))
        for path in installed.rglob("*.py")
        if any(name in path.read_text() for name in deprecated)
    )
    assert callers == [], f"recipes still calling {deprecated}: {callers}"
