"""``optimizer_in_bwd`` may change a recipe's behaviour only where it must.

The rule: the flag, whether the config key or any variable or attribute holding it,
is read only

1. to store it, in ``__init__`` (``self._optimizer_in_bwd = cfg.get(...)``);
2. in config validation: the test or body of an ``if`` whose body only raises or
   calls ``training.check_optimizer_in_bwd_options`` (nested such ``if``
   statements included);
3. in optimizer construction: anywhere in ``_setup_optimizer``, or as an argument
   of a call to it;
4. where loss normalization or clipping differ: the test of an ``if`` statement, or
   of a conditional expression, whose statement backpropagates, scales, clips or
   measures gradients (``backward``, ``scale_grads``, ``scale_and_clip_grads_``,
   ``clip_grad_norm_``, ``clip_grads_with_norm_``, ``get_total_norm``,
   ``.grad_norm``) or multiplies or divides by a token count (a name containing
   ``token``).

A statement branching on the flag (rules 3 and 4) must not step, zero, schedule,
log, checkpoint or build anything (see ``_FORBIDDEN_CALLS``): those treat both modes
alike. ``OptimizerInBackward`` itself (or ``training.build_optimizer``, which builds
either kind) may only be named in ``_setup_optimizer``.
Aliases are followed: a name or attribute assigned from the flag is the flag.
"""

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Every recipe of this tree: each one that offers optimizer_in_bwd follows the rule.
RECIPES = sorted(
    str(path.relative_to(REPO)) for path in (REPO / "recipes").rglob("*.py")
)

FLAG_NAMES = frozenset({"optimizer_in_bwd", "_optimizer_in_bwd"})
CONSTRUCTOR = "_setup_optimizer"
VALIDATOR = "check_optimizer_in_bwd_options"
OPTIMIZER_CLASS = "OptimizerInBackward"
# ``training.build_optimizer(..., in_backward=flag)`` builds either kind: it counts as
# naming the class.
OPTIMIZER_BUILDERS = frozenset({OPTIMIZER_CLASS, "build_optimizer"})
_NORMALIZATION_CALLS = frozenset(
    {
        "backward",
        "scale_grads",
        "scale_and_clip_grads_",
        "clip_grad_norm_",
        "clip_grads_with_norm_",
        "get_total_norm",
    }
)
# What both modes must do the same way: optimizer stepping, scheduling, logging,
# checkpointing, building components.
_FORBIDDEN_CALLS = frozenset(
    {
        "step",
        "optimizer_step",
        "zero_grad",
        "get_lr",
        "state_dict",
        "load_state_dict",
        "save_checkpoint",
        "load_checkpoint",
        "get_memory_stats",
        "log_memory_stats",
        "log_dict",
        "instantiate",
    }
)


@dataclass(frozen=True)
class Violation:
    line: int
    function: str
    reason: str


@dataclass(frozen=True)
class Read:
    line: int
    function: str
    rule: str


def _identifier(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _call_name(node: ast.Call) -> str | None:
    return _identifier(node.func)


class _Checker:
    def __init__(self, source: str) -> None:
        self.tree = ast.parse(source)
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self.flags = set(FLAG_NAMES)
        self._follow_aliases()

    # -- what counts as the flag -----------------------------------------------------
    def _is_flag_expr(self, node: ast.AST) -> bool:
        """The flag itself: a name, attribute, ``cfg.get(key)``, ``cfg[key]``, not."""
        if _identifier(node) in self.flags:
            return True
        if isinstance(node, ast.Constant):
            return node.value in self.flags
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return self._is_flag_expr(node.operand)
        if isinstance(node, ast.Subscript):
            return self._is_flag_expr(node.slice)
        if isinstance(node, ast.Call) and _call_name(node) in {"get", "bool"}:
            return bool(node.args) and self._is_flag_expr(node.args[0])
        return False

    def _follow_aliases(self) -> None:
        changed = True
        while changed:
            changed = False
            for node in ast.walk(self.tree):
                if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr):
                    targets = (
                        node.targets if isinstance(node, ast.Assign) else [node.target]
                    )
                    if node.value is not None and self._is_flag_expr(node.value):
                        for target in targets:
                            name = _identifier(target)
                            if name and name not in self.flags:
                                self.flags.add(name)
                                changed = True

    def _is_read(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name | ast.Attribute):
            return isinstance(node.ctx, ast.Load) and _identifier(node) in self.flags
        return isinstance(node, ast.Constant) and node.value in self.flags

    # -- where a node is ---------------------------------------------------------------
    def _ancestors(self, node: ast.AST):
        while node in self.parent:
            node = self.parent[node]
            yield node

    def _function(self, node: ast.AST) -> str:
        for anc in self._ancestors(node):
            if isinstance(anc, ast.FunctionDef | ast.AsyncFunctionDef):
                return anc.name
        return "<module>"

    def _statement(self, node: ast.AST) -> ast.stmt:
        for anc in self._ancestors(node):
            if isinstance(anc, ast.stmt):
                return anc
        raise AssertionError("every expression is inside a statement")

    def _inside(self, node: ast.AST, root: ast.AST) -> bool:
        return node is root or any(anc is root for anc in self._ancestors(node))

    # -- regions -------------------------------------------------------------------------
    @staticmethod
    def _forbidden(
        region: ast.AST, allowed: frozenset[str] = frozenset()
    ) -> str | None:
        for node in ast.walk(region):
            name = _call_name(node) if isinstance(node, ast.Call) else None
            if name in _FORBIDDEN_CALLS - allowed:
                return f"calls {name}()"
            name = _identifier(node)
            if name and "scheduler" in name:
                return f"touches {name}"
        return None

    @staticmethod
    def _normalizes(region: ast.AST) -> bool:
        for node in ast.walk(region):
            if isinstance(node, ast.Call) and _call_name(node) in _NORMALIZATION_CALLS:
                return True
            if isinstance(node, ast.Attribute) and node.attr == "grad_norm":
                return True
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult | ast.Div):
                for operand in ast.walk(node):
                    name = _identifier(operand)
                    if name and "token" in name:
                        return True
        return False

    def _validation_only(self, stmts: list[ast.stmt]) -> bool:
        return bool(stmts) and all(
            isinstance(s, ast.Raise)
            or (
                isinstance(s, ast.Expr)
                and isinstance(s.value, ast.Call)
                and _identifier(s.value.func) == VALIDATOR
            )
            or (
                isinstance(s, ast.If)
                and self._validation_only(s.body)
                and (not s.orelse or self._validation_only(s.orelse))
            )
            for s in stmts
        )

    def _branch_region(self, read: ast.AST) -> ast.stmt | None:
        """The statement that branches on ``read``: an ``if`` or a conditional."""
        stmt = self._statement(read)
        if isinstance(stmt, ast.If) and self._inside(read, stmt.test):
            return stmt
        for anc in self._ancestors(read):
            if anc is stmt:
                return None
            if isinstance(anc, ast.IfExp) and self._inside(read, anc.test):
                return stmt
        return None

    # -- the rule --------------------------------------------------------------------
    def classify(self, read: ast.AST) -> str | Violation:
        function = self._function(read)
        line = read.lineno

        def violation(reason: str) -> Violation:
            return Violation(line, function, reason)

        stmt = self._statement(read)
        # 1. storing it
        if (
            function == "__init__"
            and isinstance(stmt, ast.Assign | ast.AnnAssign)
            and self._is_flag_expr(stmt.value)
            and all(
                _identifier(t) in self.flags
                for t in (
                    stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                )
            )
        ):
            return "store"
        # 2. validation
        for anc in self._ancestors(read):
            if isinstance(anc, ast.If) and self._validation_only(anc.body):
                if not anc.orelse or self._validation_only(anc.orelse):
                    return "validation"
        region = self._branch_region(read)
        # 3. construction: building the optimizer is what its branch is for
        if function == CONSTRUCTOR or any(
            isinstance(anc, ast.Call) and _call_name(anc) == CONSTRUCTOR
            for anc in self._ancestors(read)
        ):
            bad = region and self._forbidden(region, allowed=frozenset({"instantiate"}))
            if bad:
                return violation(f"a construction branch on the flag {bad}")
            return "construction"
        # 4. loss normalization and clipping
        bad = region and self._forbidden(region)
        if region is None:
            return violation("read outside any branch on the flag")
        if bad:
            return violation(f"a branch on the flag {bad}")
        if not self._normalizes(region):
            return violation("a branch on the flag that neither normalizes nor clips")
        return "normalization/clipping"

    def reads(self) -> list[ast.AST]:
        return [node for node in ast.walk(self.tree) if self._is_read(node)]

    def optimizer_class_uses(self) -> list[ast.AST]:
        return [
            node
            for node in ast.walk(self.tree)
            if isinstance(node, ast.Name | ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and _identifier(node) in OPTIMIZER_BUILDERS
        ]


def find_violations(source: str) -> list[Violation]:
    """Every place ``source`` lets the optimizer mode change behaviour it should not."""
    checker = _Checker(source)
    found = [
        v for r in checker.reads() if isinstance(v := checker.classify(r), Violation)
    ]
    for use in checker.optimizer_class_uses():
        function = checker._function(use)
        if function != CONSTRUCTOR:
            found.append(
                Violation(
                    use.lineno,
                    function,
                    f"names {_identifier(use)} outside {CONSTRUCTOR}",
                )
            )
    return sorted(set(found), key=lambda v: v.line)


def allowed_reads(source: str) -> list[Read]:
    """Every allowed read of the flag, with the rule that allows it."""
    checker = _Checker(source)
    return [
        Read(r.lineno, checker._function(r), rule)
        for r in checker.reads()
        if isinstance(rule := checker.classify(r), str)
    ]


def _format(violations: list[Violation]) -> str:
    return "\n".join(f"  line {v.line} in {v.function}: {v.reason}" for v in violations)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_reads_optimizer_in_bwd_only_where_modes_must_differ(
    recipe: str,
) -> None:
    path = REPO / recipe
    if not path.exists():
        pytest.skip(f"{recipe} is not in the repository yet")
    source = path.read_text()
    violations = find_violations(source)
    assert not violations, (
        f"{recipe} branches on optimizer_in_bwd where it may not:\n"
        + _format(violations)
    )
    # The optimizer is built in one place, and that place can build either kind.
    checker = _Checker(source)
    uses = checker.optimizer_class_uses()
    assert uses and all(checker._function(u) == CONSTRUCTOR for u in uses)


# A recipe shaped as the rule asks: it must pass.
GOOD = """
class Recipe:
    def __init__(self, cfg):
        self._optimizer_in_bwd = cfg.get("optimizer_in_bwd", False)
        self._clip = cfg.clip_grad_norm
        if self._optimizer_in_bwd:
            if self._clip is not None:
                raise ValueError("no clipping")
            if cfg.gradient_accumulation_steps > 1:
                raise ValueError("no accumulation")

    def setup(self, cfg):
        self._optimizer = self._setup_optimizer(cfg.optimizer, cfg.optimizer_in_bwd)

    def _setup_optimizer(self, cfg_optimizer, optimizer_in_bwd):
        make = partial(config.instantiate, cfg_optimizer)
        params = list(self._model.parameters())
        if optimizer_in_bwd:
            optimizer = training.OptimizerInBackward(params, make)
        else:
            optimizer = make(params)
        return optimizer

    def train(self):
        for batch in self._dataloader:
            loss, tokens = self._loss_step(batch)
            loss = loss if self._optimizer_in_bwd else loss * tokens
            loss.backward()
            if self._optimizer_in_bwd:
                grad_norm = self._optimizer.grad_norm
            else:
                training.scale_grads(self._model, 1 / tokens)
                grad_norm = clip_grad_norm_(self._model.parameters(), 1.0)
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
            self._lr_scheduler.step()
"""


def test_rule_accepts_a_recipe_that_branches_only_to_validate_build_and_normalize() -> (
    None
):
    assert find_violations(GOOD) == []
    rules = sorted(r.rule for r in allowed_reads(GOOD))
    assert rules == [
        "construction",
        "construction",
        "normalization/clipping",
        "normalization/clipping",
        "store",
        "validation",
    ]


def _method(body: str, name: str = "train", init: str = "") -> str:
    """A recipe class storing the flag, with one more method holding ``body``."""
    indented = textwrap.indent(textwrap.dedent(body).strip(), " " * 8)
    init = textwrap.indent(textwrap.dedent(init).strip(), " " * 8)
    return (
        "class Recipe:\n"
        "    def __init__(self, cfg):\n"
        '        self._optimizer_in_bwd = cfg.get("optimizer_in_bwd", False)\n'
        f"{init}\n"
        f"    def {name}(self):\n"
        f"{indented}\n"
    )


BAD = {
    "checkpoint branches": _method(
        """
        if self._optimizer_in_bwd:
            state = self._wrapper.state_dict()
        else:
            state = self._optimizer.state_dict()
        """,
        name="save_checkpoint",
    ),
    "step branches": _method(
        """
        loss.backward()
        if not self._optimizer_in_bwd:
            self._optimizer.step()
        """
    ),
    "lr logging picks an optimizer": _method(
        "lr = get_lr(self._wrapper if self._optimizer_in_bwd else self._optimizer)"
    ),
    "scheduler construction branches": _method(
        """
        optimizer = self._optimizer
        if self._optimizer_in_bwd:
            optimizer = next(iter(self._wrapper.optim_map.values()))
        """,
        name="_setup_lr_scheduler",
    ),
    "normalization branch also steps": _method(
        """
        if self._optimizer_in_bwd:
            loss.backward()
        else:
            (loss * num_tokens).backward()
            self._optimizer.step()
        """
    ),
    "normalization branch also steps the scheduler": _method(
        """
        if self._optimizer_in_bwd:
            grad_norm = self._optimizer.grad_norm
            self._lr_scheduler.step()
        """
    ),
    "flag passed along": _method("self._backward(loss, self._optimizer_in_bwd)"),
    "flag logged": _method('log_dict["in_bwd"] = self._optimizer_in_bwd'),
    "empty branch": _method(
        """
        if self._optimizer_in_bwd:
            pass
        """
    ),
    "alias read elsewhere": _method(
        """
        if self._fused:
            log.info("fused")
        """,
        init="self._fused = cfg.optimizer_in_bwd",
    ),
    "key read elsewhere": _method('memory = cfg["optimizer_in_bwd"]', name="setup"),
    "validation that calls something else": _method(
        """
        if self._optimizer_in_bwd:
            training.check_optimizer_in_bwd_options(clip_grad_norm=None)
            self._setup_model(cfg.model)
        """,
        name="_validate",
    ),
    "validation that does more than raise": _method(
        """
        if self._optimizer_in_bwd:
            self._gradient_accumulation_steps = 1
        """,
        name="_validate",
    ),
    "mode sniffed from the optimizer": _method(
        """
        if isinstance(self._optimizer, training.OptimizerInBackward):
            self._optimizer.step()
        """
    ),
    "construction branch loads state": _method(
        """
        if self._optimizer_in_bwd:
            self._wrapper.load_state_dict(state)
        """,
        name="_setup_optimizer",
    ),
}


@pytest.mark.parametrize("snippet", BAD.values(), ids=BAD.keys())
def test_rule_rejects_a_branch_on_the_flag_outside_its_allowed_places(
    snippet: str,
) -> None:
    assert find_violations(snippet), snippet


# The shape of 0.6.1's recipe (paraphrased): every one of its branches is refused.
OLD_SHAPE = """
class Recipe:
    def __init__(self, cfg):
        self._optimizer_in_bwd = cfg.optimizer_in_bwd
        if self._optimizer_in_bwd:
            if self._clip_grad_norm is not None:
                raise RuntimeError("no clipping")

    def setup(self, cfg):
        self._optimizer = self._setup_optimizer(cfg.optimizer, optimizer_in_bwd=cfg.optimizer_in_bwd)

    def _setup_optimizer(self, cfg_optimizer, optimizer_in_bwd=False, opt_state_dict=None):
        if optimizer_in_bwd:
            self._wrapper = training.create_optim_in_bwd_wrapper(self._model, optims)
            if opt_state_dict is not None:
                self._wrapper.load_state_dict(opt_state_dict)
            return None
        return config.instantiate(cfg_optimizer, self._model.parameters())

    def _setup_lr_scheduler(self, cfg):
        if self._optimizer_in_bwd:
            optimizer = next(iter(self._wrapper.optim_map.values()))
        else:
            optimizer = self._optimizer
        scheduler = config.instantiate(cfg, optimizer)
        if self._optimizer_in_bwd:
            self._wrapper.set_lr_scheduler(scheduler)

    def save_checkpoint(self, epoch):
        if not self._optimizer_in_bwd:
            state = self._optimizer.state_dict()
        else:
            state = self._wrapper.state_dict()

    def train(self):
        if not self._optimizer_in_bwd:
            self._optimizer.zero_grad()
        (loss * num_tokens).backward()
        if not self._optimizer_in_bwd:
            training.scale_grads(self._model, 1 / num_tokens)
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
        lr = get_lr(self._optimizer if not self._optimizer_in_bwd else self._wrapper)
"""


def test_rule_rejects_every_extra_branch_of_the_0_6_1_shape() -> None:
    lines = {v.line for v in find_violations(OLD_SHAPE)}
    # The store, the validation and the call to _setup_optimizer are allowed; the
    # construction branch that loads state, the scheduler, checkpoint, zero_grad,
    # step and get_lr branches are not.
    assert lines == {13, 21, 26, 30, 36, 39, 43}, _format(find_violations(OLD_SHAPE))


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
