#!/usr/bin/env bash
# The first run on a GPU machine, offline (docs/gpu-run.md): `make gpu-first` copies this script
# into the kit (dist/gpu-first/), beside kit.json and wheels/. On the machine, from the checkout:
#   bash dist/gpu-first/first_run.sh --out "$OUT"          # add --cpu for the tiny CPU sequence
# It runs `python -m embedpipe_tools.gpurun.first --kit <this folder> ...` (the checkout's packages, or
# the kit's project wheel installed offline into $EMBEDPIPE_SITE when there is no checkout), which
# installs what the machine lacks of the kit into $EMBEDPIPE_SITE and writes report.json after
# every step. Exit status: first.py's (0 ok, 1 a step failed, 2 stopped: one line on stderr).
set -uo pipefail
KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
SITE="${EMBEDPIPE_SITE:-/tmp/embedpipe-first-site}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "first_run.sh: $("$PY" -V 2>&1) is older than Python 3.11, which embedpipe needs" >&2
  exit 2
fi
if ! "$PY" -c 'import embedpipe_tools.gpurun.first' 2>/dev/null; then  # no checkout here: the kit's project wheel
  wheel="$(ls "$KIT"/wheels/embedpipe-*.whl 2>/dev/null | head -1)"
  if [ -z "$wheel" ]; then
    echo "first_run.sh: embedpipe_tools is not importable and $KIT/wheels holds no embedpipe wheel (make gpu-first)" >&2
    exit 2
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$wheel" || exit 2
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" -m embedpipe_tools.gpurun.first --kit "$KIT" --site "$SITE" "$@"
