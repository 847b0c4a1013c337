"""Compile the megakernel for sm_90 on a machine without a GPU and print registers, spill stack and shared memory.

Each extra argument adds a variant: NAME=field=value,... of the interpreter's config (`StreamConfig` for v10, the
default; `KernelConfig` with --kernel v9), e.g.

    python scripts/compile_check.py --model llama-8b s8=slots=8 b4=boxes=4
    python scripts/compile_check.py --kernel v9 ns3=num_stages=3
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megasynth.kernels.gpu.offline import compile_v9, compile_v10  # noqa: E402
from megasynth.kernels.gpu.stream import StreamConfig  # noqa: E402
from megasynth.kernels.gpu.v9 import KernelConfig  # noqa: E402
from megasynth.lowering.models import get_model  # noqa: E402


def parse_variant(text: str, cls: type) -> tuple[str, Any]:
    """'name=k1=v1,k2=v2' -> (name, cls(k1=v1, k2=v2)); values are Python literals."""
    name, _, body = text.partition("=")
    kwargs = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        kwargs[key.strip()] = ast.literal_eval(value.strip())
    return name, cls(**kwargs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--kernel", choices=["v10", "v9"], default="v10")
    ap.add_argument("variants", nargs="*", help="NAME=key=value,... (StreamConfig / KernelConfig fields)")
    args = ap.parse_args()
    spec = get_model(args.model)
    cls, build = (StreamConfig, compile_v10) if args.kernel == "v10" else (KernelConfig, compile_v9)
    for vname, cfg in [("default", cls())] + [parse_variant(v, cls) for v in args.variants]:
        _, res = build(spec.config, spec.max_seq_len, cfg)
        print(f"{vname:12s} {res}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
