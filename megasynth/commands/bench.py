"""`synth bench` and `synth generate`: click commands over megasynth.measure (attached by megasynth.cli's
`_register()`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import click

from megasynth.commands import (
    batch_option,
    int_list,
    kernel_options_config,
    kernel_options_option,
    max_seq_len_option,
    model_spec,
)
from megasynth.ir.errors import ScheduleError

if TYPE_CHECKING:
    from megasynth.ir.model import ModelConfig
    from megasynth.kernels.weights import Weights
    from megasynth.lowering.models import ModelSpec


def _fail(message: str, code: int = 2) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _ctx_values(ctx: tuple[str, ...], extra: tuple[int, ...]) -> list[int]:
    out = [n for item in ctx for n in int_list(item, "--ctx")]
    out.extend(extra)
    return list(dict.fromkeys(out))


@click.command("bench")
@click.option("--model", "model_name", default="llama-1b", show_default=True,
              help="A model name (synth models) or a Hugging Face checkpoint folder, whose weights are used unless "
                   "--weights is given.")
@click.option("--schedule", "schedule_file", type=click.Path(dir_okay=False),
              help="Schedule .json or .json.gz for the megakernel (default: the naive lowering for this GPU's SM "
                   "count), or a schedule set (synth search --ctx-ranges): each ctx runs the member whose range "
                   "holds its position.")
@click.option("--ctx", multiple=True, metavar="N[,N...]",
              help="Context length(s) to measure; repeat, comma-separate, or list after --ctx: --ctx 128 1024 4096. "
                   "[default: 1024, or max_seq_len if smaller]")
@click.argument("extra_ctx", nargs=-1, type=int, metavar="")
@max_seq_len_option()
@click.option("--batch", "batch", default="1", show_default=True, metavar="N[,N...]",
              help="Sequences decoded together per step, 1-16 (one KV cache slot and position each): every sequence "
                   "at the same --ctx, each with its own random KV history and token; the table adds tokens/s = N / "
                   "step time. The variants that decode one sequence "
                   "per step (hf_eager, per_op_graph) are reported as skipped. Several (--batch 1,2,4,8,16): one "
                   "run each, one JSON each (the --json path with {batch}, else _batch<N> before its suffix), then "
                   "a table of tokens/s by batch; --schedule then needs {batch} in its path.")
@click.option("--reps", type=click.IntRange(1, 100000), default=100, show_default=True,
              help="Timed repetitions per variant.")
@click.option("--warmup", type=click.IntRange(0, 10000), default=10, show_default=True)
@click.option("--json", "json_file", type=click.Path(dir_okay=False), default="bench.json", show_default=True,
              help="Where to write the results (atomically); a path with {ctx} writes one file per ctx.")
@click.option("--variants", default=None, metavar="A,B,...",
              help="Only these variants: torch_eager, torch_graph, hf_eager, torch_bf16, torch_compile, "
                   "per_op_graph, megakernel, cpu_executor. [default: torch_bf16, torch_compile, per_op_graph, "
                   "megakernel; on --dry-run torch_eager, torch_bf16, torch_compile, megakernel, cpu_executor]")
@click.option("--compile-timeout", type=click.FloatRange(1, 3600), default=300.0, show_default=True,
              help="Seconds allowed for torch.compile + its timing (child process, killed past the limit).")
@click.option("--compile-mode", default="max-autotune-no-cudagraphs", show_default=True,
              type=click.Choice(["default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"]),
              help="torch.compile mode of the bf16 step: captured in a CUDA graph after compiling, except "
                   "max-autotune and reduce-overhead, whose own CUDA graphs (cudagraph trees) are replayed.")
@click.option("--flush-l2/--no-flush-l2", default=False, show_default=True,
              help="Overwrite 2x L2 between repetitions (outside the timed region).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights and KV history.")
@click.option("--weights", "weights_dir", type=click.Path(file_okay=False),
              help="Hugging Face safetensors checkpoint folder (default: the --model folder's, else random "
                   "weights, --seed).")
@click.option("--token", type=int, default=1, show_default=True, help="Token id decoded.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check the schedule's structure, coverage and deadlock-freedom before running it.")
@kernel_options_option(" Recorded in the JSON's settings.")
@click.option("--dry-run", is_flag=True, help="Run on the CPU (no CUDA needed): exercises the command; times mean "
                                              "nothing for the GPU.")
def bench(model_name: str, schedule_file: str | None, ctx: tuple[str, ...], extra_ctx: tuple[int, ...],
          max_seq_len: int | None, batch: str, reps: int,
          warmup: int, json_file: str, variants: str | None, compile_timeout: float, compile_mode: str,
          flush_l2: bool, seed: int,
          weights_dir: str | None, token: int, verify: bool, kernel_options: tuple[str, ...], dry_run: bool) -> None:
    """Time the decode step: the best plain PyTorch step (bf16 in a CUDA graph, and its torch.compile), per-op
    launches and the megakernel, against the bandwidth floor; print a table and write JSON."""
    from rich.console import Console

    batches = _batch_values(batch)
    several = len(batches) > 1
    if several and schedule_file and "{batch}" not in schedule_file:
        raise click.BadParameter(f"a schedule decodes one batch size; for --batch {batch} give a path with {{batch}} "
                                 f"(got {schedule_file})", param_hint="--schedule")
    console = Console(stderr=True)
    import torch

    device = "cuda"
    if dry_run:
        device = "cpu"
    elif not torch.cuda.is_available():
        _fail("CUDA is not available: `synth bench` measures on a GPU; pass --dry-run to exercise it on the CPU")
    if dry_run:
        console.print("[yellow]dry run on the CPU: GPU variants are skipped and the times say nothing about a GPU"
                      "[/yellow]")
    for b in batches:  # every batch's config, before anything runs
        kernel_options_config(kernel_options, model_name, max_seq_len, b, device)
    results = []
    for b in batches:
        spec = model_spec(model_name, max_seq_len, b)
        ctxs = _ctx_values(ctx, extra_ctx) or [min(1024, spec.max_seq_len)]
        sched = schedule_file.replace("{batch}", str(b)) if schedule_file else None
        path = _batch_path(json_file, b) if several or (json_file and "{batch}" in json_file) else json_file
        results.append(_bench_one(spec, sched, ctxs, path, console, reps=reps, warmup=warmup, seed=seed,
                                  weights_dir=weights_dir, token=token, device=device, variants=variants,
                                  compile_timeout=compile_timeout, compile_mode=compile_mode, flush_l2=flush_l2,
                                  verify=verify, kernel_options=list(kernel_options)))
    if several:
        from megasynth.measure.render import batch_table

        Console(width=None if sys.stdout.isatty() else 80).print(batch_table(results))


def _batch_values(text: str) -> list[int]:
    """`--batch`'s values: comma-separated whole numbers in 1..16, each once, in the order given."""
    out = int_list(text, "--batch", "a whole number")
    if not out:
        raise click.BadParameter("give at least one batch size", param_hint="--batch")
    for n in out:
        if not 1 <= n <= 16:
            raise click.BadParameter(f"{n} is not in 1..16", param_hint="--batch")
    return list(dict.fromkeys(out))


def _batch_path(json_file: str, batch: int) -> str:
    """One batch's JSON path: {batch} filled in, else _batch<N> before the suffix (bench.json -> bench_batch8.json)."""
    if "{batch}" in json_file:
        return json_file.replace("{batch}", str(batch))
    stem, dot, suffix = json_file.rpartition(".")
    return f"{stem}_batch{batch}.{suffix}" if dot and "/" not in suffix else f"{json_file}_batch{batch}"


def _bench_one(spec: ModelSpec, schedule_file: str | None, ctxs: list[int], json_file: str, console: Any,
               **kw: Any) -> dict[str, Any]:
    """One `synth bench` run (one batch size): measure, write its JSON (one per ctx with {ctx}), print its tables."""
    import torch
    from rich.console import Console

    from megasynth.atomic import write_json_atomic
    from megasynth.measure.bench import run_bench, split_by_ctx
    from megasynth.measure.options import BenchError, BenchOptions, ScheduleRejected
    from megasynth.measure.render import render

    variants = kw.pop("variants")
    # spec.name: a checkpoint folder's absolute path, which the compile child (another cwd) finds too
    opts = BenchOptions(model=spec.name, max_seq_len=spec.max_seq_len, schedule=schedule_file, ctxs=ctxs,
                        weights_dir=kw.pop("weights_dir") or spec.weights_dir, batch=spec.batch,
                        variants=[v.strip() for v in variants.split(",") if v.strip()] if variants else None,
                        compile_timeout_s=kw.pop("compile_timeout"), **kw)
    threads = torch.get_num_threads()
    if opts.device == "cpu":  # tiny CPU ops: one thread avoids OpenMP spin contention (restored after)
        torch.set_num_threads(1)
    from megasynth.kernels.gpu.timing import GpuHangError

    try:
        result = run_bench(opts, log=lambda s: console.print(f"[dim]{s}[/dim]"))
    except ScheduleError as exc:
        _fail(str(exc))
    except GpuHangError as exc:  # no JSON: nothing more could run on the GPU
        _fail(str(exc), 1)
    except BenchError as exc:
        _fail(str(exc), 1 if isinstance(exc, ScheduleRejected) else 2)
    finally:
        torch.set_num_threads(threads)
    if "{ctx}" in json_file:
        written = []
        for c, doc in split_by_ctx(result).items():
            written.append(json_file.replace("{ctx}", str(c)))
            write_json_atomic(written[-1], doc)
    else:
        written = [json_file]
        write_json_atomic(json_file, result)
    out = Console(width=None if sys.stdout.isatty() else 80)
    for item in render(result):
        out.print(item)
    click.echo(f"wrote {', '.join(written)} ({result['seconds']} s)", err=True)
    return result


def _prompt_tokens(values: str, batch: int, vocab_size: int) -> list[int]:
    """`--prompt-token`'s first tokens, one per sequence: a comma-separated list of 1 or `batch` values (one value v
    and batch N > 1: sequence b starts from v + b), each inside the vocabulary."""
    parsed = int_list(values, "--prompt-token")
    if len(parsed) == 1:
        parsed = [parsed[0] + b for b in range(batch)]
    elif len(parsed) != batch:
        raise click.BadParameter(f"{len(parsed)} first tokens for --batch {batch}: give one, or {batch} (one per "
                                 "sequence)", param_hint="--prompt-token")
    for token in parsed:
        if not 0 <= token < vocab_size:
            raise click.BadParameter(f"{token} is outside the vocabulary [0, {vocab_size})",
                                     param_hint="--prompt-token")
    return parsed


def _pick_backend(backend: str, batch: int, cuda: bool) -> str:
    """The backend that runs: auto = the megakernel on CUDA, else the PyTorch reference (said on stderr); the
    megakernel without CUDA exits 2."""
    if backend == "auto":
        backend = "megakernel" if cuda else "reference"
        if not cuda:
            click.echo("notice: no CUDA here: running the CPU PyTorch reference (kernels.reference.decode_batch), "
                       "not the megakernel", err=True)
    if backend == "megakernel" and not cuda:
        _fail("--backend megakernel needs CUDA")
    return backend


Step = Callable[[list[int], int], list[int]]  # each sequence's last token and the position -> its next tokens


def checked_schedule(spec: ModelSpec, schedule_file: str | None) -> Any:
    """The schedule (or schedule set) the megakernel would run for `spec` (default: the naive lowering), checked as
    `synth bench` checks it (it decodes this model, max_seq_len and batch; structure, coverage and deadlock pass),
    so that a wrong file is refused before anything runs: exit 2 on a bad file, 1 when the validator rejects it."""
    from megasynth.measure.bench import load_bench_schedule
    from megasynth.measure.options import BenchError, ScheduleRejected

    try:
        return load_bench_schedule(spec, schedule_file, verify=True)[0]
    except ScheduleError as exc:
        _fail(str(exc))
    except BenchError as exc:
        _fail(str(exc), 1 if isinstance(exc, ScheduleRejected) else 2)


def _megakernel_step(spec: ModelSpec, schedule: Any, weights: Weights,
                     firsts: list[int], config: Any = None) -> tuple[Step, str]:
    """The megakernel's greedy step over `spec.batch` sequences in lockstep on `schedule` (from `checked_schedule`; on
    interpreter config `config`, or its own choice), compiled and warmed up, and how it runs (for the rate line)."""
    import torch

    from megasynth.ir.model import DoesNotFit

    try:
        import megasynth.kernels.gpu as gpu

        mk = gpu.Megakernel(schedule, weights, max_seq_len=spec.max_seq_len, config=config)
        one = mk.batch == 1
        mk.step(firsts[0] if one else firsts, 0 if one else [0] * mk.batch)  # compile + warm up; position 0 is
        # written again, identically, below
        torch.cuda.synchronize()
    except (ScheduleError, DoesNotFit) as exc:
        _fail(str(exc))
    except RuntimeError as exc:  # residency refusal, watchdog timeout
        _fail(str(exc), 1)

    def step(tokens: list[int], pos: int) -> list[int]:
        if one:  # .item(): the host needs the token for the next step
            return [int(mk.step(tokens[0], pos).argmax())]
        return mk.step(tokens, [pos] * len(tokens)).argmax(-1).tolist()

    how = "megakernel (Megakernel.step: CUDA graph replay, then the watchdog check syncs)"
    if mk.schedule_set is not None:
        how += (f"; a schedule set of {len(mk.members)}, switching members at positions "
                f"{', '.join(str(b) for b in mk.schedule_set.bounds[:-1])}")
    return step, how


def _reference_step(cfg: ModelConfig, weights: Weights, tokens: int, batch: int, device: str) -> tuple[Step, str]:
    """The PyTorch reference's greedy step over `batch` sequences in lockstep, each with its own KV cache slot."""
    import torch

    from megasynth.kernels.reference import decode_batch, new_kv_cache

    # positions [0, tokens) are all it writes
    k, v = new_kv_cache(cfg, tokens, dtype=weights["embed"].dtype, device=device, batch=batch)

    def step(toks: list[int], pos: int) -> list[int]:
        logits: torch.Tensor = decode_batch(cfg, weights, k, v, toks, [pos] * len(toks))
        return logits.argmax(-1).tolist()

    return step, "PyTorch reference on the CPU" if device == "cpu" else "PyTorch reference"


@click.command("generate")
@click.option("--model", "model_name", default="llama-1b", show_default=True,
              help="A model name (synth models) or a Hugging Face checkpoint folder, whose weights are used unless "
                   "--weights is given.")
@click.option("--tokens", type=click.IntRange(1, 1 << 20), default=32, show_default=True,
              help="Tokens to generate (greedy), per sequence.")
@click.option("--schedule", "schedule_file", type=click.Path(dir_okay=False),
              help="Schedule .json or .json.gz (default: the naive lowering), or a schedule set (synth search "
                   "--ctx-ranges): each step runs the member whose range holds its position, switching as the "
                   "context grows.")
@click.option("--prompt-token", default="1", show_default=True, metavar="T[,T...]",
              help="The first token fed: with --batch N, N comma-separated values (one per sequence), or one value "
                   "T (sequence b starts from T + b).")
@click.option("--weights", "weights_dir", type=click.Path(file_okay=False),
              help="Hugging Face safetensors checkpoint folder (default: the --model folder's, else random "
                   "weights, --seed).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--backend", type=click.Choice(["auto", "megakernel", "reference"]), default="auto",
              show_default=True, help="auto = the megakernel on CUDA, else the PyTorch reference.")
@click.option("--check/--no-check", default=True, show_default=True,
              help="After the timed loop, replay the tokens through the PyTorch reference and count agreements.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Also write tokens and timing here.")
@max_seq_len_option()
@batch_option("greedy per sequence, all at the same position each step.")
@kernel_options_option()
def generate(model_name: str, tokens: int, schedule_file: str | None, prompt_token: str, weights_dir: str | None,
             seed: int, backend: str, check: bool, json_file: str | None, max_seq_len: int | None,
             batch: int, kernel_options: tuple[str, ...]) -> None:
    """Greedy decode loop of 1-16 sequences in lockstep on the megakernel (CUDA) or the PyTorch reference; prints
    each sequence's token ids and tokens/s (all sequences)."""
    import torch

    spec = model_spec(model_name, max_seq_len)
    cfg = spec.config
    weights_dir = weights_dir or spec.weights_dir  # --model DIR runs on the checkpoint's own weights
    if tokens > spec.max_seq_len:
        raise click.BadParameter(f"{tokens} exceeds max_seq_len {spec.max_seq_len} of {spec.name} (raise it with "
                                 "--max-seq-len)",
                                 param_hint="--tokens")
    firsts = _prompt_tokens(prompt_token, batch, cfg.vocab_size)
    cuda = torch.cuda.is_available()
    backend = _pick_backend(backend, batch, cuda)
    device = "cuda" if cuda and backend == "megakernel" else "cpu"
    from megasynth.lowering.models import with_batch

    # --schedule and --kernel-option are checked as `synth bench` checks them, before anything runs, whichever
    # backend runs: the kernel options for the device the megakernel would run on
    config = kernel_options_config(kernel_options, model_name, max_seq_len, batch, "cuda" if cuda else "cpu")
    schedule = checked_schedule(with_batch(spec, batch), schedule_file) if backend == "megakernel" or schedule_file \
        else None
    if backend != "megakernel" and (schedule_file or kernel_options):
        given = " and ".join(([f"--schedule {schedule_file}"] if schedule_file else [])
                             + ([f"--kernel-option {' '.join(kernel_options)}"] if kernel_options else []))
        click.echo(f"notice: {given}: checked against {spec.name} at batch {batch} but not used: the tokens come "
                   "from the PyTorch reference (kernels.reference.decode_batch) on the CPU, not the megakernel",
                   err=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    from megasynth.kernels.weights import WeightsError, model_weights

    try:
        weights = model_weights(cfg, weights_dir, seed=seed, dtype=dtype, device=device)
    except WeightsError as exc:
        _fail(str(exc))
    if backend == "megakernel":
        step, how = _megakernel_step(with_batch(spec, batch), schedule, weights, firsts, config)
    else:
        step, how = _reference_step(cfg, weights, tokens, batch, device)
    outs = [[first] for first in firsts]  # each sequence's first token, then its greedy tokens
    t = time.perf_counter()
    try:
        with torch.inference_mode():
            for pos in range(tokens):
                for out, tok in zip(outs, step([out[-1] for out in outs], pos), strict=True):
                    out.append(tok)
        if device == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as exc:  # the megakernel's watchdog names the stuck worker, instruction and counter
        _fail(f"decode stopped at token {len(outs[0]) - 1}: {exc}", 1)
    seconds = time.perf_counter() - t
    rate = batch * tokens / seconds
    for b, out in enumerate(outs):
        click.echo(("" if batch == 1 else f"seq {b}: ") + " ".join(str(x) for x in out[1:]))
    click.echo(f"{batch * tokens} tokens in {seconds:.3f} s: {rate:.1f} tokens/s ({how}, {device}, greedy, "
               f"batch {batch}, {'checkpoint ' + weights_dir if weights_dir else f'random weights seed {seed}'})",
               err=True)
    agreement = None
    if check and backend == "megakernel":
        from megasynth.measure.torch_step import greedy_agreement

        each = [greedy_agreement(cfg, weights, out, len(out), device) for out in outs]  # each sequence alone
        agreement = each[0] if batch == 1 else {"agree": sum(a["agree"] for a in each),
                                                "steps": sum(a["steps"] for a in each), "margin": each[0]["margin"],
                                                "clear_mismatches": [m for a in each for m in a["clear_mismatches"]],
                                                "sequences": each}
        click.echo(f"check against the PyTorch reference (teacher-forced on these tokens): "
                   f"{agreement['agree']}/{agreement['steps']} greedy tokens agree; "
                   f"{len(agreement['clear_mismatches'])} disagree where the reference's top-2 margin > "
                   f"{agreement['margin']}", err=True)
    if json_file:
        from megasynth.atomic import write_json_atomic

        one = batch == 1  # batch 1 keeps its scalar prompt_token and flat token list
        write_json_atomic(json_file, {"model": spec.name, "backend": how, "device": device,
                                      **({} if one else {"batch": batch}),
                                      "prompt_token": firsts[0] if one else firsts,
                                      "tokens": outs[0][1:] if one else [out[1:] for out in outs],
                                      "seconds": seconds, "tokens_per_s": rate,
                                      "ms_per_token": 1e3 * seconds / (batch * tokens), "check": agreement})


if __name__ == "__main__":
    # `python -m megasynth.commands.bench bench|generate ...`: works where other subcommands' dependencies (optuna,
    # openai) are missing, e.g. on a bare GPU machine.
    click.Group(commands={"bench": bench, "generate": generate})(prog_name="synth")
