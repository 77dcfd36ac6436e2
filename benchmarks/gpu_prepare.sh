#!/usr/bin/env bash
# Fill the git-ignored folder .gpu with what benchmarks/gpu_check.sh needs on the lent GPU machine
# (Python 3.12, its own torch, no pydantic, no network): wheels of pydantic and its pure-Python
# dependencies for CPython 3.12 on manylinux x86-64, and a copy of Debian's fortunes corpus
# (/usr/share/games/fortunes, from `apt-get install fortunes fortunes-min`). Run here, then pass
# `.gpu` in the device tool's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/wheels .gpu/fortunes
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/wheels pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0
src=/usr/share/games/fortunes
if [ ! -d "$src" ]; then
  echo "no fortunes corpus at $src: apt-get install fortunes fortunes-min" >&2
  exit 1
fi
find "$src" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -exec cp -f {} .gpu/fortunes/ \;
du -sh .gpu/wheels .gpu/fortunes
