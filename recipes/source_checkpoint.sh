# Sourced by the recipes' run.sh. Kimi-Linear (kimi_linear) and Ling 3 (bailing_hybrid)
# checkpoints train in place: veRL's transformers has neither model, so the FSDP2 (harts) actor
# builds their harts_hybrid conversion from a config written once beside the data
# (`harts-verl convert --config-only`; the weights are converted while loading) and the rollout
# serves the checkpoint itself (trust_remote_code: their tokenizers are remote code).
# harts_source_overrides MODEL_PATH CONFIG_DIR sets HARTS_OVERRIDES (empty for other models).
harts_source_overrides() {
  HARTS_OVERRIDES=()
  [ -d "$1" ] || return 0
  if "$PY" -c 'import sys
from harts_verl.models.checkpoints import source_format_of_dir
sys.exit(0 if source_format_of_dir(sys.argv[1]) else 1)' "$1"; then
    [ -f "$2/config.json" ] || "$PY" -m harts_verl.cli convert "$1" "$2" --config-only >&2
    HARTS_OVERRIDES=(
      actor_rollout_ref.model.hf_config_path="$2"
      actor_rollout_ref.model.trust_remote_code=true
    )
  fi
}
