#!/usr/bin/env bash
# triage-bench on one GPU: a Qwen2.5-0.5B-shaped model (real config shapes, random weights, fp16)
# with a real tokenizer (SmolLM2's), every batching mode at GPU-sized batches, MFU against a
# fp16 GEMM measured in the same run. Made for a box with only CUDA PyTorch + transformers>=5:
# no model hub, no package registry. What it brings lives in bench/gpu_assets/ (~15 MB):
#   tokenizer/        SmolLM2 tokenizer.json + chat template + special tokens
#   qwen2.5-0.5b/     config.json (hidden 896, 24 layers, 14 heads, 2 kv heads, ffn 4864, vocab 151936)
#   wheels/           pydantic-settings and its deps (pydantic-core for CPython 3.10-3.14, x86_64),
#                     unpacked into a temp dir only when `import pydantic_settings` fails
#
#   bench/gpu.sh              # GPU run (~3-5 min on an H200): $OUT/bench-gpu.{txt,json,png}
#   bench/gpu.sh --dry-run    # CPU, tiny shape, 8 tickets: the whole script path in well under a minute
#   bench/gpu.sh --n 500      # any other argument goes to triage-bench (later ones win)
#
# Env: PYTHON (default python3), OUT (default <repo>/out). Details: docs/benchmark.md.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ASSETS=$ROOT/bench/gpu_assets
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-$ROOT/out}
DRY=0
EXTRA=()
for a in "$@"; do
  case $a in
    --dry-run) DRY=1 ;;
    *) EXTRA+=("$a") ;;
  esac
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/triage-gpu.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TRIAGE_CACHE_DIR=$WORK/cache
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "[gpu.sh $(date +%H:%M:%S)] $*" >&2; }

# 1. Python deps the bench imports beyond torch/transformers/numpy/tqdm/pyyaml: pydantic-settings (worker.settings).
if ! "$PY" -c "import pydantic_settings, pydantic; assert int(pydantic.VERSION.split('.')[0]) >= 2" 2>/dev/null; then
  log "unpacking carried wheels into $WORK/deps"
  "$PY" - "$ASSETS/wheels" "$WORK/deps" <<'EOF'
import glob, os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
tag = f"-cp{sys.version_info.major}{sys.version_info.minor}-"
for whl in sorted(glob.glob(os.path.join(src, "*.whl"))):
    name = os.path.basename(whl)
    if "-cp3" in name and tag not in name:
        continue  # a compiled wheel for another CPython
    zipfile.ZipFile(whl).extractall(dst)
EOF
  export PYTHONPATH="$WORK/deps:$PYTHONPATH"
fi
"$PY" - "$DRY" <<'EOF'
import sys
import torch, transformers, pydantic_settings  # noqa: F401
if int(transformers.__version__.split(".")[0]) < 5:
    sys.exit(f"gpu.sh: transformers>=5 is required (the engine uses the v5 cache= API); found {transformers.__version__}")
if sys.argv[1] == "0" and not torch.cuda.is_available():
    sys.exit("gpu.sh: no CUDA device visible (torch.cuda.is_available() is False); use --dry-run for the CPU check")
print(f"[gpu.sh] python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"cuda {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}", file=sys.stderr)
EOF

# 2. The model: Qwen2.5-0.5B shapes, random weights (seeded), the SmolLM2 tokenizer; saved like any local model.
log "building the model in $WORK/model"
"$PY" - "$ASSETS" "$WORK/model" "$DRY" <<'EOF'
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

assets, out, dry = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
special = json.loads((assets / "tokenizer" / "special_tokens.json").read_text())
tok = PreTrainedTokenizerFast(tokenizer_file=str(assets / "tokenizer" / "tokenizer.json"),
                              **{k: v for k, v in special.items() if k.endswith("_token")})
tok.chat_template = (assets / "tokenizer" / "chat_template.jinja").read_text()
cfg = json.loads((assets / "qwen2.5-0.5b" / "config.json").read_text())
if dry:  # same family and vocab, tiny width/depth: the CPU check of this script
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_window_layers=2)
cfg.update(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
config = Qwen2Config(**cfg)
torch.manual_seed(0)
device = "cpu" if dry or not torch.cuda.is_available() else "cuda"
with torch.device(device):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if dry else torch.float16)
n = sum(p.numel() for p in model.parameters())
model.save_pretrained(out)
tok.save_pretrained(out)
print(f"[gpu.sh] model: {n / 1e6:.0f}M params ({config.num_hidden_layers} layers, hidden {config.hidden_size}), "
      f"tokenizer vocab {len(tok)} < embedding rows {config.vocab_size}", file=sys.stderr)
EOF

# 3. The benchmark. GPU: every mode on 2000 tickets (sequential too), both prompts, a batch-size sweep.
if [ "$DRY" = 1 ]; then
  ARGS=(--model-label "Qwen2.5-0.5B family, tiny shape (dry run)" --device cpu --dtype fp32 --n 8 --fixed-batch 4 --max-batch-items 8 --max-batch-tokens 2048 --gemm-tokens 64
        --prompt both --sweep --sweep-items 2,8 --sweep-tokens 512,2048)
else
  ARGS=(--model-label "Qwen2.5-0.5B shape, random weights" --device cuda --dtype fp16 --n 2000 --fixed-batch 64 --max-batch-items 256 --max-batch-tokens 32768 --gemm-tokens 8192
        --prompt both --sweep --sweep-items 16,64,256,1024 --sweep-tokens 8192,32768,131072)
fi
log "running triage-bench ${ARGS[*]} ${EXTRA[*]:-}"
"$PY" -m worker.bench.cli --model "$WORK/model" "${ARGS[@]}" --no-progress \
  --json "$OUT/bench-gpu.json" --plot "$OUT/bench-gpu.png" "${EXTRA[@]}" | tee "$OUT/bench-gpu.txt"
log "done in ${SECONDS}s: $OUT/bench-gpu.txt, $OUT/bench-gpu.json, $OUT/bench-gpu.png"
