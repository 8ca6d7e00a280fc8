#!/usr/bin/env bash
# One prepared GPU check for a lent H100 / H200 (see docs/gpu.md). Finishes in <= 8 minutes.
#
#   bash scripts/gpu_check.sh               # on the device machine, from the repo root
#   bash scripts/gpu_check.sh --dry-run     # print what it would do (any machine)
#   bash scripts/gpu_check.sh --fetch-wheels  # on the CPU machine, BEFORE the device run:
#                                              # download fla wheels for Python 3.12 into .whl/
#
# Steps on the device: install carried wheels (no registry is reachable there), record the
# environment and which backends `auto` picks, compile fla's Triton kernels ahead of time on all
# cores (the GPU tests' kernels, first autotune config; the bench model's, every config: the
# first call of a kernel family otherwise compiles each config in turn, minutes per family),
# run tests/gpu (fast backends required), run `harts-verl bench --device cuda --dtype bfloat16`
# at compute-bound sizes (swe_like at each of $BENCH_SCALES, smallest first, each while time is
# left). At most 8 files come back from $OUT, so it writes 7:
#   env.json  gpu_tests.txt  gpu_report.json  bench.json  bench.log  precompile.log  summary.json
# bench.json is the largest size that completed: the gate is taken there (the most compute-bound
# size measured). summary.json holds everything else: the precompile summaries, every size's
# bench JSON and Triton compile counts, the test outcome, the gate.
# summary.json is also written after every step ("complete": false until the last write), so a
# run cut off by the machine's time limit still brings back what the finished steps measured.
# Exit status: 0 only if the tests pass, a bench ran, and its efficiency >= $MIN_EFFICIENCY.
#
# Knobs (environment): OUT, WHEELS_DIR (.whl), PYTHON (python3), TOTAL_BUDGET_S (470: every
# step's timeout is cut to what is left of it, keeping time for the steps after it),
# TESTS_TIMEOUT_S (200), PRECOMPILE (1; 0 skips it), PRECOMPILE_TIMEOUT_S (150 per step),
# TRITON_CACHE_DIR (/tmp/harts_triton_cache), BENCH_AUTOTUNE (all | first),
# BENCH_SCALES ("0.02 0.05"; BENCH_SCALE=x: that size alone),
# BENCH_MIN_S_LARGER (60: seconds a larger size needs left; one that runs out of time only
# loses its own result, the gate then takes the size before it), BENCH_CAPACITY (65536), BENCH_REPEATS (3),
# BENCH_PRESET (gpu_check: from BENCH_PRESET_JSON unless the package defines it; scripts/harts_cli.py),
# BENCH_DEVICE (cuda; cpu only to smoke-test the script), PRECOMPILE_TARGET (current; h100 to
# smoke-test on a CPU), MIN_EFFICIENCY (0.90), HARTS_REQUIRE_FAST (1), FLA_VERSION (0.6.0).
set -euo pipefail

DRY=0
FETCH=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --fetch-wheels) FETCH=1 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_out}
WHEELS_DIR=${WHEELS_DIR:-.whl}
PYTHON=${PYTHON:-python3}
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-470}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-200}
PRECOMPILE=${PRECOMPILE:-1}
PRECOMPILE_TIMEOUT_S=${PRECOMPILE_TIMEOUT_S:-150}
PRECOMPILE_TARGET=${PRECOMPILE_TARGET:-current}
BENCH_AUTOTUNE=${BENCH_AUTOTUNE:-all}
BENCH_SCALES=${BENCH_SCALES:-${BENCH_SCALE:-0.02 0.05}}
BENCH_MIN_S_LARGER=${BENCH_MIN_S_LARGER:-60}
BENCH_CAPACITY=${BENCH_CAPACITY:-65536}
BENCH_REPEATS=${BENCH_REPEATS:-3}
BENCH_PRESET=${BENCH_PRESET:-gpu_check}
BENCH_DEVICE=${BENCH_DEVICE:-cuda}  # cpu only to smoke-test this script
MIN_EFFICIENCY=${MIN_EFFICIENCY:-0.90}
FLA_VERSION=${FLA_VERSION:-0.6.0}
export HARTS_REQUIRE_FAST=${HARTS_REQUIRE_FAST:-1}
# One Triton cache for the precompile, the tests and every bench process.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/harts_triton_cache}
# A compute-bound model (hidden 1024, 6 layers KDA/MLA/GDN, MoE); head dims fit fla and flash.
BENCH_PRESET_JSON=${BENCH_PRESET_JSON:-'{"vocab_size": 16384, "hidden_size": 1024, "intermediate_size": 2816, "layer_types": ["kda", "kda", "mla", "gdn", "kda", "mla"], "moe_layers": [1, 3, 5], "linear_num_heads": 8, "linear_num_value_heads": 8, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_attention_heads": 8, "kv_lora_rank": 256, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_key_value_heads": 2, "head_dim": 128, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024}'}
export BENCH_PRESET_JSON

run() {  # run (or print) one command line
  if [ "$DRY" = 1 ]; then
    echo "+ $*"
  else
    echo "+ $*" >&2
    eval "$@"
  fi
}

if [ "$FETCH" = 1 ]; then
  # CPU machine, repo root: wheels for the device's Python 3.12 (fla-core is pure Python; triton
  # and torch are already on the device image). fla-core alone: harts_verl uses fla.ops only,
  # and flash-linear-attention's layers and models would import transformers in every process.
  # Keep $WHEELS_DIR ignored by git (.git/info/exclude).
  # old wheels go first: two versions of one package would stop the device's whole install
  run "mkdir -p '$WHEELS_DIR'"
  run "rm -f '$WHEELS_DIR'/*.whl"
  run "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d '$WHEELS_DIR' fla-core==$FLA_VERSION"
  run "ls -l '$WHEELS_DIR'"
  exit 0
fi

# A step past its time gets SIGINT first (Python unwinds: pytest still writes its report and
# summary, exit handlers write the compile counts), SIGKILL 15 s later if it is still running.
STOP="timeout -s INT -k 15"
START=$SECONDS
left() { echo $(( TOTAL_BUDGET_S - (SECONDS - START) )); }
# A step's timeout: its default, or what is left of the budget after `reserve` seconds kept for
# the steps after it (at least 1), so the whole script stays within TOTAL_BUDGET_S.
cap() {
  local want=$1 l
  l=$(( $(left) - $2 ))
  [ "$l" -lt "$want" ] && want=$l
  [ "$want" -lt 1 ] && want=1
  echo "$want"
}
STEPS=""  # name:rc:seconds of each step, for the summary
step_done() {  # and a partial summary.json, in case a later step is cut off
  STEPS="$STEPS $1:$2:$(( SECONDS - $3 ))"
  summary || true
}

WORK=$(mktemp -d)  # per-size JSONs and compile logs: embedded in summary.json, not in $OUT
run "mkdir -p '$OUT'"
cat > "$WORK/summary.py" <<'PY'
import json, sys
def status(value):  # an exit status, or 'pending' / 'skipped'
    return int(value) if value.lstrip('-').isdigit() else value

out, work, min_eff = sys.argv[1], sys.argv[2], float(sys.argv[5])
tests_rc, bench_rc = status(sys.argv[3]), status(sys.argv[4])
final = sys.argv[10] == 'final'
pre_rcs = {'tests': sys.argv[7], 'bench': sys.argv[8]}
steps = [{'step': name, 'rc': status(rc), 'seconds': int(sec)}
         for name, rc, sec in (item.rsplit(':', 2) for item in sys.argv[9].split())]
keys = ('efficiency', 'speedup', 'efficiency_best', 'ideal_flop_ratio', 'compression',
        'run_compression', 'semantic_tokens', 'compact_tokens', 'microbatches',
        'expanded_seconds_median', 'tree_seconds_median', 'max_abs_dlogp', 'mean_logit_cos',
        'peak_memory_mib', 'kernel_calls')

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as exc:
        return {'error': repr(exc)}

s = {'complete': final, 'tests_rc': tests_rc, 'bench_rc': bench_rc, 'min_efficiency': min_eff,
     'benches': [], 'steps': steps}
s['env'] = load(f'{out}/env.json')
s['precompile'] = {k: ({'rc': rc} if rc in ('skipped', 'pending') else {'rc': int(rc), **load(f'{work}/precompile_{k}.json')})
                   for k, rc in pre_rcs.items()}
report = load(f'{out}/gpu_report.json')
s['tests_triton'] = report.get('triton') if isinstance(report, dict) else None
for item in sys.argv[6].split():
    scale, rc = item.rsplit(':', 1)
    rc = status(rc)
    entry = {'scale': float(scale), 'rc': rc}
    if rc not in ('skipped', 'pending'):
        entry['triton'] = load(f'{work}/compiles_{scale}.json')
    if rc == 0:
        b = load(f'{work}/bench_{scale}.json')
        if 'error' in b:
            entry['bench_error'] = b['error']
        else:
            entry.update({k: b.get(k) for k in keys})
            entry['bench'] = b
    s['benches'].append(entry)
done = [e for e in s['benches'] if e['rc'] == 0 and e.get('efficiency') is not None]
if done:  # the gate: the largest size measured
    gate = max(done, key=lambda e: e['scale'])
    s['gate_scale'] = gate['scale']
    # a larger size was tried but did not complete (skipped, killed or failed): the gate is
    # taken at a smaller, less compute-bound size; the closing note must say so
    s['gate_fallback'] = gate['scale'] < max(e['scale'] for e in s['benches'])
    s.update({k: gate.get(k) for k in keys})
else:
    s['bench_error'] = 'no bench size completed (see bench.log)'
s['ok'] = tests_rc == 0 and bench_rc == 0 and (s.get('efficiency') or 0) >= min_eff
print(json.dumps(s, indent=2))
sys.exit(0 if s['ok'] else 1)
PY
# summary [final]: $OUT/summary.json from the steps run so far; its exit status is the gate's
summary() {
  if [ "$DRY" = 1 ]; then
    [ "${1:-}" = final ] && echo "+ $PYTHON summary.py '$OUT' '$WORK' $TESTS_RC $BENCH_RC $MIN_EFFICIENCY '$BENCH_RCS' '$PRE_TESTS_RC' '$PRE_BENCH_RC' final > '$OUT/summary.json'"
    return 0
  fi
  $PYTHON "$WORK/summary.py" "$OUT" "$WORK" "$TESTS_RC" "$BENCH_RC" "$MIN_EFFICIENCY" \
    "$BENCH_RCS" "$PRE_TESTS_RC" "$PRE_BENCH_RC" "$STEPS" "${1:-partial}" > "$OUT/summary.json.tmp"
  local rc=$?
  mv -f "$OUT/summary.json.tmp" "$OUT/summary.json"
  return $rc
}
# what the summary reads, set as the steps run (pending / skipped until then)
TESTS_RC=pending
BENCH_RC=pending
BENCH_RCS=""  # scale:rc of each bench size tried
PRE_TESTS_RC=skipped
PRE_BENCH_RC=skipped
# (bash runs this only once the step in progress ends: each step runs in timeout's own group)
trap 'summary || true; echo "gpu_check.sh: stopped after $((SECONDS - START))s; partial results in $OUT" >&2; exit 143' TERM INT

# 1. Carried wheels -> /tmp/site (no network on the device machine). A failing step is recorded
#    and the script goes on (the tests then say what is missing); the summary is always written.
if [ "$DRY" = 1 ] || compgen -G "$WHEELS_DIR/*.whl" > /dev/null; then
  T0=$SECONDS
  set +e
  run "timeout $(cap 90 380) $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS_DIR/*.whl"
  step_done wheels $? "$T0"
  set -e
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "gpu_check.sh: no wheels in $WHEELS_DIR; fast backends only if already installed" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

# 2. Environment and backend selection.
T0=$SECONDS
set +e
run "timeout $(cap 60 360) $PYTHON - > '$OUT/env.json' <<'PY'
import json, os, platform, importlib.metadata as md
import torch
from harts_verl.ops.backends import backend_report
info = {'python': platform.python_version(), 'torch': torch.__version__,
        'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        'capability': list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,
        'cpus': os.cpu_count(), 'triton_cache_dir': os.environ.get('TRITON_CACHE_DIR')}
for pkg in ('triton', 'fla-core', 'flash-linear-attention', 'flash-attn'):
    try:
        info[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
        info[pkg] = None
info['backends'] = backend_report('cuda' if torch.cuda.is_available() else 'cpu')
print(json.dumps(info, indent=2))
PY"
step_done env $? "$T0"
set -e

# 3. Ahead-of-time compile of fla's kernels on all cores (each step bounded; a failed or timed-out
#    step only costs the runs their own compiles).
if [ "$PRECOMPILE" = 1 ]; then
  PRE_TESTS_RC=pending
  PRE_BENCH_RC=pending
  set +e
  T0=$SECONDS
  run "$STOP $(cap "$PRECOMPILE_TIMEOUT_S" 250) $PYTHON tests/gpu/precompile_cases.py --target $PRECOMPILE_TARGET --autotune first > '$WORK/precompile_tests.json' 2> '$OUT/precompile.log'"
  PRE_TESTS_RC=$?
  step_done precompile_tests "$PRE_TESTS_RC" "$T0"
  T0=$SECONDS
  run "$STOP $(cap "$PRECOMPILE_TIMEOUT_S" 250) $PYTHON scripts/harts_cli.py precompile --preset $BENCH_PRESET --dtype bfloat16 --target $PRECOMPILE_TARGET --autotune $BENCH_AUTOTUNE > '$WORK/precompile_bench.json' 2>> '$OUT/precompile.log'"
  PRE_BENCH_RC=$?
  step_done precompile_bench "$PRE_BENCH_RC" "$T0"
  set -e
fi

# 4. GPU tests (fast backends required; first autotune config), with a report of measured errors
#    and of the Triton compiles the session still made.
set +e
T0=$SECONDS
run "HARTS_TRITON_AUTOTUNE=first HARTS_GPU_REPORT='$OUT/gpu_report.json' $STOP $(cap "$TESTS_TIMEOUT_S" 100) $PYTHON -m pytest tests/gpu -rs 2>&1 | tee '$OUT/gpu_tests.txt'"
TESTS_RC=$?  # pipefail: pytest's status (124 on timeout)
step_done tests "$TESTS_RC" "$T0"
set -e

# 5. Bench at compute-bound sizes, smallest first, each within what is left of the budget
#    (a larger size only with BENCH_MIN_S_LARGER seconds left; 20 s kept for the summary).
BENCH_DONE=""   # scales that completed (bench rc 0), in order
FIRST=1
OUT_OF_TIME=""  # set once a size is skipped for time
run ": > '$OUT/bench.log'"
for SCALE in $BENCH_SCALES; do
  NEED=60
  [ "$FIRST" = 1 ] || NEED=$BENCH_MIN_S_LARGER
  BENCH_TIMEOUT=$(( $(left) - 20 ))
  [ "$DRY" = 1 ] && BENCH_TIMEOUT=240
  # sizes grow: once one is skipped for time, no later one gets more
  if [ -n "$OUT_OF_TIME" ] || [ "$BENCH_TIMEOUT" -lt "$NEED" ]; then
    echo "gpu_check.sh: only ${BENCH_TIMEOUT}s left, skipping the bench at scale $SCALE" >&2
    BENCH_RCS="$BENCH_RCS $SCALE:skipped"
    OUT_OF_TIME=1
    continue
  fi
  set +e
  T0=$SECONDS
  # scripts/harts_cli.py is `python -m harts_verl.cli`, with the preset injected when the
  # package does not define it (a larger model than the CPU `bench` preset) and Triton's compiles
  # during the run counted into $WORK/compiles_<scale>.json.
  run "echo '== bench --scale $SCALE' >> '$OUT/bench.log'; HARTS_COMPILE_LOG='$WORK/compiles_$SCALE.json' HARTS_TRITON_AUTOTUNE=$BENCH_AUTOTUNE $STOP $BENCH_TIMEOUT $PYTHON scripts/harts_cli.py bench --device $BENCH_DEVICE --dtype bfloat16 --preset $BENCH_PRESET --generator-defaults --scale $SCALE --capacity $BENCH_CAPACITY --repeats $BENCH_REPEATS --warmup 1 --no-progress > '$WORK/bench_$SCALE.json' 2>> '$OUT/bench.log'"
  RC=$?
  BENCH_RCS="$BENCH_RCS $SCALE:$RC"
  if [ "$RC" = 0 ]; then
    BENCH_DONE="$BENCH_DONE $SCALE"
    run "cp '$WORK/bench_$SCALE.json' '$OUT/bench.json'"
  fi
  step_done "bench_$SCALE" "$RC" "$T0"
  set -e
  FIRST=0
done
BENCH_RC=1
[ -n "$BENCH_DONE" ] && BENCH_RC=0

# 6. Summary (efficiency gate at the largest size that completed; every size listed; written
#    after every step too, see summary()).
set +e
summary final
RC=$?
set -e
rm -rf "$WORK"
echo "gpu_check.sh: done in $((SECONDS - START))s (exit $RC), results in $OUT" >&2
exit $RC
