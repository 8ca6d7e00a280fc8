#!/usr/bin/env bash
# tau3-Bench GRPO launch: HARTS FSDP2 (default) or the Megatron baseline.
# Usage:
#   MODEL_PATH=/models/my-hybrid DOMAIN=tau2:retail bash recipes/tau3bench/run.sh [hydra overrides...]
# Env: MODEL_PATH (required), DOMAIN (retail_mini = bundled fixture, or tau2:<domain>),
#      DATA_DIR (written by prepare.py when missing), VARIANT=fsdp2|megatron, NNODES (1),
#      GPUS_PER_NODE (8), AGENT_LOOPS (agent-loop yaml with the user simulator; default
#      agent_loops.yaml = scripted user, which only fixture tasks have), PY.
# A Kimi-Linear / Ling 3 checkpoint as MODEL_PATH trains in place (fsdp2; see
# ../source_checkpoint.sh).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-python}"
: "${MODEL_PATH:?set MODEL_PATH to a Hugging Face model folder or hub id}"
DOMAIN="${DOMAIN:-retail_mini}"
VARIANT="${VARIANT:-fsdp2}"
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
AGENT_LOOPS="${AGENT_LOOPS:-$HERE/agent_loops.yaml}"
case "$VARIANT" in fsdp2|megatron) ;; *) echo "VARIANT must be fsdp2 or megatron" >&2; exit 2;; esac
# tau2 domains: train on τ²'s train split, validate on its test split (SPLIT= / VAL_SPLIT= empty
# for all tasks in both files, τ²'s test tasks included)
SPLIT_ARGS=()
if [[ "$DOMAIN" == tau2:* ]]; then
  SPLIT="${SPLIT-train}"; VAL_SPLIT="${VAL_SPLIT-test}"
  [ -z "$SPLIT" ] || SPLIT_ARGS+=(--split "$SPLIT")
  [ -z "$VAL_SPLIT" ] || SPLIT_ARGS+=(--val-split "$VAL_SPLIT")
  SPLIT_TAG="_${SPLIT:-all}_${VAL_SPLIT:-all}"  # a folder per choice: prepare.py runs only when
fi                                              # train.parquet is missing (stale data stays)
DATA_DIR="${DATA_DIR:-$HOME/data/harts_tau3bench/${DOMAIN//:/_}${SPLIT_TAG:-}}"
[ -f "$DATA_DIR/train.parquet" ] || "$PY" "$HERE/prepare.py" "$DATA_DIR" --domain "$DOMAIN" "${SPLIT_ARGS[@]}"
# shellcheck source=../source_checkpoint.sh
. "$ROOT/recipes/source_checkpoint.sh"
HARTS_OVERRIDES=()
[ "$VARIANT" != fsdp2 ] || harts_source_overrides "$MODEL_PATH" "$DATA_DIR/harts_config"
cd "$ROOT"
exec "$PY" -m harts_verl.main_ppo --config-path "$HERE" --config-name "tau3bench_$VARIANT" \
  data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/val.parquet" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.rollout.multi_turn.tool_config_path="$DATA_DIR/tools.yaml" \
  actor_rollout_ref.rollout.agent.agent_loop_config_path="$AGENT_LOOPS" \
  reward.custom_reward_function.path="$HERE/reward.py" \
  trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" "${HARTS_OVERRIDES[@]}" "$@"
