"""The in-tree PEP 517 backend: the wheel it builds, and how it refuses bad input.

Each build runs the backend in a subprocess with the repository (or a scratch tree) as
its working directory, as pip does.
"""

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BACKEND = REPO / "_build_backend"


def _build(tree: Path, out: Path, env: dict | None = None, kind: str = "wheel"):
    code = f"import sys, torchtune_overlay as b; print(b.build_{kind}(sys.argv[1]))"
    full_env = {**os.environ, "PYTHONPATH": str(BACKEND), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code, str(out)],
        cwd=tree,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _fake_wheel(path: Path, version: str) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            f"torchtune-{version}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: torchtune\nVersion: {version}\n\n",
        )
        zf.writestr("torchtune/__init__.py", "")
    return path


def _scratch_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(REPO / "pyproject.toml", tree)
    shutil.copytree(BACKEND, tree / "_build_backend")
    (tree / "torchtune" / "training").mkdir(parents=True)
    (tree / "torchtune" / "training" / "added_here.py").write_text("X = 1\n")
    return tree


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = _build(REPO, out)
    assert proc.returncode == 0, proc.stderr
    return out / proc.stdout.strip().splitlines()[-1]


def test_wheel_is_upstream_with_this_tree_laid_over_it(built_wheel):
    assert built_wheel.name.startswith("torchtune-0.6.1+")
    with zipfile.ZipFile(built_wheel) as zf:
        names = set(zf.namelist())
        # upstream files are all there
        assert "torchtune/models/llama2/_model_builders.py" in names
        assert "recipes/full_finetune_distributed.py" in names
        assert "recipes/configs/llama2/7B_full.yaml" in names
        # every file of this tree replaces or adds its path, byte for byte
        for top in ("torchtune", "recipes"):
            for path in (REPO / top).rglob("*"):
                if path.is_file() and "__pycache__" not in path.parts:
                    rel = path.relative_to(REPO).as_posix()
                    assert zf.read(rel) == path.read_bytes(), rel


def test_wheel_metadata_keeps_upstream_requirements_and_adds_pins(built_wheel):
    with zipfile.ZipFile(built_wheel) as zf:
        info = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        assert info.startswith("torchtune-0.6.1+")
        meta = zf.read(info).decode()
        entry_points = zf.read(info.replace("METADATA", "entry_points.txt")).decode()
    headers = meta.split("\n\n", 1)[0].splitlines()
    version = next(h for h in headers if h.startswith("Version:"))
    assert version.startswith("Version: 0.6.1+")
    requires = [
        h.split(":", 1)[1].strip() for h in headers if h.startswith("Requires-Dist:")
    ]
    assert "torchao==0.13.0" in requires
    assert "torchdata==0.11.0" in requires and "omegaconf" in requires
    assert "tune = torchtune._cli.tune:main" in entry_points
    # What the code runs on (3.10 syntax), not upstream's >=3.9.
    assert "Requires-Python: >=3.10" in headers


def test_wheel_record_hashes_every_file(built_wheel):
    with zipfile.ZipFile(built_wheel) as zf:
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record_name).decode())))
        listed = {row[0] for row in rows}
        assert listed == set(zf.namelist())
        for name, digest, size in rows:
            if name == record_name:
                continue
            data = zf.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
            assert digest == "sha256=" + expected.rstrip(b"=").decode(), name
            assert int(size) == len(data), name


def test_wheel_installs_and_serves_the_patched_package(built_wheel, tmp_path):
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    subprocess.run(
        [*pip, "--target", str(target), str(built_wheel)], check=True, timeout=300
    )
    assert (target / "bin" / "tune").is_file()
    code = "import torchtune, torchtune.training as t; print(torchtune.__file__)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(target)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).is_relative_to(target)


def test_local_wheel_of_another_version_is_refused_naming_both(tmp_path):
    tree = _scratch_tree(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    wrong = _fake_wheel(tmp_path / "torchtune-0.6.0-py3-none-any.whl", "0.6.0")
    proc = _build(tree, out, env={"TORCHTUNE_UPSTREAM_WHEEL": str(wrong)})
    assert proc.returncode != 0
    assert "0.6.0" in proc.stderr and "0.6.1" in proc.stderr
    assert list(out.iterdir()) == []


def test_unreachable_index_fails_with_the_pin_and_how_to_build_offline(tmp_path):
    tree = _scratch_tree(tmp_path)
    out, cache, empty = tmp_path / "out", tmp_path / "cache", tmp_path / "empty"
    for d in (out, empty):
        d.mkdir()
    env = {
        "TORCHTUNE_OVERLAY_CACHE": str(cache),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(empty),
        "PIP_CONFIG_FILE": os.devnull,
    }
    proc = _build(tree, out, env=env)
    assert proc.returncode != 0
    assert "torchtune==0.6.1" in proc.stderr
    assert "TORCHTUNE_UPSTREAM_WHEEL" in proc.stderr
    assert "upstream-wheel" in proc.stderr
    # nothing half-made is left behind: no wheel, no partial download in the cache
    assert list(out.iterdir()) == []
    assert list(cache.rglob("*")) == []


def test_tree_with_a_package_init_file_is_refused(tmp_path):
    tree = _scratch_tree(tmp_path)
    (tree / "torchtune" / "__init__.py").write_text("")
    out = tmp_path / "out"
    out.mkdir()
    proc = _build(tree, out)
    assert proc.returncode != 0
    assert "torchtune/__init__.py" in proc.stderr
    assert list(out.iterdir()) == []


def test_editable_build_links_this_trees_files_into_an_assembled_tree(tmp_path):
    tree = _scratch_tree(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    proc = _build(tree, out, kind="editable")
    assert proc.returncode == 0, proc.stderr
    assembled = tree / "build" / "editable"
    link = assembled / "torchtune" / "training" / "added_here.py"
    assert link.is_symlink() and link.resolve() == (tree / link.relative_to(assembled))
    assert (assembled / "torchtune" / "training" / "memory.py").is_file()
    with zipfile.ZipFile(out / proc.stdout.strip().splitlines()[-1]) as zf:
        pth = next(n for n in zf.namelist() if n.endswith(".pth"))
        assert zf.read(pth).decode().strip() == str(assembled)
