#!/usr/bin/env bash
# Set up replrl on this machine, then run the given command in its environment:
#
#   ./setup.sh replrl train          # set up, then train (the default run: offline, on the CPU)
#   ./setup.sh python -m pytest      # set up, then run the tests (exactly what .ci/run does)
#
# 1. bubblewrap, the sandbox's strongest isolation, and libseccomp (its seccomp filter): apt-get (or dnf) as root, or
#    with sudo. Without either, a note, and the sandbox runs at the strongest level that works (`replrl env` says
#    which) or stops with one line.
# 2. a Python environment: the active virtualenv/conda env; else this Python when pip may install into it; else
#    ./.venv (an "externally managed" system Python, PEP 668), created here.
# 3. torch (the CPU build, 2.13.0, unless a torch is already installed: on a GPU machine install yours first), then
#    replrl with its dev extra (tests, notebooks), editable.
# Running it again is quick: what is installed is kept.
set -euo pipefail
cd "$(dirname "$0")"
say() { echo "setup: $*" >&2; }

install_system() {  # install_system PACKAGE...: as root, or with sudo; returns non-zero when neither works
  local sudo=()
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || return 1
    if [ -t 0 ]; then sudo=(sudo); else sudo=(sudo -n); fi  # a terminal may ask for a password; CI may not
  fi
  if command -v apt-get >/dev/null 2>&1; then
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1 \
      || { "${sudo[@]}" apt-get update -qq >/dev/null 2>&1 \
           && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1; }
  elif command -v dnf >/dev/null 2>&1; then
    "${sudo[@]}" dnf install -y -q "$@" >/dev/null 2>&1
  else
    return 1
  fi
}

# 1. bubblewrap
if ! command -v bwrap >/dev/null 2>&1; then
  if install_system bubblewrap; then
    say "installed bubblewrap (the sandbox's strongest isolation)"
  else
    say "note: bubblewrap could not be installed (needs root or sudo); the sandbox will use the strongest level" \
        "that works here (run: replrl env)"
  fi
fi

# 1b. libseccomp, for the kernels' seccomp filter (no keyrings, no user namespaces); usually there already
if ! ldconfig -p 2>/dev/null | grep -q "libseccomp.so.2"; then
  install_system libseccomp2 || install_system libseccomp \
    || say "note: libseccomp could not be installed; kernels run without their seccomp filter (run: replrl env)"
fi

# 2. the Python environment
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null 2>&1 || PY=python
if [ -x .venv/bin/python ] && [ -z "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ]; then
  PY=.venv/bin/python
elif [ -z "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && [ "$("$PY" -c 'import os, sys, sysconfig
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
print(int(managed and sys.prefix == sys.base_prefix))')" = 1 ]; then
  say "this Python is managed by the system (PEP 668): creating ./.venv"
  "$PY" -m venv .venv 2>/dev/null || { install_system python3-venv && "$PY" -m venv .venv; } \
    || { say "error: cannot create ./.venv: install python3-venv (apt-get install python3-venv), or activate a" \
             "virtualenv or conda env, then run ./setup.sh again"; exit 1; }
  PY=.venv/bin/python
fi
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || { say "error: replrl needs Python >= 3.10 ($("$PY" -V) found); set PYTHON=/path/to/python3.x"; exit 1; }

# 3. torch, then replrl
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  say "installing torch 2.13.0 (CPU build; on a GPU machine install your torch first)"
  "$PY" -m pip install -q torch==2.13.0
fi
say "installing replrl and its dependencies (editable, with the dev extra)"
"$PY" -m pip install -q -e ".[dev]"

if [ $# -gt 0 ]; then
  scripts="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
  user_scripts="$("$PY" -c 'import site, os; print(os.path.join(site.getuserbase(), "bin"))')"
  export PATH="$scripts:$user_scripts:$PATH"
  [ "$PY" = .venv/bin/python ] && say "later commands: source .venv/bin/activate"
  exec "$@"
fi
