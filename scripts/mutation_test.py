"""Helpers for scripts/mutation_test.sh (mutation testing with cosmic-ray).

Subcommands:

``serve SOCKET PRELOAD_TEST_FILE...``
    A fork server for pytest runs. It imports every third-party module that the given
    test files import (torch, torchao, bitsandbytes, ...; ~10 s here) but nothing of
    ``torchtune`` or ``tests``, then forks one child per request: the child imports
    torchtune from disk, so it sees the mutant that cosmic-ray just wrote, and runs
    pytest. Each mutant then skips those imports.
``pytest SOCKET TIMEOUT -- PYTEST_ARGS...``
    The test command cosmic-ray runs for each mutant: runs pytest through the server
    (or, if none is listening, in a fresh ``python -m pytest``) and exits with its
    exit code. A run past TIMEOUT seconds is killed and prints ``MUTANT TIMEOUT``.
``filter SESSION MODULE TARGET... [--sample FRACTION]``
    Marks as skipped the mutants of a cosmic-ray session that are out of scope: those
    outside the top-level definitions named TARGET (functions, classes, assigned
    names), those that only change a type annotation (never evaluated: the modules
    use ``from __future__ import annotations``), those whose code does not parse
    (e.g. the ``*`` of a keyword-only marker read as a multiplication), and all but
    a representative few replacements per operator (see ``_KEEP``). With
    ``--sample``, also all but that fraction of the rest, chosen by a hash of each
    mutant's operator, enclosing definition and mutated line, so the same mutants
    are chosen every time, even after edits elsewhere in the file.
``rerun-survivors SESSION``
    Makes the session's surviving mutants pending again (after adding tests).
``report SESSION [TEST_FILE...]``
    Counts (total, killed, survived, timeouts), which test file killed each mutant
    first, and the diff of every survivor; survivors listed in ``EQUIVALENT`` or
    ``ELSEWHERE`` are marked so, with the reason, and left out of the score.
    With TEST_FILEs, a mutant killed first in one of them is also counted as "killed
    only by" them, which with ``pytest -x`` and those files run last means no other
    test file killed it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

# Replacements run for each binary and comparison operator; cosmic-ray generates every
# pairing (11 per arithmetic operator, up to 7 per comparison), most of which are
# killed by the same check as these. Binary: one natural swap per operator.
# Comparisons: negation and the two boundary shifts, the "sufficient" relational
# replacements of the selective-mutation literature; ``is``/``is not`` swap.
_KEEP = {
    "ReplaceBinaryOperator": {
        "Add_Sub",
        "Sub_Add",
        "Mul_Div",
        "Div_Mul",
        "FloorDiv_Div",
        "Mod_FloorDiv",
        "Pow_Mul",
        "BitOr_BitAnd",
        "BitAnd_BitOr",
        "BitXor_BitOr",
        "LShift_RShift",
        "RShift_LShift",
    },
    "ReplaceComparisonOperator": {
        "Eq_NotEq",
        "NotEq_Eq",
        "Lt_LtE",
        "Lt_GtE",
        "LtE_Lt",
        "LtE_Gt",
        "Gt_GtE",
        "Gt_LtE",
        "GtE_Gt",
        "GtE_Lt",
        "Is_IsNot",
        "IsNot_Is",
    },
}


# Surviving mutants that no test can kill, with the reason: (module, enclosing
# definition, operator, the mutated line as the diff shows it, stripped) -> reason.
# Each was checked by hand; listed in benchmarks/results/mutation_testing.md.
_MEMORY = "torchtune/training/memory.py"
_MANAGER = "torchtune/training/checkpointing/_checkpoint_manager.py"
_STEP_FORMAT = "torchtune/training/checkpointing/_step_format.py"
_RUN_FOLDER = "torchtune/training/checkpointing/_run_folder.py"
_EXPORT = "torchtune/training/checkpointing/_export.py"
_BY_KEYWORD = (
    "every caller passes the arguments after the marker by keyword and the ones "
    "before it by position, which both signatures accept"
)
_DEPRECATED = "torchtune/training/optim_in_bwd_deprecated.py"
_LEGACY = "torchtune/training/optim_in_bwd_legacy_state_dict.py"
_ONE_GROUP = (
    "a bucket's parameters are of one param group, so its last parameter gives the "
    "same answer as its first"
)
EQUIVALENT: dict[tuple[str, str, str, str], str] = {
    (
        _MEMORY,
        "_update",
        "core/NumberReplacer",
        "inner.param_groups[0].update(hyperparameters(self._group_of[params[ -1]]))",
    ): _ONE_GROUP,
    (
        _MEMORY,
        "OptimizerInBackward",
        "core/RemoveDecorator",
        "after: def step(self, closure: None = None) -> None:  # type: ignore[override]",
    ): "step() updates through _update, which has its own torch.no_grad()",
    (
        _MEMORY,
        "_record_norms",
        "core/ReplaceTrueWithFalse",
        "for param, norm in zip(params, norms, strict=False):",
    ): "tensor_norms returns one norm per gradient given, so the lengths agree",
    (
        _MEMORY,
        "_release",
        "core/NumberReplacer",
        'bucket.optimizer.param_groups[ -1]["params"] = list(bucket.params)',
    ): "a bucket's optimizer has one param group",
    (
        _MEMORY,
        "_finite",
        "core/ReplaceBinaryOperator_Mul_Div",
        "def _finite(self, value: torch.Tensor, /, on_every_rank: bool) -> bool:",
    ): "every caller passes on_every_rank by keyword, which both signatures accept",
    (
        _MEMORY,
        "_finite",
        "core/ReplaceComparisonOperator_Gt_GtE",
        "distributed = dist.is_initialized() and dist.get_world_size() >= 1",
    ): "an all-reduce over one process returns the value it is given",
    (
        _MEMORY,
        "backward",
        "core/ReplaceFalseWithTrue",
        "if not self._finite(norm, on_every_rank=True):",
    ): (
        "the measured global norm is already the same on every rank: agreeing on it "
        "costs a collective and changes nothing"
    ),
    (_MEMORY, "backward", "core/ReplaceBinaryOperator_Mul_Div", "/,"): (
        "every caller passes the loss by position and the rest by keyword, which "
        "both signatures accept"
    ),
    (
        _DEPRECATED,
        "_in_backward",
        "core/NumberReplacer",
        "by_param[params[ -1]] = optimizer",
    ): ("it is reached only after checking that the optimizer holds one parameter"),
    **{
        (_DEPRECATED, where, "core/NumberReplacer", line): (
            "a per-parameter optimizer has one param group, and so does the "
            "OptimizerInBackward the deprecated API builds"
        )
        for where, line in (
            ("_in_backward", "shared = hyperparameters(first.param_groups[ -1])"),
            (
                "_in_backward",
                "if any(hyperparameters(o.param_groups[ -1]) != shared for o in "
                "optimizers):",
            ),
            (
                "load_state_dict",
                "self.param_groups[ -1].update(hyperparameters(first.param_groups[0]))",
            ),
            (
                "load_state_dict",
                "self.param_groups[0].update(hyperparameters(first.param_groups[ -1]))",
            ),
        )
    },
    **{
        (_LEGACY, "_entries", "core/NumberReplacer", line): (
            "reached only after checking that there is one group of one parameter"
        )
        for line in (
            'if len(groups) != 1 or len(groups[ -1]["params"]) != 1:',
            'entries[_unwrapped(name)] = (per_param["state"].get(group['
            '"params"][ -1]), hyper)',
        )
    },
    (_MANAGER, "load", "core/ReplaceBinaryOperator_Mul_Div", "/,"): (
        "every caller passes the first four by position and the rest by keyword, "
        "which both signatures accept"
    ),
    (
        _STEP_FORMAT,
        "write_manifest",
        "core/ReplaceBinaryOperator_Mul_Div",
        "def write_manifest(root: Path, path: Path, /, run_id: str | None, step: int) "
        "-> None:",
    ): "every caller passes run_id and step by keyword, which both signatures accept",
    **{
        (_STEP_FORMAT, "write_manifest", "core/NumberReplacer", line): (
            "the manifest's indentation, which JSON readers ignore"
        )
        for line in (
            "text = json.dumps(manifest, indent= 2)",
            "text = json.dumps(manifest, indent= 0)",
        )
    },
    (_EXPORT, "export_state", "core/ReplaceBinaryOperator_Mul_Div", "/,"): _BY_KEYWORD,
    (_EXPORT, "save_export", "core/ReplaceBinaryOperator_Mul_Div", "/,"): _BY_KEYWORD,
    (
        _EXPORT,
        "not_this_runs_export",
        "core/ReplaceBinaryOperator_Mul_Div",
        "def not_this_runs_export(folder: Path, /, run_id: str | None, step: int) -> "
        "str | None:",
    ): _BY_KEYWORD,
    (_RUN_FOLDER, "publish_step", "core/ReplaceBinaryOperator_Mul_Div", "/,"): (
        "its callers pass every argument after the folder by keyword, which both "
        "signatures accept"
    ),
    (_RUN_FOLDER, "take_lock", "core/NumberReplacer", "os.ftruncate(lock.fd, 1)"): (
        "the owner written next at offset 0 is longer than one byte, so the file "
        "holds the same either way"
    ),
    (
        _MANAGER,
        "_epoch_end",
        "core/ReplaceBinaryOperator_Mul_Div",
        "def _epoch_end(self, steps: list[Path], /, written_by_0_6_1: bool) -> "
        "list[Path]:",
    ): "its one caller passes written_by_0_6_1 by keyword, which both signatures accept",
    (
        _MANAGER,
        "_write_step",
        "core/ReplaceBinaryOperator_Mul_Div",
        "def _write_step(self, /, mid_epoch: bool, wait: bool = False) -> None:",
    ): "both callers pass mid_epoch and wait by keyword, which both signatures accept",
    (
        _MANAGER,
        "_restore",
        "core/ReplaceFalseWithTrue",
        "for configured, saved in zip(before, _hyperparameters(optimizer), "
        "strict=True):",
    ): (
        "loading a state dict keeps the optimizer's number of param groups (torch "
        "refuses another)"
    ),
    (
        _MANAGER,
        "_restore_legacy",
        "core/NumberReplacer",
        "dsd.set_optimizer_state_dict(models[ -1], optimizer, optim)",
    ): (
        "an optimizer state keyed by name is one of 0.6.1's distributed recipes, "
        "which train one model"
    ),
    **{
        (_MANAGER, "_restore_legacy", "core/NumberReplacer", line): (
            "a placeholder that the DCP load of a torchtune 0.6.1 dist_epoch_N "
            "checkpoint replaces with the saved value"
        )
        for line in (
            f"state = {{MODEL_KEY: model.state_dict(), EPOCHS_KEY: {value}}}"
            for value in (1, -1)
        )
    },
}

# Surviving mutants that only a run these unit tests cannot make tells apart: one of
# several processes (the 2-process scenarios, minutes each, are left out of a
# mutation run), or one with CUDA. Reported apart ("ELSEWHERE"), out of the score.
ELSEWHERE: dict[tuple[str, str, str, str], str] = {
    (
        _STEP_FORMAT,
        "on_rank_zero",
        "core/NumberReplacer",
        "dist.broadcast_object_list(outcome, src= 1)",
    ): "2 processes: rank 0's result is the one broadcast",
    (_STEP_FORMAT, "on_rank_zero", "core/NumberReplacer", "if process_count() > 2:"): (
        "2 processes: the other ranks get rank 0's result"
    ),
    **{
        (_MEMORY, "_finite", operator, line): (
            "2 processes: a loss that is not finite on one rank only "
            "(fsdp_loss_not_finite_on_one_rank_updates_no_rank)"
        )
        for operator, line in (
            (
                "core/ReplaceComparisonOperator_Gt_LtE",
                "distributed = dist.is_initialized() and dist.get_world_size() <= 1",
            ),
            (
                "core/NumberReplacer",
                "distributed = dist.is_initialized() and dist.get_world_size() > 2",
            ),
        )
    },
    (
        _MANAGER,
        "_restore",
        "core/ReplaceAndWithOr",
        'if "cuda" in rank_state["rng"] or torch.cuda.is_available():',
    ): "CUDA: a checkpoint saved without CUDA, resumed with it",
    (
        _MANAGER,
        "_restore",
        "core/AddNot",
        'if not "cuda" in rank_state["rng"] and torch.cuda.is_available():',
    ): "CUDA: a checkpoint saved with CUDA's RNG state, resumed with CUDA",
    (
        _MANAGER,
        "_write_step",
        "core/ReplaceAndWithOr",
        "if torch.cuda.is_available() or torch.cuda.is_initialized():",
    ): "CUDA: a run that never initialised CUDA on a machine that has it",
    (
        _MANAGER,
        "_write_step",
        "core/AddNot",
        "if not torch.cuda.is_available() and torch.cuda.is_initialized():",
    ): "CUDA: initialised only where it is available",
}


# -- fork server ----------------------------------------------------------------------


def _third_party_modules(test_files: list[str]) -> list[str]:
    """Modules the test files import, other than this repo's, in import order."""
    code = (
        "import sys, importlib.util\n"
        "sys.path.insert(0, '.')\n"
        "for path in sys.argv[1:]:\n"
        "    name = path[:-3].replace('/', '.')\n"
        "    importlib.import_module(name)\n"
        "print('\\n'.join(sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *test_files],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    ours = ("torchtune", "tests", "__main__", "__mp_main__")
    return [m for m in out.split() if m.split(".")[0] not in ours]


def _preload(test_files: list[str]) -> None:
    for name in _third_party_modules(test_files):
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # a module the child imports itself
            pass
    importlib.import_module("pytest")

    leaked = [m for m in sys.modules if m.split(".")[0] in ("torchtune", "tests")]
    if leaked:
        raise RuntimeError(f"preloading imported this repo's modules: {leaked[:5]}")


def _run_child(argv: list[str], cwd: str, timeout: float) -> tuple[int, str]:
    with tempfile.TemporaryFile() as log:
        pid = os.fork()
        if pid == 0:  # child
            try:
                os.setpgid(0, 0)
                os.chdir(cwd)
                sys.path.insert(0, cwd)
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(int(timeout))
                import pytest

                rc = int(pytest.main(argv))
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException:
                import traceback

                traceback.print_exc()
                rc = 3
            os._exit(rc)
        _, status = os.waitpid(pid, 0)
        try:
            os.killpg(pid, signal.SIGKILL)  # anything the tests left running
        except OSError:
            pass
        log.seek(0)
        output = log.read().decode("utf-8", "replace")
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        note = "MUTANT TIMEOUT" if sig == signal.SIGALRM else f"killed by signal {sig}"
        return 128 + sig, output + f"\n{note}\n"
    return os.WEXITSTATUS(status), output


def serve(sock_path: str, test_files: list[str]) -> None:
    _preload(test_files)
    if os.path.exists(sock_path):
        os.unlink(sock_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(1)
    print(f"mutation fork server ready on {sock_path}", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            request = json.loads(_recv_all(conn))
            rc, output = _run_child(request["argv"], request["cwd"], request["timeout"])
            conn.sendall(json.dumps({"rc": rc, "output": output}).encode())


def _recv_all(conn: socket.socket) -> bytes:
    chunks = []
    while True:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def run_pytest(sock_path: str, timeout: float, argv: list[str]) -> int:
    request = {"argv": argv, "cwd": os.getcwd(), "timeout": timeout}
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(sock_path)
    except OSError:
        print("(no fork server: running pytest in a new process)", flush=True)
        try:
            return subprocess.run(
                [sys.executable, "-m", "pytest", *argv], timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            print("MUTANT TIMEOUT", flush=True)
            return 124
    with conn:
        conn.sendall(json.dumps(request).encode())
        conn.shutdown(socket.SHUT_WR)
        reply = json.loads(_recv_all(conn))
    sys.stdout.write(reply["output"])
    sys.stdout.flush()
    return reply["rc"]


# -- session filter -------------------------------------------------------------------


def _target_lines(tree: ast.Module, targets: set[str]) -> list[tuple[int, int]]:
    spans = []
    for node in tree.body:
        names: set[str] = set()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = {node.name}
        elif isinstance(node, ast.Assign):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = {node.target.id}
        if names & targets:
            start = min(
                [node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]
            )
            spans.append((start, node.end_lineno))
    missing = targets - {
        n
        for node in tree.body
        for n in (
            [getattr(node, "name", None)]
            + [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            + [getattr(getattr(node, "target", None), "id", None)]
        )
        if n
    }
    if missing:
        raise SystemExit(f"no top-level definition named {sorted(missing)}")
    return spans


class _StripAnnotations(ast.NodeTransformer):
    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = None
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        node.returns = None
        self.generic_visit(node)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AnnAssign:
        node.annotation = ast.Constant(None)
        self.generic_visit(node)
        return node


def _stripped(source: str) -> str:
    return ast.dump(_StripAnnotations().visit(ast.parse(source)))


def _kept(operator_name: str) -> bool:
    op = operator_name.split("/")[-1]
    for family, keep in _KEEP.items():
        if op.startswith(family + "_"):
            return op[len(family) + 1 :] in keep
    return True


def _sampled(mutation, mutated: str, fraction: float) -> bool:
    line = mutated.splitlines()[mutation.start_pos[0] - 1].strip()
    key = f"{mutation.operator_name}|{mutation.definition_name}|{line}"
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def filter_session(
    session: str, module: str, targets: list[str], sample: float = 1.0
) -> None:
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    source = Path(module).read_text()
    spans = _target_lines(ast.parse(source), set(targets))
    original = _stripped(source)
    reasons: dict[str, list[str]] = {}
    kept = 0
    with use_db(session, WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            (mutation,) = item.mutations
            line = mutation.start_pos[0]
            reason = None
            if not any(a <= line <= b for a, b in spans):
                reason = "outside the target definitions"
            elif not _kept(mutation.operator_name):
                reason = "operator replacement not sampled"
            else:
                operator = cosmic_ray.plugins.get_operator(mutation.operator_name)(
                    **mutation.operator_args
                )
                mutated = mutate_code(source, operator, mutation.occurrence)
                try:
                    if mutated is None:
                        reason = "no mutation"
                    elif _stripped(mutated) == original:
                        reason = "changes only a type annotation"
                    elif not _sampled(mutation, mutated, sample):
                        reason = f"not in the {sample:.0%} sample"
                except SyntaxError:
                    reason = "mutant does not parse"
            if reason is None:
                kept += 1
                continue
            reasons.setdefault(reason, []).append(item.job_id)
        for reason, job_ids in reasons.items():
            db.set_multiple_results(
                job_ids,
                WorkResult(
                    output=f"skipped: {reason}",
                    worker_outcome=WorkerOutcome.SKIPPED,
                ),
            )
    for reason, job_ids in sorted(reasons.items()):
        print(f"skipped {len(job_ids):4d}: {reason}")
    print(f"to run  {kept:4d}")


def rerun_survivors(session: str) -> None:
    import sqlite3

    with sqlite3.connect(session) as db:
        n = db.execute(
            "DELETE FROM work_results WHERE test_outcome = 'SURVIVED'"
        ).rowcount
    print(f"{n} surviving mutants pending again")


def _changed_lines(diff: str) -> list[str]:
    """The mutated lines, stripped; for a mutant that only removes a line (a
    decorator), ``after: `` and the line that follows it."""
    lines = diff.split("\n")
    added = [
        line[1:].strip()
        for line in lines
        if line.startswith("+") and not line.startswith("+++")
    ]
    if added:
        return added
    for i, line in enumerate(lines):
        if line.startswith("-") and not line.startswith("---"):
            following = [x for x in lines[i + 1 :] if x.startswith(" ")]
            return [f"after: {following[0].strip()}"] if following else []
    return []


def _equivalent_reason(mutation, diff: str) -> tuple[str, str] | None:
    """``(label, reason)`` of a survivor listed in ``EQUIVALENT`` or
    ``ELSEWHERE``, else ``None``."""
    module = Path(mutation.module_path).as_posix()
    for line in _changed_lines(diff):
        key = (module, mutation.definition_name, mutation.operator_name, line)
        for label, known in (
            ("EQUIVALENT", EQUIVALENT),
            ("ELSEWHERE", ELSEWHERE),
        ):
            if key in known:
                return label, known[key]
    return None


# -- report ---------------------------------------------------------------------------


def _first_failure(output: str) -> str:
    match = re.search(r"^(?:FAILED|ERROR) (\S+?\.py)", output or "", re.M)
    return match.group(1) if match else "(no failing test named)"


def report(session: str, late_files: list[str] = ()) -> None:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts = {"killed": 0, "timeout": 0, "survived": 0, "pending": 0, "other": 0}
    survivors = []
    killed_by: dict[str, int] = {}
    with use_db(session, WorkDB.Mode.open) as db:
        results = dict(db.results)
        for item in db.work_items:
            result = results.get(item.job_id)
            if result is None:
                counts["pending"] += 1
            elif result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            elif result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                survivors.append((item, result))
            elif result.test_outcome == TestOutcome.KILLED:
                timed_out = result.output == "timeout" or "MUTANT TIMEOUT" in (
                    result.output or ""
                )
                counts["timeout" if timed_out else "killed"] += 1
                first = "(timeout)" if timed_out else _first_failure(result.output)
                killed_by[first] = killed_by.get(first, 0) + 1
            else:
                counts["other"] += 1
    ran = counts["killed"] + counts["timeout"] + counts["survived"]
    known = {"EQUIVALENT": 0, "ELSEWHERE": 0}
    for item, result in sorted(survivors, key=lambda s: s[0].mutations[0].start_pos):
        (mutation,) = item.mutations
        diff = result.diff or ""
        label, reason = _equivalent_reason(mutation, diff) or ("SURVIVED", "")
        known[label] = known.get(label, 0) + 1
        print(
            f"{label} {item.job_id} {mutation.operator_name} line "
            f"{mutation.start_pos[0]} ({mutation.definition_name})"
            f"{': ' + reason if reason else ''}"
        )
        print("\n".join(line for line in diff.split("\n") if re.match(r"[-+@]", line)))
    counts["equivalent"] = equivalent = known["EQUIVALENT"]
    counts["elsewhere"] = known["ELSEWHERE"]
    equivalent += known["ELSEWHERE"]
    for first, n in sorted(killed_by.items()):
        print(f"killed first by {first}: {n}")
    only_late = sum(n for f, n in killed_by.items() if f in late_files)
    print(json.dumps({"ran": ran, **counts, "killed_only_by_late_files": only_late}))
    scored = ran - equivalent
    if scored:
        killed = ran - counts["survived"]
        print(
            "score (killed / neither equivalent nor only elsewhere, timeouts "
            f"count as killed): "
            f"{killed}/{scored} = {killed / scored:.1%}"
        )
        if late_files:
            early = killed - only_late
            print(
                f"without {' '.join(late_files)}: {early}/{scored} = "
                f"{early / scored:.1%}"
            )


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "serve":
        serve(args[0], args[1:])
    elif command == "pytest":
        sock, timeout, sep, *argv = args
        if sep != "--":
            raise SystemExit("usage: pytest SOCKET TIMEOUT -- PYTEST_ARGS...")
        sys.exit(run_pytest(sock, float(timeout), argv))
    elif command == "filter":
        sample = 1.0
        if "--sample" in args:
            i = args.index("--sample")
            sample = float(args[i + 1])
            args = args[:i] + args[i + 2 :]
        filter_session(args[0], args[1], args[2:], sample)
    elif command == "rerun-survivors":
        rerun_survivors(args[0])
    elif command == "report":
        report(args[0], args[1:])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
