#!/usr/bin/env bash
# Install what the tests need into the current Python environment, then run the suite; arguments go
# to pytest (e.g. -m "not slow"). Use a separate environment, never a ComfyUI one: torch is pinned.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -r requirements-test.txt
# torchaudio (input resampling) without its dependencies: its release pins an older torch
python -m pip install --quiet --disable-pip-version-check --no-deps torchaudio==2.11.0
# pytest exits non-zero on failures and with 5 when no test ran; both fail this script.
exec python -m pytest "$@"
