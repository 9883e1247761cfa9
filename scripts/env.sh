# Sourced by setup.sh, run.sh and test.sh (and usable as `source scripts/env.sh` in a shell):
# picks the one Python environment they all use and puts it first on PATH, so `python3` and
# `loopserve` are that environment's.
#   1. an active virtual environment ($VIRTUAL_ENV): used as is;
#   2. else .venv in this checkout, if it exists;
#   3. else python3 itself (pyenv, conda, a container's Python), unless it is externally
#      managed (PEP 668: Debian's and Ubuntu's system Python refuse pip installs): then .venv
#      is created (python3 -m venv) and used.
# Run from the checkout's root (the scripts cd there first).
if [[ -z ${VIRTUAL_ENV:-} ]]; then
    if [[ ! -x .venv/bin/python3 ]] && python3 -c 'import pathlib, sys, sysconfig
sys.exit(not (pathlib.Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED").is_file())'; then
        echo "loopserve: $(command -v python3) is externally managed (PEP 668): creating .venv" >&2
        python3 -m venv .venv || {
            echo "loopserve: python3 -m venv failed (Debian/Ubuntu: apt install python3-venv)" >&2
            return 1
        }
    fi
    if [[ -x .venv/bin/python3 ]]; then
        source .venv/bin/activate
    fi
fi
