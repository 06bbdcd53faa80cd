"""``make smoke``: the template end to end on this machine.

Starts the Pub/Sub emulator, runs the pipeline on the DirectRunner with the
embedded SmolLM2 model served by a real vLLM (CPU build) that the pipeline's
model manager starts, or, where vLLM's CPU build cannot run, by the template's
transformers engine (local/machine_fit.py says which, and why, first),
publishes a handful of mixed prompts, prints chunks live as they stream back,
then a per-request summary. Stops everything it started.

    python -m local.smoke [--engine vllm|transformers] [--server-url URL] [--bigquery] [--timeout-s 900]

With ``--bigquery`` the completions, chunks and dead letters also go to tables
in a local BigQuery emulator, and a query over the completions table is
printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import statistics
import sys
import threading
import time

from local.cpu_server import KNOWN_QUESTION, LOCAL_SERVER, known_answer_problem
from local.embedded_model import ensure_local_checkpoint
from local.emulators import BigQueryEmulator
from local.harness import REPO_ROOT, LocalRun, Received
from local.machine_fit import ENGINES, local_engine, this_machine
from pipeline.serving.model_weights import cache_root

PROMPTS = [
    {"id": "capital", "prompt": KNOWN_QUESTION, "temperature": 0, "max_tokens": 24},
    {"id": "haiku", "prompt": "Write a haiku about the sea.", "max_tokens": 40, "temperature": 0.7},
    {"id": "essay", "prompt": "Write a detailed essay about the history of the printing press, "
                              "its inventors and its effect on science and religion.", "max_tokens": 220,
     "temperature": 0.3},
    {"id": "chat", "messages": [{"role": "system", "content": "You answer in one sentence."},
                                {"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 60},
    {"id": "recipe", "prompt": "Give me a step-by-step recipe for pancakes.", "max_tokens": 160, "temperature": 0.3},
    {"id": "count", "prompt": "Count from one to ten in words.", "max_tokens": 40, "stop": ["ten"]},
    {"id": "ticket", "prompt": "Classify this support ticket: 'I was charged twice this month.'",
     "max_tokens": 80, "temperature": 0,
     "response_format": {"type": "json_schema", "json_schema": {"name": "ticket", "schema": {
         "type": "object", "additionalProperties": False, "required": ["category", "urgency"],
         "properties": {"category": {"enum": ["billing", "bug", "other"]},
                        "urgency": {"type": "integer", "minimum": 1, "maximum": 5}}}}}},
    "Name three planets of the solar system.",  # plain text: the id comes from the message
    '{"prompt": "broken JSON',  # malformed on purpose: ends in the dead letters
]


class LivePrinter:
    """Prints chunks as they arrive, one line each, colour-free for CI logs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, kind: str, item: Received) -> None:
        data = item.data
        with self._lock:
            if kind == "chunks":
                marker = f" [final: {data['finish_reason']}]" if data["final"] else ""
                print(f"  chunk  {data['id']:>10} #{data['seq']:<3} {data['text']!r}{marker}", flush=True)
            elif kind == "dead_letters":
                print(f"  DEAD   {str(data.get('id')):>10} {data['stage']}: {data['reason']}", flush=True)


def summary(run_collector, started: float) -> str:
    rows = [f"{'request':>12} {'first chunk':>12} {'tokens':>7} {'tok/s':>7} {'total':>8}  finish"]
    rates = []
    for item in sorted(run_collector.completions, key=lambda r: r.data["total_ms"]):
        data = item.data
        tokens = data["usage"]["completion_tokens"]
        ttft = data["time_to_first_token_ms"]
        generation_s = (data["total_ms"] - (ttft or 0)) / 1000
        rate = tokens / generation_s if generation_s > 0 else float("nan")
        rates.append(rate)
        ttft_text = f"{ttft / 1000:.2f} s" if ttft is not None else "-"
        rows.append(f"{data['id']:>12} {ttft_text:>12} {tokens:>7} {rate:>7.1f} {data['total_ms'] / 1000:>6.2f} s"
                    f"  {data['finish_reason']}")
    for item in run_collector.completions:
        if item.data.get("output_json") is not None or item.data.get("output_error"):
            rows.append(f"{item.data['id']:>12} structured output: "
                        f"{json.dumps(item.data['output_json']) if item.data['output_json'] is not None else ''}"
                        f"{item.data.get('output_error') or ''}")
    rows.append(f"{len(run_collector.completions)} completions, {len(run_collector.dead_letters)} dead letters, "
                f"{len(run_collector.chunks)} chunks in {time.time() - started:.1f} s"
                + (f"; median {statistics.median(rates):.1f} tok/s per request" if rates else ""))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-url", help="use this OpenAI-compatible server (vLLM, llama.cpp's server, Ollama) "
                                             "instead of starting an engine")
    parser.add_argument("--engine", choices=ENGINES, help="the engine to run the model with (default: the one this "
                                                          "machine can run, local/machine_fit.py)")
    parser.add_argument("--bigquery", action="store_true", help="also write to tables in a local BigQuery emulator")
    parser.add_argument("--timeout-s", type=float, default=900, help="give up after this long")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        tables: list[str] = []
        if args.bigquery:
            print("==> Starting the BigQuery emulator (dataset llm)", flush=True)
            bigquery = stack.enter_context(BigQueryEmulator())
            bigquery.activate()  # the pipeline subprocess inherits the emulator's address
            from local.emulators import emulator_bigquery_client
            emulator_bigquery_client(bigquery.project).create_dataset("llm")
            tables = [f"--output_completions_table={bigquery.project}:llm.completions",
                      f"--output_chunks_table={bigquery.project}:llm.chunks",
                      f"--dead_letter_table={bigquery.project}:llm.dead_letters"]
        code = smoke(args, tables)
        if code == 0 and args.bigquery:
            print(f"==> BigQuery: {COMPLETIONS_QUERY.format(table='llm.completions')}\n" + completions_query(),
                  flush=True)
        return code


COMPLETIONS_QUERY = ("SELECT request_id, finish_reason, completion_tokens, time_to_first_token_ms, "
                     "accelerator_seconds FROM {table} ORDER BY finished_at")


def completions_query() -> str:
    from local.emulators import emulator_bigquery_client

    client = emulator_bigquery_client(os.environ.get("GOOGLE_CLOUD_PROJECT", "local-project"))
    rows = client.query(COMPLETIONS_QUERY.format(table="`local-project.llm.completions`")).result()
    lines = [f"{'request_id':>12} {'finish':>7} {'tokens':>7} {'first token ms':>15} {'accelerator s':>14}"]
    lines += [f"{r.request_id:>12} {r.finish_reason:>7} {r.completion_tokens:>7} {r.time_to_first_token_ms:>15.0f} "
              f"{r.accelerator_seconds:>14.3f}" for r in rows]
    return "\n".join(lines)


def smoke(args: argparse.Namespace, tables: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        engine, why = local_engine(this_machine(), args.engine)
    except ValueError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 2
    if args.server_url:
        print(f"==> Engine: the OpenAI-compatible server at {args.server_url} (--server-url)", flush=True)
    else:
        print(f"==> Engine: {engine} ({why})", flush=True)
    if not args.server_url and engine == "vllm" and importlib.util.find_spec("vllm") is None:
        print("FAILED: the vllm engine was asked for, but this environment has no vLLM (it was installed for the "
              "transformers engine): run with ENGINE=transformers, or rebuild it with ENGINE=vllm", file=sys.stderr)
        return 1
    print("==> Preparing the local model (converted once, cached in", cache_root(), ")", flush=True)
    checkpoint = ensure_local_checkpoint()
    if args.server_url:
        engine_args = [f"--server_url={args.server_url}"]
    elif engine == "transformers":
        engine_args = [f"--model={checkpoint}", "--engine=transformers", f"--dtype={LOCAL_SERVER.dtype}",
                       "--max_in_flight=8", "--batch_size_target=8"]
    else:
        engine_args = [f"--model={checkpoint}", "--served_model_name=smollm2", *LOCAL_SERVER.template_args(),
                       "--max_in_flight=32"]
    log_path = REPO_ROOT / ".cache" / "smoke" / "pipeline.log"
    run = LocalRun([*engine_args, "--num_shards=4", "--chunk_tokens=6", "--chunk_interval_ms=150", *tables],
                   log_path=log_path)
    print("==> Starting the Pub/Sub emulator and the pipeline (DirectRunner, streaming)", flush=True)
    started = time.time()
    run.start()
    collector = run.collector(LivePrinter())
    try:
        print("==> Warming up: the model server starts on first use (about a minute on CPU, a few minutes "
              "the very first time while it compiles)", flush=True)
        run.publish([{"id": "warm-up", "prompt": "Hi", "max_tokens": 1}])

        def progress(done: int, total: int) -> None:
            print(f"  ... waiting ({time.time() - started:.0f} s); pipeline log: {log_path}", flush=True)
            if not run.pipeline_alive():
                raise RuntimeError("the pipeline exited early; last log lines:\n" + run.log_tail())

        if collector.wait_for(["warm-up"], args.timeout_s, progress):
            raise RuntimeError("the model server did not answer; last log lines:\n" + run.log_tail())
        print(f"==> Model server ready after {time.time() - started:.0f} s. Publishing {len(PROMPTS)} prompts; "
              "chunks stream in as they are generated:", flush=True)
        collector.clear()
        started = time.time()
        run.publish(PROMPTS[:-2])
        run.publish(PROMPTS[-2:-1], attributes={"id": "planets"})
        run.publish(PROMPTS[-1:], attributes={"id": "broken"})
        expected = [p["id"] for p in PROMPTS if isinstance(p, dict)] + ["planets", "broken"]
        missing = collector.wait_for(expected, args.timeout_s, progress)
        time.sleep(1.0)  # let the last chunks of finished requests arrive
        print("==> Summary\n" + summary(collector, started), flush=True)
        if missing:
            print(f"FAILED: no outcome for {sorted(missing)}; last log lines:\n{run.log_tail()}", file=sys.stderr)
            return 1
        if not args.server_url:  # the embedded model: its answer to the known question says its numbers are right
            answer = next((c.data["text"] for c in collector.completions if c.data["id"] == "capital"), None)
            problem = ("the known-answer request 'capital' ended as a dead letter" if answer is None
                       else known_answer_problem(answer))
            if problem:
                print(f"FAILED: {problem}", file=sys.stderr)
                return 1
        return 0
    except RuntimeError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        collector.stop()
        print("==> Stopping the pipeline (and its model server) and the emulator", flush=True)
        code = run.stop()
        if code not in (0, None):
            print(f"pipeline exited with code {code}; see {log_path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
