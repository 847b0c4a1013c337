"""Compile the megakernel for sm_90 on a machine without a GPU and print registers, spill stack and shared memory.

Triton ships ptxas and cuobjdump, so a kernel change can be checked for register pressure before it spends device
time (perf-notes v7: the preloads that spilled were the ones that were slow). Each extra argument adds a variant:
NAME=KernelConfig keyword arguments, e.g.

    python scripts/compile_check.py --model llama-1b ns3=num_stages=3 warm=warm_o=True,warm_gu=32
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.gpu import interpreter as mk
from synth.lowering.models import get_model

#: Types of the interpreter's runtime arguments (everything else is a constexpr from `kernel_constexprs`).
ARG_TYPES = {
    "ins_ptr": "*i32", "waits_ptr": "*i32", "sigs_ptr": "*i32", "qoff_ptr": "*i32", "qitems_ptr": "*i32",
    "counters_ptr": "*i32", "err_ptr": "*i32", "trace_ptr": "*i64", "smid_ptr": "*i32", "rt_ptr": "*i32",
    "embed_ptr": "*bf16", "attn_norm_ptr": "*fp32", "wqkv_ptr": "*bf16", "wo_ptr": "*bf16", "mlp_norm_ptr": "*fp32",
    "wg_ptr": "*bf16", "wu_ptr": "*bf16", "wd_ptr": "*bf16", "final_norm_ptr": "*fp32", "lm_head_ptr": "*bf16",
    "x_ptr": "*fp32", "q_ptr": "*fp32", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "opart_ptr": "*fp32",
    "lse_ptr": "*fp32", "attn_ptr": "*fp32", "act_ptr": "*fp32", "logits_ptr": "*fp32", "cos_ptr": "*fp32",
    "sin_ptr": "*fp32", "timeout_ns": "i64",
}


def parse_variant(text: str) -> tuple[str, mk.KernelConfig]:
    """'name=k1=v1,k2=v2' -> (name, KernelConfig(k1=v1, k2=v2)); values are Python literals."""
    name, _, body = text.partition("=")
    kwargs = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        kwargs[key.strip()] = ast.literal_eval(value.strip())
    return name, mk.KernelConfig(**kwargs)


def resource_usage(cubin: bytes) -> str:
    """cuobjdump's REG / STACK / SHARED line of a cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return " ".join(line.strip() for line in out.splitlines() if "REG:" in line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("variants", nargs="*", help="NAME=key=value,... (KernelConfig fields)")
    args = ap.parse_args()
    spec = get_model(args.model)
    names = list(inspect.signature(mk._megakernel.fn).parameters)
    variants = [("default", mk.KernelConfig())] + [parse_variant(v) for v in args.variants]
    for vname, kcfg in variants:
        consts = mk.kernel_constexprs(spec.config, spec.max_seq_len, kcfg, False)
        warps = consts.pop("num_warps")
        consts.pop("num_stages")
        sig = {n: ARG_TYPES[n] if n in ARG_TYPES else "constexpr" for n in names}
        src = ASTSource(mk._megakernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in sig if sig[n].startswith("*")})
        t = time.time()
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
        print(f"{vname:12s} {resource_usage(kernel.asm['cubin'])} | triton shared {kernel.metadata.shared} B | "
              f"compiled in {time.time() - t:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
