#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels that scripts/gpu_check.sh installs on a
# GPU machine that has no internet: Python 3.12, manylinux x86-64, no dependencies
# resolved (each one is named here), and never torch or a CUDA library (the machine's
# own torch must stay).
#
#   bash scripts/fetch_gpu_wheels.sh        # about 54 MB, once; safe to run again
#
# What goes in: everything the patched torchtune needs that the GPU machine's image
# lacks, at the versions this repo's .venv runs (scripts/setup_env.sh):
#   - torchtune 0.6.1's upstream wheel, in .whl/upstream/ (gpu_check.sh lays this tree
#     over it with the build backend; kept out of .whl/*.whl so that glob installs
#     only the dependencies);
#   - torchtune's requirements the image lacks (torchao, omegaconf, torchdata,
#     datasets and its dill, multiprocess and fsspec, blobfile and its pycryptodomex,
#     kagglehub and its kagglesdk), and bitsandbytes, which the shipped in-backward
#     configs use.
# The image already has numpy, pyyaml, requests, urllib3, filelock, lxml, pandas,
# pyarrow, xxhash, huggingface-hub, safetensors, sentencepiece, tiktoken, tokenizers,
# tqdm, psutil, pillow, protobuf, packaging, certifi, pytest and matplotlib. The check
# at the end names any requirement of a carried wheel that is neither carried nor in
# that list; gpu_check.sh checks the versions on the machine itself.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
DEST=.whl
UPSTREAM=torchtune==0.6.1
WHEELS=(
  torchao==0.13.0
  bitsandbytes==0.50.2
  omegaconf==2.4.0
  torchdata==0.11.0
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  fsspec==2026.9.0
  blobfile==3.3.0
  pycryptodomex==3.24.2
  kagglehub==1.0.3
  kagglesdk==0.1.38
)
# The GPU machine's interpreter: CPython 3.12 on glibc x86-64. pip matches each
# manylinux tag exactly, so every tag the wheels above are published with is named.
TARGET=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp)
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  TARGET+=(--platform "${tag}_x86_64")
done

# Download into a fresh folder and swap it in, so .whl/ never holds two versions of a
# package (pip installs both and stops) or half a download.
tmp="$(mktemp -d "${DEST}.tmp.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/upstream"
"$PY" -m pip download --quiet --disable-pip-version-check "${TARGET[@]}" \
  -d "$tmp/upstream" "$UPSTREAM"
"$PY" -m pip download --quiet --disable-pip-version-check "${TARGET[@]}" \
  -d "$tmp" "${WHEELS[@]}"
rm -rf "$DEST"
mv "$tmp" "$DEST"
trap - EXIT

# Static check: every requirement of a carried wheel (for CPython 3.12 on Linux
# x86-64) is carried or on the GPU machine's image; no wheel is torch or CUDA's.
"$PY" - "$DEST" <<'EOF'
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ON_IMAGE = {
    canonicalize_name(n)
    for n in """numpy pyyaml requests urllib3 filelock lxml pandas pyarrow xxhash
    huggingface-hub safetensors sentencepiece tiktoken tokenizers tqdm psutil pillow
    protobuf packaging certifi torch typing-extensions""".split()
}
env = default_environment() | {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "extra": "",
}
dest = Path(sys.argv[1])
wheels = sorted(dest.rglob("*.whl"))
carried = {parse_wheel_filename(w.name)[0] for w in wheels}
problems = []
for wheel in wheels:
    name = parse_wheel_filename(wheel.name)[0]
    if name == "torch" or name.startswith("nvidia-"):
        problems.append(f"{wheel.name}: must not be carried (the machine's torch stays)")
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        lines = zf.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if canonicalize_name(req.name) not in carried | ON_IMAGE:
            problems.append(f"{name} needs {req}: neither carried nor on the image")
size = sum(w.stat().st_size for w in wheels)
print(f"{len(wheels)} wheels in {dest}/, {size / 2**20:.1f} MiB")
for problem in problems:
    print(f"  PROBLEM: {problem}")
sys.exit(1 if problems else 0)
EOF
