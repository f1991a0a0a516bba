"""How much does the bundled model's 4-bit quantization cost the head? A measured estimate.

No higher-precision SmolLM2-135M-Instruct exists offline here (docs/quality.md, "Quantization"),
so the original weights cannot be compared with. Instead this adds a *second*, independent
Q4_1 rounding to every Q4_1 tensor (blocks of 32 shifted by 16 columns, so the new rounding
error is fresh, of the same size as the first) and measures what that does to the pooled
states and to the support head. If a second dose barely moves accuracy, the first (the one
the bundled file already carries) is unlikely to have cost much more.

    python scripts/quantization_probe.py [--dtype bf16] [--json out/quality/quantization.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def q4_1_shifted(w: torch.Tensor, block: int = 32, shift: int = 16) -> torch.Tensor:
    """Q4_1 round trip (per block: min and 15 steps to max) on blocks shifted by ``shift`` columns."""
    rows, cols = w.shape
    x = torch.roll(w.float(), shifts=-shift, dims=1)
    pad = (-cols) % block
    x = torch.nn.functional.pad(x, (0, pad)).view(rows, -1, block)
    lo, hi = x.min(-1, keepdim=True).values, x.max(-1, keepdim=True).values
    d = ((hi - lo) / 15).clamp(min=1e-12)
    d, lo = d.half().float(), lo.half().float()  # GGUF stores scale and min in fp16
    y = (torch.round((x - lo) / d).clamp(0, 15) * d + lo).view(rows, -1)[:, :cols]
    return torch.roll(y, shifts=shift, dims=1).to(w.dtype)


def requantized_dir(cache_dir: Path) -> Path:
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.engine.loader import bundled_gguf_path, converted_gguf_dir

    target = ROOT / "out" / "quality-cache" / "smollm2-q4_1-twice"
    if (target / "model.safetensors").is_file():
        return target
    src = converted_gguf_dir(bundled_gguf_path(), cache_dir)
    q4 = {t.name for t in GGUFReader(str(bundled_gguf_path())).tensors if t.tensor_type.name == "Q4_1"}
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            # HF llama names -> GGUF names for the linear layers (q/k/v/o, gate/up/down)
            gg = (
                name.replace("model.layers.", "blk.")
                .replace(".self_attn.q_proj", ".attn_q")
                .replace(".self_attn.k_proj", ".attn_k")
                .replace(".self_attn.v_proj", ".attn_v")
                .replace(".self_attn.o_proj", ".attn_output")
                .replace(".mlp.gate_proj", ".ffn_gate")
                .replace(".mlp.up_proj", ".ffn_up")
                .replace(".mlp.down_proj", ".ffn_down")
            )
            if gg in q4:
                p.copy_(q4_1_shifted(p))
                n += 1
    if n != len(q4):
        raise SystemExit(f"matched {n} of {len(q4)} Q4_1 tensors: name mapping is off")
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(src).save_pretrained(target)
    return target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--head-prompt", default="labels", choices=["labels", "task"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from worker.quality import suites
    from worker.quality.compare import feature_store, score
    from worker.quality.head import fit_head
    from worker.settings import Settings

    settings = Settings(device="cpu", dtype=args.dtype)
    suite = suites.load("support")
    twice = str(requantized_dir(settings.cache_dir))
    out: dict = {"dtype": args.dtype, "head_prompt": args.head_prompt, "n_train": len(suite.train), "models": {}}
    feats = {}
    for label, model in (("bundled Q4_1 (once)", "bundled:smollm2"), ("Q4_1 applied twice", twice)):
        store = feature_store(settings.model_copy(update={"model": model}), suite.prompt_task(args.head_prompt))
        tr = store.get([r.text for r in suite.train], desc=f"{label}: train")
        row = {}
        head = fit_head(tr.mean, [r.label for r in suite.train], suite.labels, seed=0)
        for name, rows in suite.tests.items():
            te = store.get([r.text for r in rows], desc=f"{label}: {name}")
            feats.setdefault(name, []).append(te.mean)
            cell = score(head.probs(te.mean), suite.labels, [r.label for r in rows])
            row[name] = {"accuracy": cell.accuracy, "ece": cell.ece}
        out["models"][label] = row
    cos = {}
    for name, (a, b) in feats.items():
        cos[name] = round(float(np.mean(np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))), 5)
    out["mean_cosine_of_pooled_states"] = cos
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
