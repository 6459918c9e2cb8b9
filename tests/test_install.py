"""The installed ``torchtune`` is upstream 0.6.1 with this tree laid over it, and the
repository root never shadows it."""

import importlib
import importlib.metadata
import sys
from pathlib import Path

import pytest

import torchtune

REPO = Path(__file__).resolve().parents[1]
OVERLAY_DIRS = ("torchtune", "recipes")


def _tree_files(suffixes: tuple[str, ...]) -> list[str]:
    files = []
    for top in OVERLAY_DIRS:
        for path in (REPO / top).rglob("*"):
            if (
                path.is_file()
                and path.suffix in suffixes
                and "__pycache__" not in path.parts
            ):
                files.append(path.relative_to(REPO).as_posix())
    return sorted(files)


def test_repo_root_holds_no_package_init_files():
    # Either file would make the partial tree an importable package that shadows the
    # installed one for any process started at the repository root.
    assert not (REPO / "torchtune" / "__init__.py").exists()
    assert not (REPO / "recipes" / "__init__.py").exists()


def test_torchtune_is_imported_from_the_installed_package_not_the_repo_tree():
    installed = Path(torchtune.__file__).resolve()
    assert installed.name == "__init__.py"
    assert installed.parent != (REPO / "torchtune").resolve()
    # The repository root is on sys.path here (pytest puts it there), which is exactly
    # the situation in which a committed torchtune/__init__.py would shadow the package.
    assert str(REPO) in [str(Path(p).resolve()) for p in sys.path if p]


def test_installed_distribution_is_the_patched_release():
    version = importlib.metadata.version("torchtune")
    assert version.startswith("0.6.1+"), version
    requires = importlib.metadata.requires("torchtune") or []
    assert any(r.replace(" ", "").startswith("torchao==0.13.0") for r in requires)
    # upstream's own requirements are kept
    for name in ("omegaconf", "safetensors", "sentencepiece", "torchdata==0.11.0"):
        assert any(r.startswith(name) for r in requires), (name, requires)
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert any(
        ep.name == "tune" and ep.value.startswith("torchtune._cli") for ep in scripts
    )


@pytest.mark.parametrize("rel", _tree_files((".py", ".yaml")) or ["<none>"])
def test_installed_package_serves_this_trees_file(rel):
    if rel == "<none>":
        pytest.skip("this tree has no .py/.yaml files yet")
    served = Path(torchtune.__file__).parent.parent / rel
    assert served.is_file(), f"the installed package has no {rel}"
    assert served.read_bytes() == (REPO / rel).read_bytes(), (
        f"the installed {rel} differs from this tree's: re-install "
        "(`pip install -e .`, see CONTRIBUTING.md)"
    )


def test_untouched_upstream_modules_still_import():
    llama2 = importlib.import_module("torchtune.models.llama2")
    model = llama2.llama2(
        vocab_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=16,
        max_seq_len=8,
    )
    assert sum(p.numel() for p in model.parameters()) > 0
    importlib.import_module("torchtune.datasets")
    importlib.import_module("torchtune.modules.peft")
