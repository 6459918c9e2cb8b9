"""PEP 517 build backend: the pinned upstream torchtune wheel with this tree laid over it.

The repository holds only the files this patch set adds or rewrites, in torchtune's
own layout (``torchtune/...`` and ``recipes/...``). Building a wheel:

1. takes the upstream wheel named by ``[tool.torchtune-overlay]`` in ``pyproject.toml``
   from, in order: the ``upstream-wheel`` config setting, the
   ``TORCHTUNE_UPSTREAM_WHEEL`` environment variable, the download cache, or
   ``pip download <name>==<version> --no-deps`` from the configured package index
   (the result is cached, so a rebuild downloads nothing);
2. copies every upstream file, replacing or adding each file of this tree at its path;
3. writes a new ``.dist-info`` with version ``<version>+<label>``, upstream's
   requirements plus this project's pins, upstream's entry points (the ``tune``
   console script) and a fresh ``RECORD``.

An editable build assembles the same tree under ``build/editable/``, where the files of
this tree are symbolic links to the repository, and installs a ``.pth`` that puts that
folder on ``sys.path``: edits take effect at once, new files need a re-install.

Nothing here uses setuptools: a wheel is a zip with a ``RECORD``, which is short to
write and leaves no hidden build state behind.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport
    import tomli as tomllib

ROOT = Path.cwd()
OVERLAY_DIRS = ("torchtune", "recipes")
FORBIDDEN = ("torchtune/__init__.py", "recipes/__init__.py")
SKIP_PARTS = {"__pycache__", ".pytest_cache", ".ruff_cache"}
SKIP_SUFFIXES = {".pyc", ".pyo"}
WHEEL_ENV = "TORCHTUNE_UPSTREAM_WHEEL"
CACHE_ENV = "TORCHTUNE_OVERLAY_CACHE"
SDIST_PATHS = (
    "pyproject.toml",
    "README.md",
    "CONTRIBUTING.md",
    "_build_backend",
    "torchtune",
    "recipes",
)


class OverlayBuildError(RuntimeError):
    """Raised when the patched distribution cannot be assembled."""


# ----------------------------------------------------------------------------- config


def _config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        cfg = tomllib.load(f)["tool"]["torchtune-overlay"]
    for key in ("upstream", "upstream-version", "local-label"):
        if key not in cfg:
            raise OverlayBuildError(
                f"[tool.torchtune-overlay] in pyproject.toml has no '{key}' key."
            )
    return cfg


def _version(cfg: dict) -> str:
    return f"{cfg['upstream-version']}+{cfg['local-label']}"


def _dist_info(cfg: dict) -> str:
    return f"{cfg['upstream']}-{_version(cfg)}.dist-info"


# --------------------------------------------------------------------- upstream wheel


def _cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torchtune-overlay"


def _wheel_metadata(wheel: Path) -> tuple[str, str]:
    """Returns (name, version) read from a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise OverlayBuildError(f"{wheel} has no single .dist-info/METADATA.")
        text = zf.read(names[0]).decode()
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields.get("Name", "?"), fields.get("Version", "?")


def _check_wheel(wheel: Path, cfg: dict) -> Path:
    if not wheel.is_file():
        raise OverlayBuildError(
            f"The upstream wheel {wheel} does not exist. Point {WHEEL_ENV} (or the "
            f"'upstream-wheel' config setting) at a {cfg['upstream']}=="
            f"{cfg['upstream-version']} wheel file."
        )
    try:
        name, version = _wheel_metadata(wheel)
    except zipfile.BadZipFile as e:
        raise OverlayBuildError(f"{wheel} is not a wheel: {e}") from e
    if name.lower() != cfg["upstream"] or version != cfg["upstream-version"]:
        raise OverlayBuildError(
            f"{wheel} is {name} {version}, but this patch set is pinned to "
            f"{cfg['upstream']} {cfg['upstream-version']}. Use the "
            f"{cfg['upstream']}=={cfg['upstream-version']} wheel."
        )
    return wheel


def _download(cfg: dict, cache: Path) -> Path:
    pin = f"{cfg['upstream']}=={cfg['upstream-version']}"
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", pin, "--no-deps"]
        cmd += ["--only-binary=:all:", "--dest", tmp, "--quiet"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise OverlayBuildError(
                f"Could not fetch the upstream wheel {pin} with pip from the configured "
                f"package index ({' '.join(cmd)} exited with {proc.returncode}):\n  "
                + "\n  ".join(detail)
                + f"\nThis build needs {pin}. To build offline, point the build at a "
                f"local wheel: set {WHEEL_ENV}=/path/to/{cfg['upstream']}-"
                f"{cfg['upstream-version']}-py3-none-any.whl, or pass "
                f"--config-settings upstream-wheel=/path/to/that.whl to pip."
            )
        _check_wheel(wheels[0], cfg)
        target = cache / wheels[0].name
        os.replace(wheels[0], target)  # atomic: the cache never holds half a wheel
    return target


def _upstream_wheel(cfg: dict, config_settings: dict | None) -> Path:
    explicit = (config_settings or {}).get("upstream-wheel") or os.environ.get(
        WHEEL_ENV
    )
    if explicit:
        return _check_wheel(Path(explicit).expanduser().resolve(), cfg)
    cache = _cache_dir()
    pattern = f"{cfg['upstream']}-{cfg['upstream-version']}-*.whl"
    for cached in sorted(cache.glob(pattern)):
        try:
            return _check_wheel(cached, cfg)
        except OverlayBuildError:
            cached.unlink(missing_ok=True)  # a corrupt cache entry is fetched again
    return _download(cfg, cache)


# ------------------------------------------------------------------------ the overlay


def _overlay_files() -> list[str]:
    """Paths (posix, relative to the repo root) of every file this tree lays over."""
    for rel in FORBIDDEN:
        if (ROOT / rel).exists():
            raise OverlayBuildError(
                f"{rel} exists in this tree. It must never be committed: a process "
                "started at the repository root would import this partial tree "
                "instead of the installed package. Delete it."
            )
    files = []
    for top in OVERLAY_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT)
            if path.is_dir() or SKIP_PARTS.intersection(rel.parts):
                continue
            if path.suffix in SKIP_SUFFIXES:
                continue
            files.append(rel.as_posix())
    return files


def _upstream_files(wheel: Path) -> dict[str, bytes]:
    """The upstream wheel's files, without its .dist-info."""
    with zipfile.ZipFile(wheel) as zf:
        return {
            n: zf.read(n)
            for n in zf.namelist()
            if not n.endswith("/") and ".dist-info/" not in n
        }


def _upstream_dist_info(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as zf:
        return {
            n.split("/", 1)[1]: zf.read(n)
            for n in zf.namelist()
            if ".dist-info/" in n and not n.endswith("/")
        }


def _metadata(upstream: bytes, cfg: dict) -> bytes:
    """Upstream's METADATA with the new version and this project's requirements."""
    head, sep, body = upstream.decode().partition("\n\n")
    lines = []
    for line in head.splitlines():
        if line.startswith("Version:"):
            line = f"Version: {_version(cfg)}"
        if line.startswith("Requires-Python:") and cfg.get("requires-python"):
            line = f"Requires-Python: {cfg['requires-python']}"
        lines.append(line)
    lines += [f"Requires-Dist: {req}" for req in cfg.get("requires", [])]
    for extra, reqs in cfg.get("extras", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {r}; extra == "{extra}"' for r in reqs]
    return ("\n".join(lines) + sep + body).encode()


def _dist_info_files(wheel: Path, cfg: dict) -> dict[str, bytes]:
    upstream = _upstream_dist_info(wheel)
    info = _dist_info(cfg)
    files = {}
    for name, data in upstream.items():
        if name in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
            continue
        if name == "METADATA":
            data = _metadata(data, cfg)
        elif name == "WHEEL":
            data = (
                b"Wheel-Version: 1.0\nGenerator: torchtune-overlay\n"
                b"Root-Is-Purelib: true\nTag: py3-none-any\n"
            )
        files[f"{info}/{name}"] = data
    return files


def _write_wheel(path: Path, files: dict[str, bytes], record: str) -> None:
    rows = []
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(files):
            data = files[name]
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
            rows.append((name, "sha256=" + digest.rstrip(b"=").decode(), len(data)))
            info = zipfile.ZipInfo(name, date_time=(2025, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerows(rows)
        writer.writerow((record, "", ""))
        zf.writestr(
            zipfile.ZipInfo(record, date_time=(2025, 1, 1, 0, 0, 0)), buf.getvalue()
        )
    os.replace(tmp, path)


def _wheel_name(cfg: dict) -> str:
    return f"{cfg['upstream']}-{_version(cfg)}-py3-none-any.whl"


# ------------------------------------------------------------------- PEP 517 / PEP 660


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    cfg = _config()
    wheel = _upstream_wheel(cfg, config_settings)
    files = _upstream_files(wheel)
    for rel in _overlay_files():
        files[rel] = (ROOT / rel).read_bytes()
    files.update(_dist_info_files(wheel, cfg))
    name = _wheel_name(cfg)
    _write_wheel(Path(wheel_directory) / name, files, f"{_dist_info(cfg)}/RECORD")
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    cfg = _config()
    wheel = _upstream_wheel(cfg, config_settings)
    overlay = _overlay_files()
    tree = ROOT / "build" / "editable"
    staging = ROOT / "build" / "editable.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    for rel, data in _upstream_files(wheel).items():
        target = staging / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    for rel in overlay:
        target = staging / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        target.symlink_to(ROOT / rel)
    shutil.rmtree(tree, ignore_errors=True)
    os.replace(staging, tree)
    files = _dist_info_files(wheel, cfg)
    files[f"__editable__.{cfg['upstream']}-{_version(cfg)}.pth"] = f"{tree}\n".encode()
    name = _wheel_name(cfg)
    _write_wheel(Path(wheel_directory) / name, files, f"{_dist_info(cfg)}/RECORD")
    return name


def build_sdist(sdist_directory, config_settings=None):
    cfg = _config()
    base = f"{cfg['upstream']}-{_version(cfg)}"
    name = f"{base}.tar.gz"
    with tarfile.open(Path(sdist_directory) / name, "w:gz") as tar:
        for rel in SDIST_PATHS:
            path = ROOT / rel
            if path.exists():
                tar.add(path, arcname=f"{base}/{rel}", filter=_sdist_filter)
        pkg_info = _metadata(
            _upstream_dist_info(_upstream_wheel(cfg, config_settings))["METADATA"], cfg
        )
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        tar.addfile(info, io.BytesIO(pkg_info))
    return name


def _sdist_filter(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    parts = set(Path(info.name).parts)
    if parts & SKIP_PARTS or Path(info.name).suffix in SKIP_SUFFIXES:
        return None
    return info
