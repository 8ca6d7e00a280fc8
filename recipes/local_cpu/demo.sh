#!/usr/bin/env bash
# `make demo`: one stock-path baseline step (+actor_rollout_ref.actor.harts.enable=false), then 3
# online HARTS steps of the local CPU recipe; prints per-step reward, compression, update time.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
STEPS="${1:-3}"
OUT="$(mktemp -d /tmp/harts_demo.XXXXXX)"
TIMEOUT="${HARTS_DEMO_TIMEOUT:-600}"
run() {  # run LABEL STEPS [overrides...]: the recipe in its own session, Ray cleaned up after
  local label="$1" steps="$2"; shift 2
  echo "== $label: $steps step(s), log $OUT/$label.log"
  HARTS_LOCAL_DIR="$OUT/$label" PY="$PY" setsid timeout -k 15 "$TIMEOUT" \
    bash "$HERE/run.sh" "$steps" "$@" >"$OUT/$label.log" 2>&1 &
  local pid=$!
  wait "$pid"; local rc=$?
  # $pid is the session id (setsid execs in place: a background job is no group leader);
  # kill whatever is left of the run's session (Ray GCS, raylet, workers), by PID
  for sig in TERM KILL; do
    pkill -"$sig" -s "$pid" 2>/dev/null || true; sleep 2
  done
  [ "$rc" -eq 0 ] || { echo "$label failed (rc=$rc); tail of log:"; tail -20 "$OUT/$label.log"; }
  return "$rc"
}
# inputs (SFT warm-started model, agent-prompt tasks) prepared once, shared by both runs
echo "== prepare: $OUT/inputs"
"$PY" "$HERE/prepare.py" "$OUT/inputs" 2>"$OUT/prepare.log" || { tail -20 "$OUT/prepare.log"; exit 1; }
export HARTS_LOCAL_INPUTS="$OUT/inputs"
# The stock baseline runs padded rows: without fla (CPU), HF's torch fallback for Qwen3-Next's
# GatedDeltaNet would carry the linear-attention state across veRL's packed sequences (wrong
# log-probs and gradients); on GPUs with fla, packing is exact.
run baseline 1 +actor_rollout_ref.actor.harts.enable=false \
  actor_rollout_ref.model.use_remove_padding=false || exit 1
run harts "$STEPS" || exit 1
"$PY" "$HERE/summary.py" "$OUT/baseline.log" "$OUT/harts.log"
