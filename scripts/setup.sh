#!/usr/bin/env bash
# Installs loopserve and everything it needs on a fresh machine (CPU torch first). Skipped when
# this checkout is already the installed loopserve and pyproject.toml and this script are
# unchanged since (the stamp in build/), so run.sh and test.sh start at once the second time.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=build/setup.stamp
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $(command -v python3) $PWD"
installed=$(cd / && python3 -c 'import loopserve, pathlib; print(pathlib.Path(loopserve.__file__).resolve().parents[1])' 2>/dev/null || true)
if [[ -f $stamp && "$(cat "$stamp")" == "$want" && "$installed" == "$PWD" ]]; then
    exit 0
fi
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
mkdir -p build && echo "$want" > "$stamp"
