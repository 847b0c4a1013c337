"""`synth check --weights DIR`: the megakernel path against Hugging Face transformers on one checkpoint.

Both sides decode greedily from the same fixed prompt for `--tokens` steps, each feeding back its own tokens (the
last generated token is compared, never fed back, so a prompt of P tokens takes positions 0..P+N-2): the
megakernel path lowers the checkpoint's config (its config.json decides the architecture) into a schedule and runs it
from weights loaded by `megasynth.kernels.weights`; transformers runs the checkpoint in fp32 with eager attention. Per
step the relative L2 error of the fp32 logits and both tokens are printed. Exit 0 when every step agrees within
`REL_L2` and the tokens are identical, 1 otherwise, 2 on bad input (missing folder, no config.json, a config the
megakernel cannot run: the message names the file and the key; a checkpoint holding NaN or inf, named by tensor, or
one whose logits come out non-finite on both sides: nothing can be compared).

Where the megakernel path runs (`--device`, default: the GPU when CUDA is available):
- `cpu`: the CPU executor, instruction by instruction, in fp32 with the checkpoint's weights as they are; transformers
  runs the same fp32 weights on the CPU.
- `cuda`: the GPU interpreter (`megasynth.kernels.gpu.Megakernel`), which computes in fp32 but reads its matrices
  (embedding, projections, LM head) in bf16 and keeps the KV cache in bf16 (norm weights and biases stay fp32).
  transformers then runs, on the GPU in fp32 (TF32 off), with the very numbers the kernel sees: its 2-D weights
  rounded to bf16 and every new K and V rounded to bf16 as it enters the cache. Without that the bf16 rounding alone
  puts the logits ~2e-3 apart and the 1e-4 bound would say nothing; with it the CPU executor run on those numbers
  agrees with transformers to ~1e-6 (the GPU interpreter agrees with the reference to ~2e-6 on llama-1b), so a kernel
  bug still stands out. The GPU path has not been run yet: its test drives the command on the CPU with the CPU
  executor standing in for the Megakernel.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import click

from megasynth.commands import batch_option, max_seq_len_option
from megasynth.ir.errors import ScheduleError

#: Agreement bound on the fp32 logits, relative L2 per step.
REL_L2 = 1e-4
#: Prompt length when none is given; the fixed prompt is `default_prompt`.
PROMPT_LEN = 4


def default_prompt(vocab_size: int, n: int = PROMPT_LEN) -> list[int]:
    """A fixed prompt of `n` token ids spread over the vocabulary (no tokenizer needed)."""
    return [(1 + 7919 * i) % vocab_size for i in range(n)]


def _fail(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


def positions_fed(prompts: list[list[int]], n_tokens: int) -> int:
    """How many positions (0..n-1) the check feeds: every sequence steps from position 0 up to the longest prompt's
    last token and then through `n_tokens` greedy steps, the last of whose tokens is compared but never fed back
    (so the longest prompt plus `n_tokens`, less one). The KV cache and the schedule need exactly these."""
    return max(map(len, prompts)) + n_tokens - 1


def nonfinite_weights(weights: dict[str, Any], cfg: Any) -> list[str]:
    """The checkpoint's tensors, by their Hugging Face names, that hold NaN or inf, each with how many: such a
    checkpoint makes both sides' logits non-finite, which is bad input, not a disagreement. Empty when all are
    finite (the common case costs one pass over the loaded weights)."""
    import torch

    from megasynth.kernels.weights import to_hf_state_dict

    if all(bool(torch.isfinite(t).all()) for t in weights.values()):
        return []
    out = []
    for name, t in to_hf_state_dict(weights, cfg).items():
        counts = [f"{n} {kind}" for n, kind in ((int(t.isnan().sum()), "NaN"), (int(t.isinf().sum()), "inf")) if n]
        if counts:
            out.append(f"{name} ({', '.join(counts)} of {t.numel()})")
    return out


def _refuse_nonfinite(ours: Any, theirs: Any, folder: Path | None, where: str) -> None:
    """Exit 2 when both sides' logits hold NaN or inf at `where`: with finite weights (checked before), the
    checkpoint's activations overflow on this prompt, and the two sides cannot be compared. One side alone
    non-finite stays a disagreement (exit 1)."""
    import torch

    if not bool(torch.isfinite(theirs).all()) and not bool(torch.isfinite(ours).all()):
        _fail(f"{folder or 'the checkpoint'}: non-finite logits from the reference (transformers) and the megakernel "
              f"path alike at {where}: the weights are finite, so the activations overflow on this checkpoint; "
              "nothing to compare")


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def pick_device(requested: str, cuda: bool) -> str:
    """The device of the megakernel path: `auto` is the GPU when CUDA is available, else the CPU; `cuda` without
    CUDA raises ValueError (the message is the command's)."""
    if requested == "auto":
        return "cuda" if cuda else "cpu"
    if requested == "cuda" and not cuda:
        raise ValueError("--device cuda: CUDA is not available here (pass --device cpu for the CPU executor)")
    return requested


def _gpu_megakernel(schedule, weights, max_seq_len: int):  # noqa: ANN001, ANN202 (a Megakernel; lazy imports)
    """The GPU interpreter on the schedule (it casts the matrices to bf16 on the GPU itself)."""
    from megasynth.kernels.gpu import Megakernel

    return Megakernel(schedule, weights, max_seq_len=max_seq_len)


def megakernel_runner(schedule, weights, max_seq_len: int, seed: int,  # noqa: ANN001
                      device: str = "cpu") -> Callable[[int, int], object]:
    """A function (token, pos) -> fp32 logits [V] on the CPU that runs one decode step of `schedule`, keeping the KV
    cache between calls: on the GPU interpreter when `device` is "cuda" (bf16 matrices and KV cache, see the module
    docstring; `seed` unused), else on the CPU executor (the interleaving drawn from `seed`)."""
    if device == "cuda":
        mk = _gpu_megakernel(schedule, weights, max_seq_len)

        def gpu_step(token: int, pos: int):  # noqa: ANN202 (a torch tensor; torch is imported lazily)
            return mk.step(token, pos).float().cpu()

        return gpu_step
    from megasynth.ir.program import resolve
    from megasynth.kernels.cpu_executor import run_program
    from megasynth.kernels.reference import new_kv_cache

    prog = resolve(schedule)
    k_cache, v_cache = new_kv_cache(prog.geometry.cfg, max_seq_len)

    def step(token: int, pos: int):  # noqa: ANN202
        return run_program(prog, weights, k_cache, v_cache, token, pos, seed=seed)

    return step


def _hf_runner(folder: Path, kernel_numerics: bool = False, device: str = "cpu") -> Callable[[list[int]], object]:
    """A function tokens -> fp32 logits [V] (on the CPU) of the last token, by transformers (fp32, eager attention)
    on `device`. With `kernel_numerics`, the GPU interpreter's numbers: 2-D weights rounded to bf16, K and V rounded
    to bf16 as they enter the cache."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the comparison table is the output
    torch.set_float32_matmul_precision("highest")  # no TF32: an fp32 oracle
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    model.to(device).eval()

    class Bf16Cache(DynamicCache):
        """The kernel's bf16 KV cache: what attention reads back is the bf16 rounding of each new K and V."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            return super().update(key_states.to(torch.bfloat16).float(), value_states.to(torch.bfloat16).float(),
                                  layer_idx, *args, **kwargs)

    if kernel_numerics:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:  # the matrices; a tied head is the embedding, rounded once or twice alike
                    p.copy_(p.to(torch.bfloat16).float())
    # the cache keyword: `cache` in recent transformers, `past_key_values` before
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def logits(tokens: list[int]):  # noqa: ANN202
        extra = {kwarg: Bf16Cache(), "use_cache": True} if kernel_numerics else {}
        with torch.no_grad():
            return model(torch.tensor([tokens], device=device), **extra).logits[0, -1].float().cpu()

    return logits


@click.command("check")
@click.option("--weights", "weights_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="A Hugging Face checkpoint folder (config.json and safetensors).")
@click.option("--tokens", "n_tokens", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="Greedy tokens generated and compared after the prompt; with --batch, after the longest prompt: "
                   "a sequence with a shorter prompt starts generating earlier and compares as many more (prompts of "
                   "4, 5, 6 tokens and --tokens 2: 4, 3 and 2 tokens).")
@click.option("--prompt", default=None, help="Comma-separated prompt token ids (default: a fixed prompt of "
                                             f"{PROMPT_LEN} ids; with --batch, sequence b's is {PROMPT_LEN} + b ids "
                                             "long); prompts of a batch separated by ';'.")
@click.option("--workers", type=click.IntRange(1, 4096), default=8, show_default=True,
              help="Workers of the lowered schedule.")
@click.option("--seed", type=int, default=0, show_default=True, help="The CPU executor's interleaving seed.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the megakernel path runs: cuda = the GPU interpreter (bf16 matrices and KV cache; "
                   "transformers then gets the same bf16 roundings; not yet run on a GPU), cpu = the CPU executor "
                   "(fp32), auto = cuda when available.")
@max_seq_len_option("the positions fed: the longest prompt plus --tokens, less one, since the last generated "
                    "token is never fed back")
@batch_option("the batched schedule on the CPU executor; transformers decodes each sequence alone")
def check(weights_dir: Path, n_tokens: int, prompt: str | None, workers: int, seed: int, device: str,
          max_seq_len: int | None, batch: int) -> None:
    """Decode a checkpoint with the megakernel path and with transformers side by side; exit 0 when the fp32 logits
    agree within rel L2 1e-4 and the greedy tokens are identical. On the GPU, transformers runs with the kernel's
    bf16-rounded matrices and KV cache (see `--device`)."""
    from megasynth.ir.model import DoesNotFit
    from megasynth.ir.program import resolve
    from megasynth.kernels.weights import WeightsError, load_hf_weights
    from megasynth.lowering.lower import lower
    from megasynth.lowering.models import MaxSeqLenError, ModelNotFound, spec_from_checkpoint, with_max_seq_len
    from megasynth.lowering.strategy import Strategy

    if batch > 1 and device == "cuda":
        _fail("--batch > 1 is checked on the CPU executor only so far (pass --device cpu); on the GPU, the "
              "interpreters' batches are checked by the GPU tests")
    try:
        device = "cpu" if batch > 1 else pick_device(device, _cuda_available())
    except ValueError as exc:
        _fail(str(exc))
    try:
        spec = spec_from_checkpoint(weights_dir)
    except ModelNotFound as exc:
        _fail(str(exc))
    cfg = spec.config
    try:
        prompts = ([default_prompt(cfg.vocab_size, PROMPT_LEN + b) for b in range(batch)] if prompt is None else
                   [[int(t) for t in part.split(",")] for part in prompt.split(";")])
    except ValueError:
        _fail(f"--prompt {prompt!r}: not a comma-separated list of token ids (prompts separated by ';')")
    if len(prompts) == 1:
        prompts *= batch
    if len(prompts) != batch:
        _fail(f"--prompt holds {len(prompts)} prompts; --batch {batch} needs 1 or {batch}")
    if any(not p or any(not 0 <= t < cfg.vocab_size for t in p) for p in prompts):
        _fail(f"--prompt: token ids must lie in [0, {cfg.vocab_size}) and there must be one at least")
    tokens = prompts[0]
    seq = positions_fed(prompts, n_tokens)
    fed = (f"the {seq} positions (0..{seq - 1}) that a prompt of {max(map(len, prompts))} tokens and --tokens "
           f"{n_tokens} feed")
    if spec.max_position_embeddings is not None and seq > spec.max_position_embeddings:
        _fail(f"--tokens: {fed} exceed max_position_embeddings = {spec.max_position_embeddings}")
    try:  # default: just the positions this check decodes
        spec = with_max_seq_len(spec, seq if max_seq_len is None else max_seq_len)
    except MaxSeqLenError as exc:
        _fail(str(exc))
    if spec.max_seq_len < seq:
        _fail(f"--max-seq-len {spec.max_seq_len} is below {fed}")
    try:
        weights = load_hf_weights(weights_dir, cfg)
        schedule = lower(replace(spec, batch=batch), workers, Strategy(attn_splits=2))
        prog = resolve(schedule)
    except (WeightsError, ScheduleError) as exc:
        _fail(str(exc))
    bad = nonfinite_weights(weights, cfg)
    if bad:
        _fail(f"{weights_dir}: the checkpoint holds non-finite weights, so both sides' logits would be too and "
              f"nothing can be compared: {'; '.join(bad)}")
    gpu = device == "cuda"
    try:
        theirs_of = _hf_runner(weights_dir, gpu, device)
    except Exception as exc:  # noqa: BLE001 (transformers raises many types for a folder it cannot load)
        _fail(f"{weights_dir}: transformers cannot load the checkpoint: {type(exc).__name__}: {exc}")
    if batch > 1:
        sys.exit(check_batch(prog, weights, prompts, n_tokens, seed, theirs_of, f"{weights_dir}: {spec.description}",
                             workers, folder=weights_dir))

    try:
        run_step = megakernel_runner(schedule, weights, spec.max_seq_len, seed, device)
    except (ScheduleError, DoesNotFit) as exc:  # a schedule the GPU interpreter cannot run, or a KV cache too large
        _fail(str(exc))

    def ours_step(token: int, pos: int):  # noqa: ANN202
        try:
            return run_step(token, pos)
        except RuntimeError as exc:  # the GPU interpreter's watchdog names the stuck worker and instruction
            click.echo(f"error: the megakernel path stopped at pos {pos}: {exc}", err=True)
            sys.exit(1)
    ours_seq, theirs_seq = list(tokens), list(tokens)
    for pos, t in enumerate(tokens[:-1]):  # prefill, one decode step per prompt token
        ours_step(t, pos)
    ok = True
    ours_how = "GPU interpreter, bf16 matrices and KV cache" if gpu else "CPU executor"
    hf_how = "fp32 eager, the same bf16 roundings, on the GPU" if gpu else "fp32 eager"
    click.echo(f"{weights_dir}: {spec.description}; prompt {tokens}; {n_tokens} greedy steps; "
               f"{len(prog.ids)} instructions on {workers} workers ({ours_how}) vs transformers {hf_how}")
    click.echo(f"{'step':>4}  {'pos':>4}  {'rel L2':>9}  {'ours':>7}  {'hf':>7}")
    for step in range(n_tokens):
        pos = len(ours_seq) - 1
        ours = ours_step(ours_seq[-1], pos)
        theirs = theirs_of(theirs_seq)
        _refuse_nonfinite(ours, theirs, weights_dir, f"step {step} (pos {pos})")
        err = float((ours - theirs).norm() / theirs.norm().clamp_min(1e-30))
        a, b = int(ours.argmax()), int(theirs.argmax())
        agree = err <= REL_L2 and a == b and ours_seq == theirs_seq
        ok &= agree
        click.echo(f"{step:>4}  {pos:>4}  {err:>9.2e}  {a:>7}  {b:>7}" + ("" if agree else "  MISMATCH"))
        ours_seq.append(a)
        theirs_seq.append(b)
    click.echo(f"tokens ours {ours_seq[len(tokens):]}")
    click.echo(f"tokens hf   {theirs_seq[len(tokens):]}")
    click.echo("agree" if ok else f"DISAGREE (bound: rel L2 <= {REL_L2:g} per step and identical tokens)")
    sys.exit(0 if ok else 1)


def check_batch(prog, weights, prompts: list[list[int]], n_tokens: int, seed: int,  # noqa: ANN001
                theirs_of: Callable[[list[int]], object], title: str, workers: int,
                folder: Path | None = None) -> int:
    """The batched schedule on the CPU executor against transformers, which decodes each sequence alone. All
    sequences step together from position 0; a sequence whose prompt is shorter starts generating earlier (so in one
    step some sequences read their prompt and others their own tokens) and each generates until the longest prompt
    plus `n_tokens`. Every generated step is compared; returns the exit code (0 agree, 1 differ). Logits that are
    non-finite on both sides exit 2 (bad input, `folder` named)."""
    from megasynth.kernels.cpu_executor import run_program
    from megasynth.kernels.reference import new_kv_cache

    geo = prog.geometry
    batch = len(prompts)
    k_cache, v_cache = new_kv_cache(geo.cfg, geo.max_seq_len, batch=batch)
    ours_seq = [list(p) for p in prompts]
    theirs_seq = [list(p) for p in prompts]
    steps = max(map(len, prompts)) - 1 + n_tokens
    click.echo(f"{title}; {batch} sequences, prompts of {', '.join(str(len(p)) for p in prompts)} tokens; "
               f"{len(prog.ids)} instructions on {workers} workers (CPU executor, batch {batch}) vs transformers fp32 "
               "eager, one sequence at a time")
    click.echo(f"{'step':>4}  {'seq':>3}  {'pos':>4}  {'rel L2':>9}  {'ours':>7}  {'hf':>7}")
    ok = True
    for pos in range(steps):
        logits = run_program(prog, weights, k_cache, v_cache, [s[pos] for s in ours_seq], [pos] * batch, seed=seed)
        for b in range(batch):
            if pos < len(prompts[b]) - 1:  # still reading its prompt
                continue
            ours = logits[b]
            theirs = theirs_of(theirs_seq[b])
            _refuse_nonfinite(ours, theirs, folder, f"pos {pos} of sequence {b}")
            err = float((ours - theirs).norm() / theirs.norm().clamp_min(1e-30))
            a, h = int(ours.argmax()), int(theirs.argmax())
            agree = err <= REL_L2 and a == h and ours_seq[b] == theirs_seq[b]
            ok &= agree
            click.echo(f"{pos:>4}  {b:>3}  {pos:>4}  {err:>9.2e}  {a:>7}  {h:>7}" + ("" if agree else "  MISMATCH"))
            ours_seq[b].append(a)
            theirs_seq[b].append(h)
    for b in range(batch):
        click.echo(f"seq {b}: tokens ours {ours_seq[b][len(prompts[b]):]}, hf {theirs_seq[b][len(prompts[b]):]}")
    click.echo("agree" if ok else f"DISAGREE (bound: rel L2 <= {REL_L2:g} per step and identical tokens)")
    return 0 if ok else 1
