#!/usr/bin/env bash
# Prepare, on a machine with network, the wheels that tools/gpu-check.sh installs on a CUDA machine without network
# (Linux x86_64, CPython 3.12, torch preinstalled):  bash tools/fetch-wheels.sh [DIR]   (default DIR: .whl)
# Everything fp16cb, its tests, the demo and the benchmark import, except torch: fastai and its pure-Python stack,
# fastprogress 1.0.3 (1.1.x imports python-fasthtml), and the compiled packages a bare torch machine may lack
# (numpy, pandas, matplotlib, scipy, scikit-learn...); gpu-check.sh installs only those the machine does not have.
# Not fetched: torch; torchvision (fastai's metadata asks for it, but nothing here imports it: the benchmark's ResNet-50
# is plain torch); spacy (only fastai.text needs it); the notebook tests' Jupyter stack (they skip without nbclient).
# The versions are the ones this project is tested with.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PY_VERSION="${PY_VERSION:-3.12}"
PKGS=(
  fastai==2.8.12 fastcore==2.2.39 fasttransform==0.0.5 fastdownload==0.0.8 fastprogress==1.0.3 torchao==0.18.0
  plum-dispatch==2.9.0 beartype==0.23.1 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.20.0
  typing-extensions==4.16.0 cloudpickle==3.1.2 packaging==26.2 pyyaml==6.0.3
  requests==2.34.2 charset-normalizer==3.4.7 idna==3.20 urllib3==2.7.0 certifi==2026.5.20
  numpy==2.4.6 pandas==3.1.1 python-dateutil==2.9.0.post0 six==1.17.0 tzdata
  matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 pyparsing==3.3.2 pillow==13.0.0
  scipy==1.17.1 scikit-learn==1.9.1 joblib==1.6.0 threadpoolctl==3.8.0 narwhals==2.29.0
  pytest==9.0.3 pytest-xdist==3.8.0 execnet==2.1.2 iniconfig==2.3.0 pluggy==1.6.0 hypothesis==6.155.2 attrs==26.1.0 sortedcontainers==2.4.0
)
mkdir -p "$DIR"
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$DIR" "${PKGS[@]}"
# every requirement of every wheel (markers evaluated for CPython $PY_VERSION on Linux) must be in $DIR, or be torch's
python3 - "$DIR" "$PY_VERSION" <<'PY'
import sys, zipfile, glob, re, os
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
wdir, pyv = sys.argv[1], sys.argv[2]
env = {'python_version': pyv, 'python_full_version': pyv + '.0', 'sys_platform': 'linux', 'platform_system': 'Linux',
       'os_name': 'posix', 'platform_machine': 'x86_64', 'implementation_name': 'cpython',
       'platform_python_implementation': 'CPython', 'extra': ''}
have = {canonicalize_name(os.path.basename(w).split('-')[0]) for w in glob.glob(os.path.join(wdir, '*.whl'))}
outside = {'torch', 'torchvision', 'spacy'}  # preinstalled (torch), or not imported by anything we run
missing = set()
for w in sorted(glob.glob(os.path.join(wdir, '*.whl'))):
    meta = next(n for n in zipfile.ZipFile(w).namelist() if n.endswith('.dist-info/METADATA'))
    for line in zipfile.ZipFile(w).read(meta).decode().splitlines():
        if not line.startswith('Requires-Dist:'): continue
        r = Requirement(line.split(':', 1)[1].strip())
        if r.marker is not None and not r.marker.evaluate(env): continue
        name = canonicalize_name(r.name)
        if name not in have and name not in outside: missing.add(f"{name} (for {os.path.basename(w)})")
if missing: sys.exit("missing from the wheel folder: " + ', '.join(sorted(missing)))
print(f"{len(have)} wheels in {wdir}: every requirement is there (torch aside)")
PY
