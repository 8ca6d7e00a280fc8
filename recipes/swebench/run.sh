#!/usr/bin/env bash
# SWE-bench GRPO launch: HARTS FSDP2 (default) or the Megatron baseline.
# Usage:
#   MODEL_PATH=/models/my-hybrid DATA_DIR=/data/swe bash recipes/swebench/run.sh [hydra overrides...]
# Env: MODEL_PATH (required), DATA_DIR (train/val parquet from prepare.py; written when missing),
#      VARIANT=fsdp2|megatron, NNODES (1), GPUS_PER_NODE (8), TOOLS=docker|fixture, PY.
# Multi-node: start a Ray cluster first (ray start --head / --address) and run this on the head.
# A Kimi-Linear / Ling 3 checkpoint as MODEL_PATH trains in place (fsdp2; see
# ../source_checkpoint.sh).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-python}"
: "${MODEL_PATH:?set MODEL_PATH to a Hugging Face model folder or hub id}"
DATA_DIR="${DATA_DIR:-$HOME/data/harts_swebench}"
VARIANT="${VARIANT:-fsdp2}"
TOOLS="${TOOLS:-docker}"
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
case "$VARIANT" in fsdp2|megatron) ;; *) echo "VARIANT must be fsdp2 or megatron" >&2; exit 2;; esac
case "$TOOLS" in docker) TOOL_CFG="$HERE/tools.yaml";; fixture) TOOL_CFG="$HERE/tools_fixture.yaml";; *) echo "TOOLS must be docker or fixture" >&2; exit 2;; esac
if [ ! -f "$DATA_DIR/train.parquet" ]; then
  if [ "$TOOLS" = fixture ]; then "$PY" "$HERE/prepare.py" "$DATA_DIR" --fixtures; else "$PY" "$HERE/prepare.py" "$DATA_DIR"; fi
fi
# shellcheck source=../source_checkpoint.sh
. "$ROOT/recipes/source_checkpoint.sh"
HARTS_OVERRIDES=()
[ "$VARIANT" != fsdp2 ] || harts_source_overrides "$MODEL_PATH" "$DATA_DIR/harts_config"
cd "$ROOT"
exec "$PY" -m harts_verl.main_ppo --config-path "$HERE" --config-name "swebench_$VARIANT" \
  data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/val.parquet" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.rollout.multi_turn.tool_config_path="$TOOL_CFG" \
  reward.custom_reward_function.path="$HERE/reward.py" \
  trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" "${HARTS_OVERRIDES[@]}" "$@"
