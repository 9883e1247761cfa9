#!/usr/bin/env bash
# Installs loopserve and everything it needs (CPU torch first) into the environment
# scripts/env.sh picks: the active virtual environment, else .venv in this checkout, else
# python3 itself unless that is externally managed (then .venv is created). Skipped when that
# environment already has this checkout installed and pyproject.toml and these scripts are
# unchanged since (the stamp in build/), so run.sh and test.sh start at once the second time.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
stamp=build/setup.stamp
want="$(cat pyproject.toml scripts/setup.sh scripts/env.sh | sha256sum | cut -d' ' -f1) $(command -v python3) $PWD"
installed=$(cd / && python3 -c 'import loopserve, pathlib; print(pathlib.Path(loopserve.__file__).resolve().parents[1])' 2>/dev/null || true)
if [[ -f $stamp && "$(cat "$stamp")" == "$want" && "$installed" == "$PWD" ]]; then
    exit 0
fi
echo "loopserve: installing into $(python3 -c 'import sys; print(sys.prefix)')" >&2
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
mkdir -p build && echo "$want" > "$stamp"
