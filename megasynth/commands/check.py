"""`synth check --weights DIR`: the megakernel path against Hugging Face transformers on one checkpoint.

Both sides decode greedily from the same fixed prompt for `--tokens` steps, each feeding back its own tokens: the
megakernel path lowers the checkpoint's config (its config.json decides the architecture) into a schedule and runs it
instruction by instruction on the CPU executor, from weights loaded by `megasynth.kernels.weights`; transformers runs
`AutoModelForCausalLM` in fp32 with eager attention. Per step the relative L2 error of the fp32 logits and both
tokens are printed. Exit 0 when every step agrees within `REL_L2` and the tokens are identical, 1 otherwise, 2 on bad
input (missing folder, no config.json, a config the megakernel cannot run: the message names the file and the key).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import click

from megasynth.ir.errors import ScheduleError

#: Agreement bound on the fp32 logits, relative L2 per step.
REL_L2 = 1e-4
#: Prompt length when none is given; the fixed prompt is `default_prompt`.
PROMPT_LEN = 4


def default_prompt(vocab_size: int, n: int = PROMPT_LEN) -> list[int]:
    """A fixed prompt of `n` token ids spread over the vocabulary (no tokenizer needed)."""
    return [(1 + 7919 * i) % vocab_size for i in range(n)]


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


def megakernel_runner(prog, weights, max_seq_len: int, seed: int) -> Callable[[int, int], object]:  # noqa: ANN001
    """A function (token, pos) -> fp32 logits [V] that runs one decode step of the resolved schedule `prog` on the
    CPU executor, keeping the KV cache between calls. This is where a CUDA run would plug in the GPU interpreter
    (megasynth.kernels.gpu) instead; on any machine the CPU executor is the reference-exact path."""
    from megasynth.kernels.cpu_executor import run_program
    from megasynth.kernels.reference import new_kv_cache

    k_cache, v_cache = new_kv_cache(prog.geometry.cfg, max_seq_len)

    def step(token: int, pos: int):  # noqa: ANN202 (a torch tensor; torch is imported lazily)
        return run_program(prog, weights, k_cache, v_cache, token, pos, seed=seed)

    return step


def _hf_runner(folder: Path) -> Callable[[list[int]], object]:
    """A function tokens -> fp32 logits [V] of the last token, by transformers (fp32, eager attention)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the comparison table is the output
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    model.eval()

    def logits(tokens: list[int]):  # noqa: ANN202
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0, -1].float()

    return logits


@click.command("check")
@click.option("--weights", "weights_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="A Hugging Face checkpoint folder (config.json and safetensors).")
@click.option("--tokens", "n_tokens", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="Greedy decode steps to compare.")
@click.option("--prompt", default=None, help="Comma-separated prompt token ids (default: a fixed prompt of "
                                             f"{PROMPT_LEN} ids).")
@click.option("--workers", type=click.IntRange(1, 4096), default=8, show_default=True,
              help="Workers of the lowered schedule.")
@click.option("--seed", type=int, default=0, show_default=True, help="The CPU executor's interleaving seed.")
def check(weights_dir: Path, n_tokens: int, prompt: str | None, workers: int, seed: int) -> None:
    """Decode a checkpoint with the megakernel path and with transformers side by side; exit 0 when the fp32 logits
    agree within rel L2 1e-4 and the greedy tokens are identical."""
    from megasynth.ir.program import resolve
    from megasynth.kernels.weights import WeightsError, load_hf_weights
    from megasynth.lowering.lower import lower
    from megasynth.lowering.models import ModelNotFound, spec_from_checkpoint
    from megasynth.lowering.strategy import Strategy

    try:
        spec = spec_from_checkpoint(weights_dir)
    except ModelNotFound as exc:
        _fail(str(exc))
    cfg = spec.config
    try:
        tokens = default_prompt(cfg.vocab_size) if prompt is None else [int(t) for t in prompt.split(",")]
    except ValueError:
        _fail(f"--prompt {prompt!r}: not a comma-separated list of token ids")
    bad = [t for t in tokens if not 0 <= t < cfg.vocab_size]
    if not tokens or bad:
        _fail(f"--prompt: token ids must lie in [0, {cfg.vocab_size}) and there must be one at least")
    seq = len(tokens) + n_tokens
    if spec.max_position_embeddings is not None and seq > spec.max_position_embeddings:
        _fail(f"--tokens: {seq} positions exceed max_position_embeddings = {spec.max_position_embeddings}")
    spec = spec_from_checkpoint(weights_dir, max_seq_len=seq)
    try:
        weights = load_hf_weights(weights_dir, cfg)
        prog = resolve(lower(spec, workers, Strategy(attn_splits=2)))
    except (WeightsError, ScheduleError) as exc:
        _fail(str(exc))
    try:
        theirs_of = _hf_runner(weights_dir)
    except Exception as exc:  # noqa: BLE001 (transformers raises many types for a folder it cannot load)
        _fail(f"{weights_dir}: transformers cannot load the checkpoint: {type(exc).__name__}: {exc}")

    ours_step = megakernel_runner(prog, weights, seq, seed)
    ours_seq, theirs_seq = list(tokens), list(tokens)
    for pos, t in enumerate(tokens[:-1]):  # prefill, one decode step per prompt token
        ours_step(t, pos)
    ok = True
    click.echo(f"{weights_dir}: {spec.description}; prompt {tokens}; {n_tokens} greedy steps; "
               f"{len(prog.ids)} instructions on {workers} workers (CPU executor) vs transformers fp32 eager")
    click.echo(f"{'step':>4}  {'pos':>4}  {'rel L2':>9}  {'ours':>7}  {'hf':>7}")
    for step in range(n_tokens):
        pos = len(ours_seq) - 1
        ours = ours_step(ours_seq[-1], pos)
        theirs = theirs_of(theirs_seq)
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
