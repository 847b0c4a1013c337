"""Compile the interpreters for sm_90 on a machine without a GPU, and read their registers, spill stack and shared
memory: Triton ships ptxas and cuobjdump, so a kernel change can be checked for register pressure before it spends
device time (docs/perf-notes.md: the preloads that spilled were the ones that were slow). Its nvdisasm gives the
machine code too: `sass_loops` counts each innermost loop's instructions (what a loop bound by issue costs an
iteration) and estimates its cycles from its dependency chains (what a loop bound by latency costs: long-context
attention, docs/perf-notes.md)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megasynth.ir.model import ModelConfig

#: Types of the runtime arguments of both interpreters (everything else is a constexpr).
ARG_TYPES = {
    "ins_ptr": "*i32", "waits_ptr": "*i32", "sigs_ptr": "*i32", "qoff_ptr": "*i32", "qitems_ptr": "*i32",
    "counters_ptr": "*i32", "err_ptr": "*i32", "trace_ptr": "*i64", "smid_ptr": "*i32", "rt_ptr": "*i32",
    "embed_ptr": "*bf16", "attn_norm_ptr": "*fp32", "wqkv_ptr": "*bf16", "wo_ptr": "*bf16", "mlp_norm_ptr": "*fp32",
    "wg_ptr": "*bf16", "wu_ptr": "*bf16", "wd_ptr": "*bf16", "final_norm_ptr": "*fp32", "lm_head_ptr": "*bf16",
    "bqkv_ptr": "*fp32", "qk_norm_ptr": "*fp32",
    "x_ptr": "*fp32", "q_ptr": "*fp32", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "opart_ptr": "*fp32",
    "lse_ptr": "*fp32", "attn_ptr": "*fp32", "act_ptr": "*fp32", "logits_ptr": "*fp32", "cos_ptr": "*fp32",
    "sin_ptr": "*fp32", "qk_sq_ptr": "*fp32", "k_new_ptr": "*fp32", "vs_ptr": "*bf16", "timeout_ns": "i64",
    "seq_splits": "i32",
}
SM90 = GPUTarget("cuda", 90, 32)


@dataclass(frozen=True)
class Resources:
    """What ptxas allocated for one compiled kernel."""

    regs: int
    stack: int  # bytes of stack frame: non-zero means spills (or local arrays)
    shared: int  # bytes of shared memory the launch asks for (Triton's metadata: static + dynamic)
    seconds: float

    def __str__(self) -> str:
        return f"REG:{self.regs} STACK:{self.stack} shared {self.shared} B | compiled in {self.seconds:.0f} s"


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _cubin_tool(kernel: Any, tool: str, *args: str) -> str:
    """The output of one of Triton's bundled CUDA tools run on the kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([_tool(tool), *args, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def resources(kernel: Any, seconds: float = 0.0) -> Resources:
    """Registers and stack of a compiled kernel's cubin (cuobjdump), and its shared memory."""
    out = _cubin_tool(kernel, "cuobjdump", "-res-usage")
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    regs, stack = (int(re.search(rf"{k}:(\d+)", line).group(1)) for k in ("REG", "STACK"))  # type: ignore[union-attr]
    return Resources(regs, stack, int(kernel.metadata.shared), seconds)


#: Rough Hopper result latencies in cycles by opcode family for `SassLoop.cycles`; everything else 5. Public figures of
#: the order of what microbenchmarks report, not measured here: the model ranks loops, it does not time them.
LATENCY = {"HMMA": 32, "LDS": 33, "LDG": 400, "SHFL": 27, "MUFU": 20, "BAR": 20, "SYNCS": 20, "MEMBAR": 20}
_PRED = re.compile(r"^!?U?P(T|\d+)$")
_REG = re.compile(r"\bR(\d+)\b")
_GUARD = re.compile(r"^@!?U?P\w+\s+")  # an instruction's predicate guard, e.g. `@!P4 `


def _dataflow(text: str) -> tuple[str, list[int], list[int]]:
    """(opcode, registers written, registers read) of one SASS instruction; predicates and uniform registers are
    left out. The destination is the first operand when it is a register (SHFL: the second, after its predicate
    out); a .64 / .128 / .WIDE result spans 2 / 4 / 2 registers."""
    op, _, rest = _GUARD.sub("", text).partition(" ")
    operands = [o.strip() for o in rest.split(",")] if rest.strip() else []
    k = 1 if op.startswith("SHFL") and operands and _PRED.match(operands[0]) else 0
    dst: list[int] = []
    if len(operands) > k and (m := re.fullmatch(r"-?R(\d+)(\.reuse)?", operands[k])):
        width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
        dst = list(range(int(m.group(1)), int(m.group(1)) + width))
        operands = operands[:k] + operands[k + 1:]
    return op, dst, [int(r) for o in operands for r in _REG.findall(o)]


@dataclass(frozen=True)
class SassLoop:
    """One innermost loop of a kernel's machine code: from its head to its backward branch."""

    start: int  # byte address of the loop head
    end: int  # byte address of the backward branch
    ops: Counter[str]  # opcode (with modifiers, without a predicate) -> instructions of one iteration's body
    body: tuple[str, ...] = field(default=(), compare=False, repr=False)  # the iteration's instructions, in order

    @property
    def size(self) -> int:
        return sum(self.ops.values())

    def has(self, prefixes: list[str]) -> bool:
        """Whether the body holds an instruction starting with each of `prefixes` (e.g. MUFU.EX2, LDS)."""
        return all(any(op.startswith(p) for op in self.ops) for p in prefixes)

    def cycles(self, warps: int = 2, iterations: int = 4) -> float:
        """Estimated cycles an iteration takes on one scheduler running `warps` warps of this loop: each cycle one
        instruction issues, in order within a warp, once the registers it reads are ready (`LATENCY`). Fewer
        instructions do not make a loop faster when its dependency chains are what sets the pace: the model
        says which (the base-2 softmax in docs/perf-notes.md: llama-1b's attention loop 1140 -> 853 cycles,
        llama-8b's 1292 -> 1618; measured faster and slower). It leaves out the mbarrier waits, the CTA barriers'
        cost and the tensor pipe's throughput: on a batch's attention loop (mma.sync) three changes it rated 8-20 %
        faster traced the same or slower, so measure such a loop before trusting it."""
        flow = [_dataflow(t) for t in self.body]
        if not flow:
            return 0.0
        lat = [next((v for k, v in LATENCY.items() if op.startswith(k)), 5) for op, _, _ in flow]
        total = len(flow) * iterations
        pc = [0] * warps
        ready: list[dict[int, int]] = [{} for _ in range(warps)]
        t = 0
        while min(pc) < total:
            for w in sorted(range(warps), key=lambda w: pc[w]):
                if pc[w] >= total:
                    continue
                i = pc[w] % len(flow)
                _, dst, src = flow[i]
                if all(ready[w].get(r, 0) <= t for r in src):
                    for r in dst:
                        ready[w][r] = t + lat[i]
                    pc[w] += 1
                    break
            t += 1
        return t / iterations

    def __str__(self) -> str:
        mix = ", ".join(f"{op} {n}" for op, n in self.ops.most_common(16)) + (", ..." if len(self.ops) > 16 else "")
        est = f", ~{self.cycles():.0f} cycles (2 warps)" if self.body else ""
        return f"loop {self.start:#x}-{self.end:#x}: {self.size} instructions{est} ({mix})"


_SASS_INS = re.compile(r"\s*/\*([0-9a-f]+)\*/\s*(.*?)\s*;")
_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"BRA\s+.*`\((\.L_x_\d+)\)")


def sass(kernel: Any) -> str:
    """The kernel's machine code as nvdisasm prints it."""
    return _cubin_tool(kernel, "nvdisasm", "-c")


def sass_loops(text: str) -> list[SassLoop]:
    """The innermost loops (no other loop inside) of nvdisasm output: every backward branch to a label before it."""
    ins: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        if m := _SASS_LABEL.match(line):
            labels[m.group(1)] = len(ins)
        elif m := _SASS_INS.match(line):
            ins.append((int(m.group(1), 16), m.group(2)))
    spans = []
    for i, (_, text_i) in enumerate(ins):
        m = _SASS_BRANCH.search(text_i)
        if m and labels.get(m.group(1), i + 1) <= i:
            spans.append((labels[m.group(1)], i))
    inner = [(a, b) for a, b in spans if not any((c, d) != (a, b) and a <= c and d <= b for c, d in spans)]
    return [SassLoop(ins[a][0], ins[b][0], Counter(_GUARD.sub("", t).split()[0] for _, t in ins[a:b + 1]),
                     tuple(t for _, t in ins[a:b + 1]))
            for a, b in sorted(set(inner))]


def _compile(fn: Any, source_cls: Any, consts: dict[str, Any], types: dict[str, str], num_warps: int,
             options: dict[str, Any]) -> tuple[Any, Resources]:
    import time

    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: types.get(n, "constexpr") for n in names}
    src = source_cls(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                     attrs={(names.index(n),): [["tt.divisibility", 16]] for n in sig if sig[n].startswith("*")})
    t = time.time()
    kernel = triton.compile(src, target=SM90, options={"num_warps": num_warps, **options})
    return kernel, resources(kernel, time.time() - t)


def compile_v9(c: ModelConfig, max_seq_len: int, config: Any, batch: int = 1) -> tuple[Any, Resources]:
    """Interpreter v9 (`KernelConfig`) for sm_90 (the build for `batch` sequences per step)."""
    from megasynth.kernels.gpu import v9

    consts = v9.kernel_constexprs(c, max_seq_len, config, False, batch)
    warps = consts.pop("num_warps")
    consts.pop("num_stages")
    opts = {"num_stages": 1} | ({"maxnreg": consts.pop("maxnreg")} if "maxnreg" in consts else {})
    return _compile(v9.v9_megakernel, ASTSource, consts, ARG_TYPES, warps, opts)


def compile_v10(c: ModelConfig, max_seq_len: int, config: Any, trace: bool = False, batch: int = 1
                ) -> tuple[Any, Resources]:
    """Interpreter v10 (`StreamConfig`) for sm_90, its TMA descriptors typed as the host builds them (the
    trace-enabled build with `trace`; the build for `batch` sequences per step)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from megasynth.kernels.gpu import stream

    consts = stream.stream_constexprs(c, max_seq_len, config, trace, batch)
    geo = stream.stream_geometry(c, config, batch)
    wdesc = "tensordesc<bf16{},{!r}>".format(*stream.weight_box(geo))
    qdesc = "tensordesc<bf16{},{!r}>".format(*stream.weight_box(geo, qkv=True))
    kvdesc = f"tensordesc<bf16[{consts['BTK']}, {geo['KVW']}],{stream.kv_box_layout(geo)!r}>"
    types = {**ARG_TYPES, **{d: wdesc for d in ("d_o", "d_g", "d_u", "d_d", "d_lm")}, "d_qkv": qdesc, "d_k": kvdesc,
             "d_v": kvdesc}
    if geo["ACT_BF16"]:  # as `Megakernel` allocates them
        types.update(attn_ptr="*bf16", act_ptr="*bf16")
    if geo["X_DTYPE"] != "fp32":
        types.update(x_ptr=f"*{geo['X_DTYPE']}")
    return _compile(stream.stream_megakernel, GluonASTSource, consts, types, consts["num_warps"], {})
