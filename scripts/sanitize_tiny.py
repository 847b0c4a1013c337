"""A few decode steps of the tiny configs, for compute-sanitizer (memcheck, racecheck) on the GPU.

    compute-sanitizer --tool memcheck python scripts/sanitize_tiny.py [--kernel v10|v9] [--mma]
    compute-sanitizer --tool racecheck python scripts/sanitize_tiny.py

racecheck's reports at interpreter v10's `def` and `gl.warp_specialize` lines come from Triton's warp-specialization
switch loop (docs/racecheck-warp-specialize.md; `scripts/racecheck_ws_minimal.py` reproduces them without v10).

Plain launches (no CUDA graph) with a long watchdog, since the sanitizer slows the kernel by orders of magnitude; each
step is also checked against the PyTorch reference, so a clean report comes from a run that computed the right thing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megasynth.kernels.gpu import KernelConfig, Megakernel  # noqa: E402
from megasynth.kernels.gpu.stream import StreamConfig  # noqa: E402
from megasynth.kernels.reference import decode_step  # noqa: E402
from megasynth.kernels.weights import random_weights  # noqa: E402
from megasynth.lowering.lower import lower  # noqa: E402
from megasynth.lowering.models import get_model  # noqa: E402
from megasynth.lowering.strategy import Strategy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=["v10", "v9"], default="v10")
    ap.add_argument("--mma", action="store_true", help="v10 with the tensor-core consumer (StreamConfig.mma)")
    args = ap.parse_args()
    config = StreamConfig(mma=args.mma) if args.kernel == "v10" else KernelConfig()
    worst = 0.0
    cases = [("tiny", Strategy(attn_splits=2, tiles={"attn_norm_qkv_rope": 10})),
             ("tiny-gqa4", Strategy(attn_splits=3, k_splits={"down_proj_residual": 2}))]
    if args.kernel == "v10":  # the split merge inside o_proj (v10 only), a K range of part of a staged chunk
        cases.append(("tiny-gqa4", Strategy(attn_splits=3, fuse_attn_reduce=True, k_splits={"o_proj_residual": 4},
                                            default_granularity="head")))
    for name, strategy in cases:
        if args.kernel == "v9":
            strategy = strategy.model_copy(update={"tiles": {}})
        spec = get_model(name)
        cfg = spec.config
        w = random_weights(cfg, seed=1, dtype=torch.bfloat16, device="cuda", draw_on="cuda")
        mk = Megakernel(lower(spec, 6, strategy), w, max_seq_len=spec.max_seq_len, timeout_s=120.0, config=config)
        for pos in range(3):
            kref, vref = mk.k_cache.clone(), mk.v_cache.clone()
            mk.launch(token=pos + 5, pos=pos)
            torch.cuda.synchronize()
            mk.check()
            ref = decode_step(cfg, w, kref, vref, pos + 5, pos)
            rel = float((mk.logits - ref).norm() / ref.norm())
            worst = max(worst, rel)
            print(f"{name} {args.kernel} pos {pos}: rel L2 {rel:.2e}", flush=True)
    ok = worst < 2e-2
    print(f"{'OK' if ok else 'FAIL'}: worst rel L2 {worst:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
