"""miniinfer's command line: generate text, benchmark, serve, and list or reproduce the book's results.

Subcommands: ``generate | bench | bench-serving | serve | engines | models | chapters | results |
device | repro NN``. User errors (unknown names, empty or over-long prompts, unreadable input
files, an ``--out`` that cannot be written, impossible sampling values, devices or sizes, a port
that cannot be listened on, a ``--base-url`` where no server answers) print one line to stderr
and exit with status 2, and are checked before the model loads where they can be; anything else
is a bug and keeps its traceback. Results are written whole or not at all (a temporary file,
renamed). Ctrl-C exits with status 130 and one line; ``bench`` and ``bench-serving`` first write
what had finished (marked ``partial=True``).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import socket
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .bench.inputs import check_output_path, check_text, read_jsonl, write_atomically
from .core.config import MAX_DRAFT_TOKENS, SPECULATIVE
from .core.errors import Interrupted, InvalidRequestError, MiniInferError, UnknownNameError

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from .bench.serving import ServingResults
    from .bench.serving.workloads import WorkloadConfig
    from .core.models import LoadedModel

USAGE_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
# Far past anything the book runs (batches of 64, workloads of a few hundred requests), and far
# short of what a typo makes of them: a batch of 10**8 prompts allocates gigabytes before its
# first step, a workload of 10**9 requests is made in memory before the first is sent.
MAX_BATCH_SIZE = 4096
MAX_NUM_REQUESTS = 100_000


def _csv_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _csv_names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _csv_rates(text: str) -> tuple[float, ...]:
    """Request rates per second; ``inf`` sends every request at once."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidRequestError(f"expected comma-separated request rates (numbers or inf), "
                                  f"got {text!r}") from None


def _range(text: str, name: str) -> tuple[int, int]:
    parts = text.split(",")
    try:
        low, high = (int(x) for x in parts)
    except ValueError:
        raise InvalidRequestError(f"{name}: expected a range LOW,HIGH of integers, got "
                                  f"{text!r}") from None
    return low, high


def _check_at_most(values: tuple[int, ...] | int, limit: int, option: str) -> None:
    for value in values if isinstance(values, tuple) else (values,):
        if value > limit:
            raise InvalidRequestError(f"{option} {value} is more than {limit:,}, the most it may "
                                      f"be")


def _check_fits_context(lm: LoadedModel, positions: int, what: str) -> None:
    """A length no request of the model can have, found before anything that long is made."""
    if positions > lm.max_context:
        raise InvalidRequestError(f"{what}: {positions} positions, more than the model's "
                                  f"context of {lm.max_context}")


def _check_workload_lengths(lm: LoadedModel, workload: WorkloadConfig) -> None:
    """Lengths that cannot fit the model whatever the random draws, found before a workload of
    them is made (check_workload then checks each request of the workload that is made)."""
    prompt_low, prompt_high = workload.prompt_len
    output_low, output_high = workload.output_len
    _check_fits_context(lm, prompt_low + output_low, "--prompt-len and --output-len at their "
                                                     "lowest")
    _check_fits_context(lm, prompt_high, "--prompt-len at its highest")
    _check_fits_context(lm, output_high, "--output-len at its highest")
    if workload.kind == "shared-prefix":
        _check_fits_context(lm, workload.shared_prefix_len + prompt_low + output_low,
                            "--shared-prefix-len with the shortest question and answer")
    if workload.kind == "multi-turn":
        # The last turn's prompt holds every earlier turn and reply.
        _check_fits_context(lm, workload.turns * (prompt_low + output_low),
                            f"--turns {workload.turns}: the last turn at its shortest")


def _device_memory(device: torch.device) -> int:
    """Bytes of memory the device has: the GPU's, or the machine's for the CPU."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_kv_cache_bytes(value: int | None, device: torch.device) -> None:
    if value is None:
        return
    if value < 1:
        raise InvalidRequestError(f"--kv-cache-bytes must be >= 1, got {value}")
    memory = _device_memory(device)
    if value > memory:
        raise InvalidRequestError(f"--kv-cache-bytes {value:,} is more than the {memory:,} "
                                  f"bytes of memory the {device.type} device has")


def _check_listen(host: str, port: int) -> None:
    """Listen on ``host:port`` for a moment, so that a port in use or a host that is not this
    machine's is found before the model loads (the server binds again when it starts)."""
    try:
        with socket.create_server((host, port)):
            pass
    except OverflowError:
        raise InvalidRequestError(f"--port must be in 0-65535, got {port}") from None
    except OSError as exc:  # create_server re-raises a failed name lookup as OSError too
        if exc.errno is not None and exc.errno < 0:  # getaddrinfo's EAI_* codes
            reason = f"--host {host!r} is not a name or address this machine can resolve"
        elif exc.errno == errno.EADDRINUSE:
            reason = (f"port {port} is in use on {host}: stop what listens there, or give "
                      f"another --port (0: any free port)")
        elif exc.errno == errno.EADDRNOTAVAIL:
            reason = f"--host {host} is not an address of this machine"
        elif exc.errno == errno.EACCES:
            reason = f"listening on port {port} needs privileges; use a port >= 1024"
        else:
            reason = f"cannot listen on {host}:{port} ({os.strerror(exc.errno or 0)})"
        raise InvalidRequestError(reason) from None


def _check_base_url(url: str) -> None:
    """``url`` must be an http(s) URL where an OpenAI-compatible server answers ``/models``."""
    import httpx

    parts = urllib.parse.urlsplit(url)
    try:
        port_ok = parts.port != 0  # None (the scheme's default) or a number in 1-65535
    except ValueError:  # not a number, or out of range
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise InvalidRequestError(f"--base-url {url!r} is not an http(s) URL such as "
                                  f"http://127.0.0.1:8000/v1")
    models = url.rstrip("/") + "/models"
    try:
        response = httpx.get(models, timeout=10)
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"no server answers at --base-url {url} ({exc}); start one "
                                  f"with python -m miniinfer serve") from None
    if response.status_code != 200:
        raise InvalidRequestError(f"--base-url {url}: GET {models} answered HTTP "
                                  f"{response.status_code}, not an OpenAI-compatible /v1 "
                                  f"server's list of models")


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = [check_text(text, f"--prompt {i}") for i, text in enumerate(args.prompt or [])]
    if args.prompts:
        path = Path(args.prompts)
        for n, item in read_jsonl(path, "prompts file"):
            if isinstance(item, dict):
                if "prompt" not in item:
                    raise InvalidRequestError(f'{path}:{n} has no "prompt" field')
                item = item["prompt"]
            if not isinstance(item, str):
                raise InvalidRequestError(f"{path}:{n}: a prompt must be a string")
            prompts.append(item)
    if not prompts:
        raise InvalidRequestError("no prompt given: use --prompt TEXT or --prompts FILE.jsonl")
    for i, text in enumerate(prompts):
        if not text.strip():
            raise InvalidRequestError(f"prompt {i} is empty")
    return prompts


def _check_model(args: argparse.Namespace) -> None:
    """Model, device and dtype names, checked before anything loads."""
    from .core.models import MODELS, resolve_device, resolve_dtype

    if args.model not in MODELS:
        raise UnknownNameError(f"unknown model {args.model!r}; available models: {', '.join(MODELS)}")
    resolve_device(args.device)
    resolve_dtype(args.dtype, MODELS[args.model].default_dtype)


def _interrupted(exc: KeyboardInterrupt, out: Path | None, show: Callable[[Any], None],
                 write: Callable[[Any, bool], int]) -> Interrupted:
    """Ctrl-C in a benchmark: show and keep what had finished (``write`` it marked
    ``partial=True``; it returns the number of rows) or say that nothing was written, in one
    line on stderr. Returns the exception to raise, which ``main`` turns into status 130."""
    kept = exc.partial if isinstance(exc, Interrupted) else None
    if kept is None:
        line = "interrupted before any result had finished; nothing was written"
    else:
        show(kept)
        n = write(kept, True)
        rows = f"{n} finished row{'' if n == 1 else 's'}"
        line = f"interrupted; wrote the {rows} to {out}, marked partial=True" if out else \
            f"interrupted; the {rows} shown above, nothing was written (no --out)"
    print(f"miniinfer: {line}", file=sys.stderr)
    return Interrupted(kept)


def _runner_options(args: argparse.Namespace, engine: str) -> dict[str, object]:
    """``--tensor-parallel N`` and the engine-setting flags given, as engine options for the
    engines built on the model runner (chapter 08 on); checked with the engine's preset
    before any model loads (a combination that cannot run is named)."""
    from .core.config import SETTING_HELP
    from .engines import ENGINES, engine_config, resolve_engine
    from .engines.continuous import ContinuousEngine

    settings = {name: getattr(args, name) for name in SETTING_HELP
                if getattr(args, name, None) is not None}
    n = getattr(args, "tensor_parallel", None)
    if n is None and not settings:
        return {}
    given = ", ".join([*(["--tensor-parallel"] if n is not None else []),
                       *("--" + name.replace("_", "-") for name in settings)])
    if engine.partition(":")[0] not in ENGINES:  # a peer (vllm): its own settings
        raise InvalidRequestError(f"{given}: {engine!r} is not one of our engines")
    if n is not None and n < 1:
        raise InvalidRequestError(f"--tensor-parallel must be >= 1, got {n}")
    if not issubclass(resolve_engine(engine)[0], ContinuousEngine):
        raise InvalidRequestError(f"{given}: engine {engine!r} does not run on the model "
                                  f"runner; use continuous or a stage built on it")
    if n is not None:
        settings["tensor_parallel"] = n
    engine_config(engine, **settings)  # compiled or quantized with tensor parallelism: named
    return settings


def cmd_generate(args: argparse.Namespace) -> None:
    from .core.models import chat_text, load_model
    from .core.sampling import SamplingParams
    from .engines import engine_config, make_engine

    # Cheap checks first: a typo should not cost a model load.
    options = _runner_options(args, args.engine)
    config = engine_config(args.engine, **options)
    if config is not None and config.forward == "compiled":
        # One run of a few prompts: compile the buckets its steps meet, when they meet them,
        # not every bucket a server would (minutes on a CPU before the first token).
        options["warm_up"] = False
    _check_model(args)
    texts = _read_prompts(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    tok = lm.tokenizer
    prompts = [tok.encode(chat_text(tok, [{"role": "user", "content": t}]) if args.chat else t)
               for t in texts]
    engine = make_engine(args.engine, lm, **options)
    try:
        result = engine.generate(prompts, params)
    finally:
        if hasattr(engine, "close"):
            engine.close()
    for text, ids in zip(texts, result.token_ids, strict=True):
        out = tok.decode(ids, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"prompt": text, "token_ids": ids, "text": out}))
        else:
            print(text + out)


def cmd_bench(args: argparse.Namespace) -> None:
    from .bench.offline import (
        BenchConfig,
        check_bench_engine,
        make_bench_engine,
        make_prompts,
        run_bench,
        summary_table,
    )
    from .core.models import load_model
    from .core.sampling import SamplingParams

    for name in args.engines:
        check_bench_engine(name)
    options = {name: _runner_options(args, name) for name in args.engines}
    _check_model(args)
    _check_at_most(args.batch_sizes, MAX_BATCH_SIZE, "--batch-sizes")
    if args.breakdown or args.against_llama_cpp or args.kernel_rows:
        return _bench_step(args, options)
    config = BenchConfig(engines=args.engines, batch_sizes=args.batch_sizes,
                         prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                         warmup=args.warmup, repeat=args.repeat, chapter=args.chapter)
    out = check_output_path(args.out, "--out") if args.out is not None else None

    def write(df: pd.DataFrame, partial: bool = False) -> int:
        if out is not None:
            table = df.assign(partial=True) if partial else df
            write_atomically(out, lambda path: table.to_csv(path, index=False))
        return len(df)

    try:
        lm = load_model(args.model, device=args.device, dtype=args.dtype)
        _check_fits_context(lm, config.prompt_len + config.new_tokens,
                            "--prompt-len plus --new-tokens")
        engines = {name: make_bench_engine(name, lm, **options[name]) for name in config.engines}
        # The prompt must fit each engine (its pool too): found now, not after the bandwidth
        # measurement.
        longest = make_prompts(lm, 1, config.prompt_len)
        for engine in engines.values():
            engine.validate(longest, SamplingParams(max_new_tokens=config.new_tokens))
        df = run_bench(lm, config, engines)
    except KeyboardInterrupt as exc:
        raise _interrupted(exc, out, lambda df: print(summary_table(df).to_string(index=False)),
                           write) from None
    print(summary_table(df).to_string(index=False))
    if out is not None:
        write(df)
        print(f"wrote {out}")


def _bench_step(args: argparse.Namespace, options: dict[str, dict]) -> None:
    """``bench --breakdown``, ``--against-llama-cpp`` and ``--kernel-rows``: a table, and
    the CSV."""
    import pandas as pd

    from .bench.devices import run_metadata
    from .bench.offline import make_bench_engine
    from .core.models import load_model

    out = check_output_path(args.out, "--out") if args.out is not None else None
    if args.kernel_rows:
        from .bench.kernels import quantized_linear_rows
        from .core.kernels import cpu_quantized
        from .runner.quantized import BITS

        unknown = [b for b in args.kernel_rows if b not in BITS]
        if unknown:
            raise InvalidRequestError(f"--kernel-rows takes {' and '.join(BITS)}, got "
                                      f"{', '.join(unknown)}")
        if (why := cpu_quantized.load()) is not None:
            raise MiniInferError(f"--kernel-rows times chapter 13's kernel, which does not run "
                                 f"here: {why}")
        lm = load_model(args.model, device="cpu")
        isas = ["auto", *cpu_quantized.instruction_sets()]
        df = pd.concat([quantized_linear_rows(lm, bits, tuple(args.batch_sizes), isa=isa)
                        for bits in args.kernel_rows for isa in isas[1:] or isas])
    elif args.against_llama_cpp:
        from .bench.race import STAGES, race

        unknown = [f for f in args.against_llama_cpp if f not in STAGES]
        if unknown:
            raise InvalidRequestError(f"--against-llama-cpp takes formats among "
                                      f"{', '.join(STAGES)}, got {', '.join(unknown)}")
        if args.model != "smollm2-135m":
            raise InvalidRequestError("--against-llama-cpp runs smollm2-135m, the model "
                                      "llama.cpp's GGUF holds")
        lm = load_model(args.model, device="cpu")
        df = race(lm, args.against_llama_cpp, args.batch_sizes, args.repeat, args.prompt_len,
                  args.new_tokens)
    else:
        from .bench.breakdown import step_breakdown
        from .engines import resolve_engine
        from .engines.continuous import ContinuousEngine

        static = [n for n in args.engines if not issubclass(resolve_engine(n)[0], ContinuousEngine)]
        if static:
            raise InvalidRequestError(f"--breakdown times the steps of chapter 08's engine and the "
                                      f"stages built on it; {', '.join(static)} runs a static "
                                      f"batch")
        lm = load_model(args.model, device=args.device, dtype=args.dtype)
        rows = []
        for name in args.engines:
            engine = make_bench_engine(name, lm, **options[name])
            for batch in args.batch_sizes:
                split = step_breakdown(engine, batch, args.prompt_len)
                rows.append({"engine": name, "batch_size": batch,
                             **dict(zip(split["category"], split["ms"], strict=True))})
        df = pd.DataFrame(rows)
    df = df.assign(**{k: v for k, v in run_metadata(lm.device).items() if k not in df})
    print(df.round(3).to_string(index=False))
    if out is not None:
        write_atomically(out, lambda path: df.to_csv(path, index=False))
        print(f"wrote {out}")


def cmd_bench_serving(args: argparse.Namespace) -> None:
    from .bench.serving import (
        STEPPED_SYSTEMS,
        ServingBenchConfig,
        WorkloadConfig,
        run_serving_bench,
        summary_table,
    )
    from .bench.serving.workloads import read_dataset_texts
    from .core.models import load_model

    # Every argument is checked before the model loads, except lengths against its context.
    _check_model(args)
    _check_at_most(args.num_requests, MAX_NUM_REQUESTS, "--num-requests")
    workload = WorkloadConfig(num_requests=args.num_requests,
                              prompt_len=_range(args.prompt_len, "--prompt-len"),
                              output_len=_range(args.output_len, "--output-len"),
                              dataset=args.dataset, seed=args.seed, kind=args.workload,
                              shared_prefix_len=args.shared_prefix_len, turns=args.turns,
                              turn_gap_s=args.turn_gap_s)
    config = ServingBenchConfig(workload, systems=args.systems,
                                request_rates=_csv_rates(args.request_rates),
                                max_num_batched_tokens=args.max_num_batched_tokens,
                                static_batch_size=args.static_batch_size,
                                warmup=not args.no_warmup, chapter=args.chapter,
                                tensor_parallel=args.tensor_parallel, repeats=args.repeats)
    if args.tensor_parallel is not None:
        stepped = [s for s in config.systems if s in STEPPED_SYSTEMS]
        if not stepped:
            raise InvalidRequestError(f"--tensor-parallel {args.tensor_parallel}: none of the "
                                      f"systems runs on the model runner ({', '.join(STEPPED_SYSTEMS)})")
        for system in stepped:
            _runner_options(args, system)
    if args.dataset:
        read_dataset_texts(args.dataset)
    out = None
    if args.out is not None:
        out = check_output_path(args.out, "--out")
        for suffix in ("requests", "steps"):
            check_output_path(out.with_name(f"{out.stem}-{suffix}.csv"), "--out")
    if args.base_url:
        _check_base_url(args.base_url)

    def write(results: ServingResults, partial: bool = False) -> int:
        if out is not None:
            for df, path in ((results.runs, out),
                             (results.requests, out.with_name(f"{out.stem}-requests.csv")),
                             (results.steps, out.with_name(f"{out.stem}-steps.csv"))):
                table = df.assign(partial=True) if partial else df
                write_atomically(path, lambda tmp, table=table: table.to_csv(tmp, index=False))
        return len(results.runs)

    try:
        lm = load_model(args.model, device=args.device, dtype=args.dtype)
        _check_workload_lengths(lm, workload)
        if args.base_url:  # chapter 10: the same workload, sent to a running server
            from .bench.serving.http import run_http_bench

            results = run_http_bench(lm, args.base_url, workload, config.request_rates,
                                     config.warmup, args.chapter, config.repeats)
        else:
            results = run_serving_bench(lm, config)
    except KeyboardInterrupt as exc:
        raise _interrupted(exc, out, lambda r: print(summary_table(r.runs).to_string(index=False)),
                           write) from None
    print(summary_table(results.runs).to_string(index=False))
    if config.repeats > 1:
        from .bench.serving.metrics import median_of_repeats

        print(f"medians of {config.repeats} rounds:")
        print(summary_table(median_of_repeats(results.runs)).to_string(index=False))
    if out is not None:
        write(results)
        print(f"wrote {out} (+ -requests, -steps)")


def cmd_serve(args: argparse.Namespace) -> None:
    from .core.models import resolve_device
    from .server import ServerConfig, run_server

    options = _runner_options(args, args.engine)
    config = ServerConfig(model=args.model, engine=args.engine, host=args.host, port=args.port,
                          max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          kv_cache_bytes=args.kv_cache_bytes,
                          arrival_window_ms=args.arrival_window_ms, device=args.device,
                          dtype=args.dtype, strict_fields=args.strict_fields,
                          tensor_parallel=args.tensor_parallel,
                          speculative=args.speculative,
                          num_speculative_tokens=args.num_speculative_tokens,
                          engine_settings={k: v for k, v in options.items()
                                           if k != "tensor_parallel"},
                          **({} if args.max_request_bytes is None else
                             {"max_request_bytes": args.max_request_bytes}))
    # All before the model loads: a busy port must not cost a load, and then a traceback.
    _check_model(args)
    _check_kv_cache_bytes(args.kv_cache_bytes, resolve_device(args.device))
    _check_listen(args.host, args.port)
    run_server(config)


def cmd_chapters(args: argparse.Namespace) -> None:
    from .book.chapters import chapters_markdown

    print(chapters_markdown())


def cmd_engines(args: argparse.Namespace) -> None:
    """Every stage in book order, from the chapter registry, with its variants."""
    from .book.chapters import CHAPTERS
    from .engines import ENGINES

    for chapter in CHAPTERS.values():
        for name in chapter.stages:
            cls = ENGINES[name]
            print(f"{name:18s} ch{chapter.number}  {cls.summary}")
            for variant in getattr(cls, "variants", ()):
                print(f"  {name}:{variant}")


def cmd_models(args: argparse.Namespace) -> None:
    from .core.models import MODELS, dtype_name

    for name, spec in MODELS.items():
        dtype = dtype_name(spec.default_dtype)
        print(f"{name:14s} {dtype:9s} {spec.description}")


def cmd_repro(args: argparse.Namespace) -> None:
    from .lab.repro import reproduce, reproduce_all

    if args.chapter == "all":
        chapters = args.chapters.split(",") if args.chapters else None
        reproduce_all(chapters, device=args.device, execute_notebooks=not args.no_notebook,
                      dry_run=args.dry_run, for_book=args.for_book)
    elif args.chapters or args.dry_run:
        raise MiniInferError("--chapters and --dry-run go with 'repro all'")
    else:
        reproduce(args.chapter, device=args.device, execute_notebook_too=not args.no_notebook,
                  for_book=args.for_book)


def cmd_device(args: argparse.Namespace) -> None:
    from .bench.devices import DEVICES_CSV, device_speed
    from .core.models import resolve_device

    speed = device_speed(resolve_device(args.device), store=args.measure, remeasure=args.measure)
    print(f"{speed.slug} ({speed.isa}): {speed.name}, {speed.bandwidth_gbs} GB/s, "
          f"{speed.peak_gflops} GFLOP/s ({speed.how_measured}; {speed.date})"
          + (f"; written to {DEVICES_CSV}" if args.measure else ""))


def cmd_results(args: argparse.Namespace) -> None:
    from .book import results_markdown

    if args.figure:
        from .book.glance import save_at_a_glance

        print(f"wrote {save_at_a_glance(args.figure)}")
        return
    print(results_markdown() or "no results recorded yet (run make chapter-01)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miniinfer", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser, model: str | None) -> None:
        p.add_argument("--model", default=model, required=model is None)
        p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 or auto (default)")
        p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the model's)")
        p.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                       help="split the model over N processes (chapter 12; runner engines only)")

    def engine_settings(p: argparse.ArgumentParser) -> None:
        """One flag per engine setting (core.config), on top of the engine's preset; those the
        command already names its own way (serve's --speculative) are left to it."""
        from .core.config import SETTING_HELP, EngineConfig

        group = p.add_argument_group("engine settings (on top of the engine's preset; "
                                     "chapter 08's engine and the stages built on it)")
        taken = {action.dest for action in p._actions}
        types = {f.name: f.type for f in dataclasses.fields(EngineConfig)}
        for name, text in SETTING_HELP.items():
            if name in taken:
                continue
            flag = "--" + name.replace("_", "-")
            if types[name] == "bool":
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                   help=text)
            else:
                kind = int if types[name].startswith("int") else str
                group.add_argument(flag, type=kind, default=None,
                                   choices=EngineConfig.choices(name), help=text)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("--engine", default="naive")
    model_args(gen, "smollm2-135m")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--prompts", help="JSONL file: one string or {\"prompt\": ...} per line")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="one JSON line per prompt")
    engine_settings(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="offline decode benchmark -> table + tidy CSV")
    bench.add_argument("--engines", type=_csv_names, default=("hf", "naive"),
                       help="stages (see `engines`), and vllm: the peer (make peers)")
    model_args(bench, "smollm2-135m")
    bench.add_argument("--batch-sizes", type=_csv_ints, default=(1, 4, 8))
    bench.add_argument("--prompt-len", type=int, default=64)
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--warmup", type=int, default=1)
    bench.add_argument("--repeat", type=int, default=3)
    bench.add_argument("--chapter", default="", help="chapter tag written into the CSV")
    bench.add_argument("--out", help="CSV path (Ctrl-C: the finished rows, marked partial)")
    instead = bench.add_mutually_exclusive_group()
    instead.add_argument("--breakdown", action="store_true",
                         help="instead: where a steady decode step's time goes (weight-reading "
                              "kernels, other kernels, ATen ops, guards and dispatch, engine "
                              "Python), per engine and batch size")
    instead.add_argument("--against-llama-cpp", type=_csv_names, metavar="FORMATS",
                         help="instead: our compiled stage against llama.cpp (make peers-llama) "
                              "on the same weights, formats of int4,int8,fp32, interleaved "
                              "round by round (--repeat rounds), paired ratios with 95%% "
                              "intervals")
    instead.add_argument("--kernel-rows", type=_csv_names, metavar="BITS",
                         help="instead: chapter 13's kernel alone, every linear of a step of the "
                              "int4 or int8 model (e.g. int4,int8) at each of --batch-sizes rows, "
                              "on each instruction path this CPU has: ms, GB/s and the cost "
                              "against the first row count")
    engine_settings(bench)
    bench.set_defaults(func=cmd_bench)

    serving = sub.add_parser(
        "bench-serving", help="online serving benchmark: Poisson arrivals, TTFT/TPOT/ITL -> CSV")
    model_args(serving, "smollm2-135m")
    serving.add_argument("--systems", type=_csv_names,
                         default=("continuous", "static-paged-attention", "hf-cb"),
                         help="continuous, prefix-cache, hf-cb (transformers' continuous "
                              "batching), "
                              "static-ENGINE (batches of --static-batch-size with a stage) "
                              "and vllm (the peer: make peers)")
    serving.add_argument("--num-requests", type=int, default=32)
    serving.add_argument("--request-rates", default="inf",
                         help="requests/s, comma-separated (inf: all at once)")
    serving.add_argument("--prompt-len", default="16,256", help="LOW,HIGH tokens (random ids)")
    serving.add_argument("--output-len", default="32,128", help="LOW,HIGH new tokens")
    serving.add_argument("--workload", default="random",
                         help="random (nothing shared), shared-prefix or multi-turn (chapter 09)")
    serving.add_argument("--shared-prefix-len", type=int, default=512,
                         help="shared-prefix: tokens of the system prompt every request starts with")
    serving.add_argument("--turns", type=int, default=4,
                         help="multi-turn: turns per conversation (--num-requests counts turns)")
    serving.add_argument("--turn-gap-s", type=float, default=5.0,
                         help="multi-turn: seconds between a conversation's turns")
    serving.add_argument("--dataset", help='JSONL: {"prompt": text, "output_len": n} per line')
    serving.add_argument("--max-num-batched-tokens", type=_csv_ints, default=(512,),
                         help="token budgets per step (continuous, hf-cb), comma-separated")
    serving.add_argument("--static-batch-size", type=int, default=8)
    serving.add_argument("--seed", type=int, default=0)
    serving.add_argument("--no-warmup", action="store_true")
    serving.add_argument("--repeats", type=int, default=1,
                         help="rounds of every run, taken in turn (each run's row says its "
                              "round; compare systems by the medians)")
    serving.add_argument("--chapter", default="08", help="chapter tag written into the CSV")
    serving.add_argument("--base-url", help="send the workload over HTTP to a running server "
                         "(python -m miniinfer serve), e.g. http://127.0.0.1:8000/v1; "
                         "--systems is not used then")
    serving.add_argument("--out", help="CSV path (requests and steps go next to it; Ctrl-C: "
                                       "the finished runs, marked partial)")
    serving.set_defaults(func=cmd_bench_serving)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chapter 10)")
    model_args(serve, "smollm2-135m")
    serve.add_argument("--engine", default="continuous",
                       help="continuous or a stage built on it (prefix-cache)")
    serve.add_argument("--host", default="127.0.0.1", help="127.0.0.1 (default): this machine only")
    serve.add_argument("--port", type=int, default=8000, help="0: any free port")
    serve.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    serve.add_argument("--max-waiting", type=int, default=1024,
                       help="requests queued beyond those; more get HTTP 429")
    serve.add_argument("--max-num-batched-tokens", type=int, default=512,
                       help="token budget of one engine step")
    serve.add_argument("--kv-cache-bytes", type=int, default=None,
                       help="KV pool size (default: the engines' default pool)")
    serve.add_argument("--arrival-window-ms", type=float, default=5.0,
                       help="an idle engine waits until no request has come for this long "
                            "(at most 10x) before its first step, so a burst starts together "
                            "(0: step at once)")
    serve.add_argument("--strict-fields", action="store_true",
                       help="refuse (HTTP 400) a request field the server does not know; "
                            "default: accept it and log its name once, as vLLM does")
    serve.add_argument("--max-request-bytes", type=int, default=None,
                       help="larger request bodies get HTTP 413 before they are read "
                            "(default 2 MiB)")
    serve.add_argument("--speculative", choices=SPECULATIVE, default=None,
                       help="speculative decoding (chapter 14): drafts by prompt lookup (ngram) "
                            "or the longest earlier match (suffix), verified in the same step; "
                            "the tokens do not change")
    serve.add_argument("--num-speculative-tokens", type=int, default=4,
                       help=f"with --speculative: the most draft tokens a request gets a step "
                            f"(0-{MAX_DRAFT_TOKENS})")
    engine_settings(serve)
    serve.set_defaults(func=cmd_serve)

    sub.add_parser("engines", help="list engine stages").set_defaults(func=cmd_engines)
    sub.add_parser("models", help="list models").set_defaults(func=cmd_models)
    sub.add_parser("chapters", help="the chapter registry as the README's markdown table"
                   ).set_defaults(func=cmd_chapters)

    results = sub.add_parser("results", help="recorded results as markdown tables")
    results.add_argument("--figure", metavar="PNG",
                         help="instead, draw the README's results-at-a-glance figure")
    results.set_defaults(func=cmd_results)

    device = sub.add_parser("device", help="this device's speed of light (data/results/devices.csv)")
    device.add_argument("--device", default="auto")
    device.add_argument("--measure", action="store_true",
                        help="measure now (on a quiet machine) and store it in the device table")
    device.set_defaults(func=cmd_device)

    repro = sub.add_parser("repro", help="rerun a chapter's benchmark here and re-execute its "
                                         "notebook; 'all': every chapter in order")
    repro.add_argument("chapter", help="chapter number, e.g. 01, or 'all'")
    repro.add_argument("--device", default="auto")
    repro.add_argument("--no-notebook", action="store_true",
                       help="skip re-executing the notebooks (automatic without jupyter)")
    repro.add_argument("--chapters", help="with 'all': only these, e.g. 05,06")
    repro.add_argument("--dry-run", action="store_true",
                       help="with 'all': print each chapter's plan and estimated time, run nothing")
    repro.add_argument("--for-book", action="store_true",
                       help="record the book's own tables (data/results/), from a clean commit "
                            "only; without it a recording is yours (data/yours/)")
    repro.set_defaults(func=cmd_repro)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (getattr(args, "tensor_parallel", None) or 1) > 1:
        from .runner.tensor_parallel import run_worker, torchrun_rank

        if torchrun_rank() not in (None, 0):  # torchrun started this process as a worker rank
            run_worker()
            return 0
    try:
        args.func(args)
    except MiniInferError as exc:
        print(f"miniinfer: error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return USAGE_ERROR
    except Interrupted:
        return INTERRUPTED  # the command has printed its line: it knows what it kept
    except KeyboardInterrupt:
        print("miniinfer: interrupted", file=sys.stderr)
        return INTERRUPTED
    except RuntimeError as exc:
        from .runner.tensor_parallel import RankFailure

        if not isinstance(exc, RankFailure):
            raise
        print(f"miniinfer: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
