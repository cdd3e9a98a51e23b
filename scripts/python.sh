#!/usr/bin/env bash
# Builds the Python wheel of the router client (python/, PyO3 + maturin), installs it into a
# fresh virtual environment and runs its pytest suite against the test kit's binaries.
#
#   scripts/python.sh            debug wheel (what scripts/test.sh runs)
#   scripts/python.sh --release  optimized wheel (what the match benchmark needs)
#
# Nothing is installed by hand: maturin and pytest come from the Python registry into a
# virtual environment this script makes (target/python-venv, kept between runs); the wheel is
# tested from a second environment made fresh each run, as a user's `pip install` would be.
# The tests need the workspace binaries: `cargo build --workspace --bins` (scripts/test.sh has
# built them by the time it calls this).
set -euo pipefail
cd "$(dirname "$0")/.."

profile=debug
maturin_flags=()
if [ "${1:-}" = --release ]; then profile=release; maturin_flags+=(--release); shift; fi

python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "python3 is missing: the wheel needs Python 3.9 or newer" >&2; exit 1; }
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 9))' \
  || { echo "$("$python" --version) is too old: the wheel needs Python 3.9 or newer" >&2; exit 1; }
"$python" -c 'import venv, ensurepip' 2>/dev/null \
  || { echo "$python has no venv/ensurepip module (Debian: apt-get install python3-venv)" >&2; exit 1; }

target=$(realpath -m "${CARGO_TARGET_DIR:-target}")
tools="$target/python-venv"
if [ ! -x "$tools/bin/maturin" ] || [ ! -x "$tools/bin/pytest" ]; then
  echo "making $tools (maturin, pytest from the Python registry)"
  "$python" -m venv "$tools"
  "$tools/bin/pip" install --quiet --disable-pip-version-check 'maturin>=1.9.4,<2' 'pytest>=8'
fi

wheels="$target/wheels/$profile"
rm -rf "$wheels"
echo "building the wheel ($profile)"
"$tools/bin/maturin" build --locked "${maturin_flags[@]}" -m python/Cargo.toml -o "$wheels"
wheel=$(ls "$wheels"/kv_router_client-*.whl)
echo "built $(basename "$wheel")"

fresh="$target/python-fresh-venv"
rm -rf "$fresh"
"$python" -m venv "$fresh"
"$fresh/bin/pip" install --quiet --disable-pip-version-check "$wheel"
# pytest runs from the tools environment with the fresh environment's site-packages first, so
# the package under test is the installed wheel, never the source tree's python/ folder.
site=$("$fresh/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$fresh/bin/python" -c 'import kv_router_client as k; print("installed", k.__name__, k.__version__)'
cd python/tests
PYTHONPATH="$site" "$tools/bin/python" -m pytest -q -p no:cacheprovider "$@" .
