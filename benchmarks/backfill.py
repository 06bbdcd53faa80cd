"""``make bench-backfill``: a backfill's tokens/s against vLLM's own offline batch path, side by side.

The same rows (``--rows`` prompts, each answered with exactly ``--tokens`` tokens: ``min_tokens`` equal to
``max_tokens``, so both paths generate the same work, checked) go two ways, in interleaved repetitions:

- **backfill**: ``ops/backfill.py`` feeds them to the template's pipeline on the DirectRunner (its model
  manager's vLLM server, the launch's defaults for chunks and ``max_in_flight``); the rate is the answers'
  tokens over the span from the first request's receipt to the last one's finish, read from the
  completions table (BigQuery emulator);
- **vLLM offline**: ``vllm.LLM.generate`` over the same prompts, in a process of its own, with the same
  model, dtype and sampling, timed around the call alone (the model is loaded and warmed first). With the
  pipeline's ``prompt_format`` ``chat`` (the default) the prompts go through ``LLM.chat``, which applies the
  model's chat template as the server's chat endpoint does and then calls ``generate``; without it the
  offline side would run fewer prompt tokens (the embedded model's template adds a system message). Both
  sides' prompt tokens and answer tokens are summed, and the run stops where they differ.

Both use the model the same way on this machine: vLLM's CPU build binds its compute threads to all but the
last core it may use in both, and the local launcher keeps the pipeline's threads off them
(:mod:`local.core_placement`). Figures, medians and ranges, and their ratio; nothing is asserted.

    python -m benchmarks.backfill [--reps 3] [--rows 48] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from local.backfill_smoke import COMPLETIONS, DEAD_LETTERS, warmed_up
from local.cpu_server import LOCAL_SERVER, server_environment
from local.embedded_model import ensure_local_checkpoint
from local.emulators import BigQueryEmulator, emulator_bigquery_client
from local.harness import REPO_ROOT, LocalRun
from ops import backfill
from pipeline.contract.parameters import default

RESULT = "offline result: "


def prompts(count: int) -> list[str]:
    return [f"Write a short story about a lighthouse keeper named Ada, part {i}." for i in range(count)]


def offline(count: int, tokens: int, chat: bool) -> dict[str, float]:
    """vLLM's offline batch path in this process: the rate of ``generate`` (through ``chat`` for chat prompts)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(ensure_local_checkpoint()), dtype=LOCAL_SERVER.dtype, enforce_eager=LOCAL_SERVER.enforce_eager,
              max_model_len=default("max_model_len"), seed=0)
    llm.generate(["Hi"], SamplingParams(max_tokens=1), use_tqdm=False)  # warm
    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
    started = time.perf_counter()
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts(count)], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts(count), params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs), "seconds": seconds}


def offline_run(count: int, tokens: int, chat: bool) -> dict[str, float]:
    env = {**os.environ, **server_environment(), "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-m", "benchmarks.backfill", "--offline", f"--rows={count}",
                             f"--tokens={tokens}", *["--chat"] * chat], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise RuntimeError(f"the offline run failed:\n{result.stderr[-2000:]}")
    (line,) = [line for line in result.stdout.splitlines() if line.startswith(RESULT)]  # vLLM logs to stdout too
    return json.loads(line.removeprefix(RESULT))


def backfill_run(run: LocalRun, folder: Path, rep: int, count: int, tokens: int) -> dict[str, float]:
    history = folder / f"rows-{rep}.jsonl"
    ids = [f"bench-{rep}-{i}" for i in range(count)]
    history.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": tokens, "min_tokens": tokens,
                                           "temperature": 0}) + "\n" for i, p in zip(ids, prompts(count), strict=True)))
    code = backfill.main([f"--source={history}", "--project=local-project",
                          f"--topic={run.emulator.topic(run.topic_name('prompts'))}",
                          f"--completions-table={COMPLETIONS}", f"--dead-letter-table={DEAD_LETTERS}", "--wait",
                          "--wait-poll-s=0.5", "--wait-timeout-s=1800", "--quiet"])
    if code:
        raise RuntimeError("the backfill did not finish:\n" + run.log_tail())
    query = (f"SELECT SUM(completion_tokens) AS tokens, SUM(prompt_tokens) AS prompt_tokens, "
             f"UNIX_MILLIS(MIN(received_at)) AS first, UNIX_MILLIS(MAX(finished_at)) AS last "
             f"FROM `{COMPLETIONS.replace(':', '.')}` "
             f"WHERE STARTS_WITH(request_id, 'bench-{rep}-')")
    (row,) = list(emulator_bigquery_client("local-project").query(query).result())
    return {"tokens": row["tokens"], "prompt_tokens": row["prompt_tokens"],
            "seconds": (row["last"] - row["first"]) / 1000}


def prompt_format(template_args: list[str]) -> str:
    """The pipeline's prompt format under these template arguments."""
    given = [arg.split("=", 1)[1] for arg in template_args if arg.startswith("--prompt_format=")]
    return given[-1] if given else default("prompt_format")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--template-arg", action="append", default=[], metavar="--NAME=VALUE",
                        help="a template parameter for the backfill's pipeline (repeat), e.g. --chunk_tokens=64")
    parser.add_argument("--offline", action="store_true", help=argparse.SUPPRESS)  # the offline side's process
    parser.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)  # ... with chat prompts
    args = parser.parse_args(argv)
    if args.offline:
        print(RESULT + json.dumps(offline(args.rows, args.tokens, args.chat)), flush=True)
        return 0
    chat = prompt_format(args.template_arg) == "chat"
    logging.basicConfig(level=logging.WARNING)
    folder = REPO_ROOT / ".cache" / "bench-backfill"
    folder.mkdir(parents=True, exist_ok=True)
    rates: dict[str, list[float]] = {"backfill": [], "vLLM offline": []}
    prompt_tokens: dict[int, list[str]] = {}  # each run's prompt tokens: one value when the work is equal
    with BigQueryEmulator() as bigquery:
        bigquery.activate()
        emulator_bigquery_client(bigquery.project).create_dataset("llm", exists_ok=True)
        run = LocalRun([f"--model={ensure_local_checkpoint()}", "--served_model_name=smollm2",
                        *LOCAL_SERVER.template_args(), f"--output_completions_table={COMPLETIONS}",
                        f"--dead_letter_table={DEAD_LETTERS}", *args.template_arg], log_path=folder / "pipeline.log")
        run.start()
        try:
            if not warmed_up(run, 900):
                raise RuntimeError("the model server did not answer:\n" + run.log_tail())
            for rep in range(args.reps):  # interleaved: each repetition runs both, in turn
                for name, measure in (("backfill", lambda rep=rep: backfill_run(run, folder, rep, args.rows,
                                                                                 args.tokens)),
                                      ("vLLM offline", lambda: offline_run(args.rows, args.tokens, chat))):
                    result = measure()
                    if result["tokens"] != args.rows * args.tokens:
                        raise RuntimeError(f"{name} generated {result['tokens']} tokens, not "
                                           f"{args.rows * args.tokens}: the work differs")
                    prompt_tokens.setdefault(int(result["prompt_tokens"]), []).append(name)
                    if len(prompt_tokens) != 1:
                        raise RuntimeError(f"the two paths read different prompts (prompt tokens: {prompt_tokens}): "
                                           "the work differs")
                    rates[name].append(result["tokens"] / result["seconds"])
                    print(f"rep {rep + 1} {name:>12}: {rates[name][-1]:.1f} tokens/s", flush=True)
        finally:
            run.stop()
    ratios = [b / o for b, o in zip(rates["backfill"], rates["vLLM offline"], strict=True)]
    print(f"\n{args.rows} rows x {args.tokens} tokens ({next(iter(prompt_tokens))} prompt tokens in all), {args.reps} "
          f"interleaved repetitions, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, template "
          f"parameters {' '.join(args.template_arg) or '(defaults)'}; tokens/s, median (range):")
    print("| path | tokens/s |\n|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {spread(values)} |")
    print(f"| backfill / offline | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
