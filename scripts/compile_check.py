"""Compile the megakernel for sm_90 on a machine without a GPU and print registers, spill stack and shared memory.

Each extra argument adds a variant: NAME=field=value,... of the interpreter's config (`StreamConfig` for v10, the
default, from the model's defaults `stream_config`; `KernelConfig` with --kernel v9), e.g.

    python scripts/compile_check.py --model llama-8b s8=slots=8 b4=boxes=4
    python scripts/compile_check.py --kernel v9 ns3=num_stages=3
    python scripts/compile_check.py --kernel v9 --batch 8
    python scripts/compile_check.py --batch 8
    python scripts/compile_check.py --model qwen3-0.6b mma=mma=True

--loops lists each build's innermost loops from its machine code (nvdisasm) with their instructions and estimated
cycles per iteration (two warps, in order, waiting on their registers: `SassLoop.cycles`); --loops OP,OP keeps those
holding every opcode named (prefixes), e.g. long-context attention's ring loop:

    python scripts/compile_check.py --loops MUFU.EX2,LDS

--model takes a named model (megasynth/lowering/models.py: the Llama, Qwen2.5, Qwen3 and Mistral rows) or a
checkpoint folder; --config a model config of your own, as JSON text or a file (ModelConfig's fields, HF names), e.g.
a tiny QK-norm model with a head_dim of its own:

    python scripts/compile_check.py --config '{"hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
        "head_dim": 128, "qk_norm": true, "tie_word_embeddings": false}'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megasynth.ir.model import ModelConfig  # noqa: E402
from megasynth.kernels.gpu.offline import compile_v9, compile_v10, sass, sass_loops  # noqa: E402
from megasynth.kernels.gpu.runtime import config_with  # noqa: E402
from megasynth.kernels.gpu.stream import stream_config  # noqa: E402
from megasynth.kernels.gpu.v9 import KernelConfig  # noqa: E402
from megasynth.lowering.models import get_model  # noqa: E402


def parse_variant(text: str, base: Any) -> tuple[str, Any]:
    """'name=k1=v1,k2=v2' -> (name, base with k1=v1, k2=v2): the items of `synth bench --kernel-option`."""
    name, _, body = text.partition("=")
    return name, config_with(base, [item for item in body.split(",") if item])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b", help="a named model or a checkpoint folder")
    ap.add_argument("--config", help="a model config instead of --model: JSON text, or a file that holds it")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="KV cache positions (default: the model's; 4096 with --config)")
    ap.add_argument("--kernel", choices=["v10", "v9"], default="v10")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (a batch build)")
    ap.add_argument("--loops", nargs="?", const="", default=None, metavar="OP,OP",
                    help="print the innermost loops of each build (those holding every opcode prefix named)")
    ap.add_argument("variants", nargs="*", help="NAME=key=value,... (StreamConfig / KernelConfig fields)")
    args = ap.parse_args()
    if args.config:
        text = Path(args.config).read_text(encoding="utf-8") if Path(args.config).is_file() else args.config
        model, seq = ModelConfig.from_hf(json.loads(text)), args.max_seq_len or 4096
    else:
        spec = get_model(args.model)
        model, seq = spec.config, args.max_seq_len or spec.max_seq_len
    base = stream_config(model) if args.kernel == "v10" else KernelConfig()
    try:
        variants = [("default", base)] + [parse_variant(v, base) for v in args.variants]
    except ValueError as exc:
        ap.error(str(exc))
    for vname, cfg in variants:
        try:
            kernel, res = (compile_v10(model, seq, cfg, batch=args.batch) if args.kernel == "v10"
                           else compile_v9(model, seq, cfg, args.batch))
        except ValueError as exc:  # a config the interpreter refuses for this model or batch
            print(f"{vname:12s} refused: {exc}", flush=True)
            continue
        print(f"{vname:12s} {res}", flush=True)
        if args.loops is not None:
            ops = [op for op in args.loops.split(",") if op]
            for loop in sass_loops(sass(kernel)):
                if loop.has(ops):
                    print(f"  {loop}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
