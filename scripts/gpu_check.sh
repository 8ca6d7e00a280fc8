#!/usr/bin/env bash
# One prepared GPU check for a lent H200 (see docs/gpu.md). Finishes in <= 8 minutes.
#
#   bash scripts/gpu_check.sh               # on the device machine, from the repo root
#   bash scripts/gpu_check.sh --dry-run     # print what it would do (any machine)
#   bash scripts/gpu_check.sh --fetch-wheels  # on the CPU machine, BEFORE the device run:
#                                              # download fla wheels for Python 3.12 into .whl/
#
# Steps on the device: install carried wheels (no registry is reachable there), record the
# environment and which backends `auto` picks, run tests/gpu (fast backends required), run
# `harts-verl bench --device cuda --dtype bfloat16` at compute-bound sizes (swe_like at each of
# $BENCH_SCALES, smallest first, each while time is left), write JSON to $OUT:
#   env.json  gpu_tests.txt  gpu_report.json  bench_<scale>.json/.log  bench.json  summary.json
# bench.json is the largest size that completed: the gate is taken there (the most compute-bound
# size measured); summary.json lists every size.
# Exit status: 0 only if the tests pass, a bench ran, and its efficiency >= $MIN_EFFICIENCY.
#
# Knobs (environment): OUT, WHEELS_DIR (.whl), PYTHON (python3), TOTAL_BUDGET_S (470),
# TESTS_TIMEOUT_S (200), BENCH_SCALES ("0.02 0.05"; BENCH_SCALE=x: that size alone),
# BENCH_MIN_S_LARGER (150: seconds a larger size needs left), BENCH_CAPACITY (65536), BENCH_REPEATS (3),
# BENCH_PRESET (gpu_check: injected below unless the package defines it), BENCH_PRESET_JSON,
# BENCH_DEVICE (cuda; cpu only to smoke-test the script),
# MIN_EFFICIENCY (0.90), HARTS_REQUIRE_FAST (1), FLA_VERSION (0.6.0).
set -euo pipefail

DRY=0
FETCH=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --fetch-wheels) FETCH=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_out}
WHEELS_DIR=${WHEELS_DIR:-.whl}
PYTHON=${PYTHON:-python3}
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-470}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-200}
BENCH_SCALES=${BENCH_SCALES:-${BENCH_SCALE:-0.02 0.05}}
BENCH_MIN_S_LARGER=${BENCH_MIN_S_LARGER:-150}
BENCH_CAPACITY=${BENCH_CAPACITY:-65536}
BENCH_REPEATS=${BENCH_REPEATS:-3}
BENCH_PRESET=${BENCH_PRESET:-gpu_check}
BENCH_DEVICE=${BENCH_DEVICE:-cuda}  # cpu only to smoke-test this script
MIN_EFFICIENCY=${MIN_EFFICIENCY:-0.90}
FLA_VERSION=${FLA_VERSION:-0.6.0}
export HARTS_REQUIRE_FAST=${HARTS_REQUIRE_FAST:-1}
# A compute-bound model (hidden 1024, 6 layers KDA/MLA/GDN, MoE); head dims fit fla and flash.
BENCH_PRESET_JSON=${BENCH_PRESET_JSON:-'{"vocab_size": 16384, "hidden_size": 1024, "intermediate_size": 2816, "layer_types": ["kda", "kda", "mla", "gdn", "kda", "mla"], "moe_layers": [1, 3, 5], "linear_num_heads": 8, "linear_num_value_heads": 8, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_attention_heads": 8, "kv_lora_rank": 256, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_key_value_heads": 2, "head_dim": 128, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024}'}

run() {  # run (or print) one command line
  if [ "$DRY" = 1 ]; then
    echo "+ $*"
  else
    echo "+ $*" >&2
    eval "$@"
  fi
}

if [ "$FETCH" = 1 ]; then
  # CPU machine, repo root: wheels for the device's Python 3.12 (fla is pure Python; triton and
  # torch are already on the device image). Keep $WHEELS_DIR ignored by git (.git/info/exclude).
  run "mkdir -p '$WHEELS_DIR'"
  run "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d '$WHEELS_DIR' fla-core==$FLA_VERSION flash-linear-attention==$FLA_VERSION"
  run "ls -l '$WHEELS_DIR'"
  exit 0
fi

START=$SECONDS
left() { echo $(( TOTAL_BUDGET_S - (SECONDS - START) )); }

run "mkdir -p '$OUT'"

# 1. Carried wheels -> /tmp/site (no network on the device machine).
if [ "$DRY" = 1 ] || compgen -G "$WHEELS_DIR/*.whl" > /dev/null; then
  run "timeout 90 $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS_DIR/*.whl"
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "gpu_check.sh: no wheels in $WHEELS_DIR; fast backends only if already installed" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

# 2. Environment and backend selection.
run "timeout 60 $PYTHON - > '$OUT/env.json' <<'PY'
import json, platform, importlib.metadata as md
import torch
from harts_verl.ops.backends import backend_report
info = {'python': platform.python_version(), 'torch': torch.__version__,
        'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
for pkg in ('triton', 'fla-core', 'flash-linear-attention', 'flash-attn'):
    try:
        info[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
        info[pkg] = None
info['backends'] = backend_report('cuda' if torch.cuda.is_available() else 'cpu')
print(json.dumps(info, indent=2))
PY"

# 3. GPU tests (fast backends required), with a report of measured errors.
set +e
run "HARTS_GPU_REPORT='$OUT/gpu_report.json' timeout $TESTS_TIMEOUT_S $PYTHON -m pytest tests/gpu -rs 2>&1 | tee '$OUT/gpu_tests.txt'"
TESTS_RC=$?  # pipefail: pytest's status (124 on timeout)
set -e

# 4. Bench at compute-bound sizes, smallest first, each within what is left of the budget
#    (a larger size only with BENCH_MIN_S_LARGER seconds left; 20 s kept for the summary).
BENCH_DONE=""   # scales that completed (bench rc 0), in order
BENCH_RCS=""    # scale:rc of each size tried
FIRST=1
for SCALE in $BENCH_SCALES; do
  NEED=60
  [ "$FIRST" = 1 ] || NEED=$BENCH_MIN_S_LARGER
  BENCH_TIMEOUT=$(( $(left) - 20 ))
  [ "$DRY" = 1 ] && BENCH_TIMEOUT=240
  if [ "$BENCH_TIMEOUT" -lt "$NEED" ]; then
    echo "gpu_check.sh: only ${BENCH_TIMEOUT}s left, skipping the bench at scale $SCALE" >&2
    BENCH_RCS="$BENCH_RCS $SCALE:skipped"
    FIRST=0
    continue
  fi
  set +e
  # `harts-verl bench` is `python -m harts_verl.cli bench`; the preset is injected when the
  # package does not define it (a larger model than the CPU `bench` preset).
  run "BENCH_PRESET_JSON='$BENCH_PRESET_JSON' timeout $BENCH_TIMEOUT $PYTHON - bench --device $BENCH_DEVICE --dtype bfloat16 --preset $BENCH_PRESET --scale $SCALE --capacity $BENCH_CAPACITY --repeats $BENCH_REPEATS --warmup 1 --no-progress > '$OUT/bench_$SCALE.json' 2> '$OUT/bench_$SCALE.log' <<'PY'
import json, os, sys
from harts_verl.models.config import PRESETS
name = sys.argv[sys.argv.index('--preset') + 1]
if name not in PRESETS:
    PRESETS[name] = json.loads(os.environ['BENCH_PRESET_JSON'])
from harts_verl.cli import main
sys.exit(main(sys.argv[1:]))
PY"
  RC=$?
  set -e
  BENCH_RCS="$BENCH_RCS $SCALE:$RC"
  if [ "$RC" = 0 ]; then
    BENCH_DONE="$BENCH_DONE $SCALE"
    run "cp '$OUT/bench_$SCALE.json' '$OUT/bench.json'; cp '$OUT/bench_$SCALE.log' '$OUT/bench.log'"
  fi
  FIRST=0
done
BENCH_RC=1
[ -n "$BENCH_DONE" ] && BENCH_RC=0

# 5. Summary (efficiency gate at the largest size that completed; every size listed).
set +e
run "$PYTHON - '$OUT' $TESTS_RC $BENCH_RC $MIN_EFFICIENCY '$BENCH_RCS' > '$OUT/summary.json' <<'PY'
import json, sys
out, tests_rc, bench_rc, min_eff = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
keys = ('efficiency', 'speedup', 'efficiency_best', 'ideal_flop_ratio', 'compression',
        'run_compression', 'semantic_tokens', 'compact_tokens', 'microbatches',
        'expanded_seconds_median', 'tree_seconds_median', 'max_abs_dlogp', 'mean_logit_cos',
        'peak_memory_mib')
s = {'tests_rc': tests_rc, 'bench_rc': bench_rc, 'min_efficiency': min_eff, 'benches': []}
for item in sys.argv[5].split():
    scale, rc = item.rsplit(':', 1)
    entry = {'scale': float(scale), 'rc': rc}
    if rc == '0':
        try:
            b = json.load(open(f'{out}/bench_{scale}.json'))
            entry.update({k: b.get(k) for k in keys})
        except Exception as exc:
            entry['bench_error'] = repr(exc)
    s['benches'].append(entry)
done = [e for e in s['benches'] if e['rc'] == '0' and e.get('efficiency') is not None]
if done:  # the gate: the largest size measured
    gate = max(done, key=lambda e: e['scale'])
    s['gate_scale'] = gate['scale']
    s.update({k: gate.get(k) for k in keys})
else:
    s['bench_error'] = 'no bench size completed (see bench_<scale>.log)'
s['ok'] = tests_rc == 0 and bench_rc == 0 and (s.get('efficiency') or 0) >= min_eff
print(json.dumps(s, indent=2))
sys.exit(0 if s['ok'] else 1)
PY"
RC=$?
set -e
echo "gpu_check.sh: done in $((SECONDS - START))s (exit $RC), results in $OUT" >&2
exit $RC
