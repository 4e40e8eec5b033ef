#!/usr/bin/env bash
# Issue 43's many-core figures in one command, on a lent machine (docs/benchmarks.md, "On a lent many-core
# machine"): installs the wheels that ./scripts/device-wheels fetched here (.whl/, carried there), then runs
# bench/cpu_ceiling.py (the machine's own ceiling) and bench/scaling.py with any arguments given. What they
# print is also written to $OUT/ceiling.txt and $OUT/scaling.txt when the device tool sets OUT (that folder
# comes back), else to /tmp.
#   bash bench/device.sh                        # 1, 8 and 14 processes, width 1000, the 2000 x 1-s wave, two runs
#   PYTHON=python3.12 bash bench/device.sh --processes 1,2 --width 200 --runs 1 --wave 200 --wave-processes 2
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
site=${SITE:-/tmp/subq-site}
wheels=${WHEELS:-.whl}
if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
  echo "bench/device.sh: no wheels in $wheels/: run ./scripts/device-wheels first, and carry .whl" >&2
  exit 2
fi
"$python" -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" "$wheels"/*.whl || exit 1
# The wheels first, then the checkout (the fleets' workers import `workers` and `bench` from it).
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
# The ceiling is context for the figures below: its failure is printed, and the fleets run all the same.
"$python" bench/cpu_ceiling.py --json 2>&1 | tee "${OUT:-/tmp}/ceiling.txt"
"$python" bench/scaling.py --json "$@" 2>&1 | tee "${OUT:-/tmp}/scaling.txt"
exit "${PIPESTATUS[0]}"
