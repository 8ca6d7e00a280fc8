#!/usr/bin/env bash
# Local CPU recipe: online GRPO steps with HARTS (harts_fsdp2 engine, harts_tool_agent with fork
# sampling, harts_hf CPU rollout server) on the bundled calculator tool task.
# Usage: bash recipes/local_cpu/run.sh [steps] [extra hydra overrides...]
# HARTS_LOCAL_DIR: work directory (default: a new temp dir); HARTS_LOCAL_INPUTS: a directory
# prepare.py already wrote (model, train/val parquet), used instead of preparing into the work dir.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
STEPS="${1:-3}"; shift || true
WORK="${HARTS_LOCAL_DIR:-$(mktemp -d /tmp/harts_local_cpu.XXXXXX)}"
export VERL_PLATFORM=harts_cpu RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false
IN="${HARTS_LOCAL_INPUTS:-}"
if [ -z "$IN" ]; then IN="$WORK"; "$PY" "$HERE/prepare.py" "$WORK" | sed 's/^/prepare: /'; fi
exec "$PY" -m harts_verl.main_ppo --config-path "$HERE" --config-name local_cpu hydra.run.dir="$WORK/hydra" \
  data.train_files="$IN/train.parquet" data.val_files="$IN/val.parquet" \
  actor_rollout_ref.model.path="$IN/model" reward.custom_reward_function.path="$HERE/reward.py" \
  actor_rollout_ref.rollout.multi_turn.function_tool_path="$HERE/tools.py" \
  trainer.total_training_steps="$STEPS" trainer.default_local_dir="$WORK/ckpt" "$@"
