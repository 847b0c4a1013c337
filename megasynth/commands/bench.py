"""`synth bench` and `synth generate`: click commands over megasynth.measure (attached by megasynth.cli's
`_register()`)."""

from __future__ import annotations

import sys
import time

import click

from megasynth.commands import batch_option, max_seq_len_option, model_spec
from megasynth.ir.errors import ScheduleError


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _ctx_values(ctx: tuple[str, ...], extra: tuple[int, ...]) -> list[int]:
    out: list[int] = []
    for item in ctx:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                out.append(int(part))
            except ValueError:
                raise click.BadParameter(f"{part!r} is not an integer", param_hint="--ctx") from None
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
@batch_option("every sequence at the same --ctx, each with its own random KV history and token; the table adds "
              "tokens/s = N / step time. Variants that decode one sequence per step (hf_eager, per_op_graph, "
              "megakernel) are reported as skipped.")
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
@click.option("--dry-run", is_flag=True, help="Run on the CPU (no CUDA needed): exercises the command; times mean "
                                              "nothing for the GPU.")
def bench(model_name: str, schedule_file: str | None, ctx: tuple[str, ...], extra_ctx: tuple[int, ...],
          max_seq_len: int | None, batch: int, reps: int,
          warmup: int, json_file: str, variants: str | None, compile_timeout: float, compile_mode: str,
          flush_l2: bool, seed: int,
          weights_dir: str | None, token: int, verify: bool, dry_run: bool) -> None:
    """Time the decode step: the best plain PyTorch step (bf16 in a CUDA graph, and its torch.compile), per-op
    launches and the megakernel, against the bandwidth floor; print a table and write JSON."""
    from rich.console import Console

    from megasynth.atomic import write_json_atomic
    from megasynth.measure.bench import run_bench, split_by_ctx
    from megasynth.measure.options import BenchError, BenchOptions
    from megasynth.measure.render import render

    console = Console(stderr=True)
    spec = model_spec(model_name, max_seq_len, batch)
    import torch

    device = "cuda"
    if dry_run:
        device = "cpu"
    elif not torch.cuda.is_available():
        _fail("CUDA is not available: `synth bench` measures on a GPU; pass --dry-run to exercise it on the CPU")
    ctxs = _ctx_values(ctx, extra_ctx) or [min(1024, spec.max_seq_len)]
    # spec.name: a checkpoint folder's absolute path, which the compile child (another cwd) finds too
    opts = BenchOptions(model=spec.name, max_seq_len=spec.max_seq_len, schedule=schedule_file, ctxs=ctxs, reps=reps,
                        warmup=warmup, seed=seed, weights_dir=weights_dir or spec.weights_dir, token=token,
                        device=device,
                        variants=[v.strip() for v in variants.split(",") if v.strip()] if variants else None,
                        compile_timeout_s=compile_timeout, compile_mode=compile_mode, flush_l2=flush_l2,
                        verify=verify, batch=spec.batch)
    if dry_run:
        console.print("[yellow]dry run on the CPU: GPU variants are skipped and the times say nothing about a GPU"
                      "[/yellow]")
    threads = torch.get_num_threads()
    if dry_run:  # tiny CPU ops: one thread avoids OpenMP spin contention (restored after, for in-process callers)
        torch.set_num_threads(1)
    try:
        result = run_bench(opts, log=lambda s: console.print(f"[dim]{s}[/dim]"))
    except ScheduleError as exc:
        _fail(str(exc))
    except BenchError as exc:
        _fail(str(exc), 1 if "rejected" in str(exc) else 2)
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


@click.command("generate")
@click.option("--model", "model_name", default="llama-1b", show_default=True,
              help="A model name (synth models) or a Hugging Face checkpoint folder, whose weights are used unless "
                   "--weights is given.")
@click.option("--tokens", type=click.IntRange(1, 1 << 20), default=32, show_default=True,
              help="Tokens to generate (greedy).")
@click.option("--schedule", "schedule_file", type=click.Path(dir_okay=False),
              help="Schedule .json or .json.gz (default: the naive lowering), or a schedule set (synth search "
                   "--ctx-ranges): each step runs the member whose range holds its position, switching as the "
                   "context grows.")
@click.option("--prompt-token", type=int, default=1, show_default=True, help="The first token fed.")
@click.option("--weights", "weights_dir", type=click.Path(file_okay=False),
              help="Hugging Face safetensors checkpoint folder (default: the --model folder's, else random "
                   "weights, --seed).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--backend", type=click.Choice(["auto", "megakernel", "reference"]), default="auto",
              show_default=True, help="auto = the megakernel on CUDA, the PyTorch reference on the CPU.")
@click.option("--check/--no-check", default=True, show_default=True,
              help="After the timed loop, replay the tokens through the PyTorch reference and count agreements.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Also write tokens and timing here.")
@max_seq_len_option()
def generate(model_name: str, tokens: int, schedule_file: str | None, prompt_token: int, weights_dir: str | None,
             seed: int, backend: str, check: bool, json_file: str | None, max_seq_len: int | None) -> None:
    """Greedy decode loop (batch 1) on the megakernel; prints the token ids and tokens/s."""
    import torch

    from megasynth.ir.model import DoesNotFit
    from megasynth.measure.bench import load_bench_schedule
    from megasynth.measure.options import BenchError

    spec = model_spec(model_name, max_seq_len)
    cfg = spec.config
    weights_dir = weights_dir or spec.weights_dir  # --model DIR runs on the checkpoint's own weights
    if tokens > spec.max_seq_len:
        raise click.BadParameter(f"{tokens} exceeds max_seq_len {spec.max_seq_len} of {spec.name} (raise it with "
                                 "--max-seq-len)",
                                 param_hint="--tokens")
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "megakernel" if cuda else "reference"
        if not cuda:
            click.echo("notice: no CUDA here: running the CPU PyTorch reference (kernels.reference.decode_step), "
                       "not the megakernel", err=True)
    if backend == "megakernel" and not cuda:
        _fail("--backend megakernel needs CUDA")
    device = "cuda" if cuda and backend == "megakernel" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    from megasynth.kernels.weights import WeightsError, model_weights

    try:
        weights = model_weights(cfg, weights_dir, seed=seed, dtype=dtype, device=device)
    except WeightsError as exc:
        _fail(str(exc))
    if not 0 <= prompt_token < cfg.vocab_size:
        raise click.BadParameter(f"{prompt_token} is outside the vocabulary [0, {cfg.vocab_size})",
                                 param_hint="--prompt-token")

    if backend == "megakernel":
        try:
            schedule, _ = load_bench_schedule(spec, schedule_file, verify=True)
            import megasynth.kernels.gpu as gpu

            mk = gpu.Megakernel(schedule, weights, max_seq_len=spec.max_seq_len)
            mk.step(prompt_token, 0)  # compile + warm up; position 0 is written again, identically, below
            torch.cuda.synchronize()
        except (ScheduleError, DoesNotFit) as exc:
            _fail(str(exc))
        except (BenchError, RuntimeError) as exc:  # rejected schedule, residency refusal, watchdog timeout
            _fail(str(exc), 1)
        step = mk.step
        how = "megakernel (Megakernel.step: CUDA graph replay, then the watchdog check syncs)"
        if mk.members:
            how += (f"; a schedule set of {len(mk.members)}, switching members at positions "
                    f"{', '.join(str(b) for b in mk.bounds[:-1])}")
    else:
        from megasynth.kernels.reference import decode_step, new_kv_cache

        k, v = new_kv_cache(cfg, tokens, dtype=dtype, device=device)  # positions [0, tokens) are all it writes

        def step(token: int, pos: int) -> torch.Tensor:
            return decode_step(cfg, weights, k, v, token, pos)

        how = "PyTorch reference on the CPU" if device == "cpu" else "PyTorch reference"
    out = [prompt_token]
    tok = prompt_token
    t = time.perf_counter()
    try:
        with torch.inference_mode():
            for pos in range(tokens):
                tok = int(step(tok, pos).argmax())  # .item(): the host needs the token for the next step
                out.append(tok)
        if device == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as exc:  # the megakernel's watchdog names the stuck worker, instruction and counter
        _fail(f"decode stopped at token {len(out) - 1}: {exc}", 1)
    seconds = time.perf_counter() - t
    rate = tokens / seconds
    click.echo(" ".join(str(x) for x in out[1:]))
    click.echo(f"{tokens} tokens in {seconds:.3f} s: {rate:.1f} tokens/s ({how}, {device}, greedy, batch 1, "
               f"{'checkpoint ' + weights_dir if weights_dir else f'random weights seed {seed}'})", err=True)
    agreement = None
    if check and backend == "megakernel":
        from megasynth.measure.torch_step import greedy_agreement

        agreement = greedy_agreement(cfg, weights, out, len(out), device)
        click.echo(f"check against the PyTorch reference (teacher-forced on these tokens): "
                   f"{agreement['agree']}/{agreement['steps']} greedy tokens agree; "
                   f"{len(agreement['clear_mismatches'])} disagree where the reference's top-2 margin > "
                   f"{agreement['margin']}", err=True)
    if json_file:
        from megasynth.atomic import write_json_atomic

        write_json_atomic(json_file, {"model": spec.name, "backend": how, "device": device,
                                      "prompt_token": prompt_token, "tokens": out[1:], "seconds": seconds,
                                      "tokens_per_s": rate, "ms_per_token": 1e3 * seconds / tokens,
                                      "check": agreement})


if __name__ == "__main__":
    # `python -m megasynth.commands.bench bench|generate ...`: works where other subcommands' dependencies (optuna,
    # openai) are missing, e.g. on a bare GPU machine.
    click.Group(commands={"bench": bench, "generate": generate})(prog_name="synth")
