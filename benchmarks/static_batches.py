"""``make bench-static-batches``: the static engine fed the batcher's batches, arrival order against length buckets.

``make bench-engines`` measures the same comparison through the whole pipeline on the DirectRunner, which needs the
emulators and vLLM beside it. This drives the engine alone
(:func:`~pipeline.engines.transformers_engine.transformers_engine`, the template's ``engine=transformers``) with the
batches the template's batcher forms for a burst, so it runs wherever torch and transformers do: a GPU machine with
nothing else installed. The batches come from the batcher's own decision
(:func:`~pipeline.flow.batching.on_arrival`, per bucket as :meth:`BatchingConfig.bucket_name` names it): a bucket
leaves when it reaches ``batch_size_target``, and what is left when the burst has arrived leaves on its delay timer,
oldest bucket first. Prompt lengths are the tokenizer's, as the pipeline measures them.

Three batchings, each at every ``--batch-sizes`` value, in interleaved repetitions (the order rotates each
repetition): arrival order (one bucket), prompt buckets, and prompt × answer buckets (what
``length_bucketing`` gives the static engine). Every answer runs to its budget (``min_tokens`` =
``max_tokens``), so every run generates the same tokens (checked) and a throughput ratio compares equal work.
One pass over every batching goes first, unmeasured, so that no batching pays for warming the device.

``--random-model 1b`` builds a Llama-shaped model of about 1.1 B parameters with random weights and the
tokenizer of ``--model`` (no weights to download; what it says is noise, which equal work does not mind) and
serves that. Figures only; nothing is asserted.

    python -m benchmarks.static_batches [--model FOLDER] [--random-model 1b] [--requests 48] [--reps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.side_by_side.report import fmt
from benchmarks.side_by_side.stats import Spread, ratio
from benchmarks.side_by_side.workload import FIXED, mixed, parse_budgets, with_budgets, with_lengths
from benchmarks.step_cost import RANDOM_SHAPES
from local.engine_driver import drive_to_end
from pipeline.config.settings import JobSettings
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.request_parsing import parse_request
from pipeline.engines.engine import Engine
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.transformers_engine import transformers_engine
from pipeline.flow.batching import BatchingConfig, BucketCounters, on_arrival
from pipeline.intake.prompt_length import TokenizerMeter
from pipeline.serving.vllm_server import ServerSpec

LOGGER = logging.getLogger(__name__)

ARRIVAL, PROMPT_BUCKETS, LENGTH_BUCKETS = "arrival order", "prompt buckets", "prompt × answer buckets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


# What each batching is in the template's parameters (with engine=transformers).
_BATCHING_PARAMETERS = {ARRIVAL: {"length_bucketing": False},
                        PROMPT_BUCKETS: {"length_bucketing": True, "answer_bucket_boundaries": "none"},
                        LENGTH_BUCKETS: {"length_bucketing": True}}


def batching_config(batching: str, batch_size: int, max_model_len: int) -> BatchingConfig:
    """The batcher's settings for one batching, derived by the job's own settings from the template's parameters
    (one batcher key: the static engine runs one batch at a time)."""
    return JobSettings.from_mapping({
        "input_subscription": "projects/my-project/subscriptions/unused",
        "output_chunks_topic": "projects/my-project/topics/unused",
        "dead_letter_topic": "projects/my-project/topics/unused", "model": "unused", "engine": "transformers",
        "max_model_len": max_model_len, "batch_size_target": batch_size, "num_shards": 1,
        **_BATCHING_PARAMETERS[batching]}).batching


def burst_batches(config: BatchingConfig, requests: list[InferenceRequest]) -> list[list[InferenceRequest]]:
    """The batches the batcher emits for ``requests`` arriving at once, in the order it emits them."""
    buffers: dict[str, list[InferenceRequest]] = {}
    counters: dict[str, BucketCounters] = {}
    batches = []
    for request in requests:
        bucket = config.bucket_name(request.prompt_tokens or 0, request.max_tokens)
        counters[bucket], reason, _ = on_arrival(config, counters.get(bucket, BucketCounters()),
                                                 request.prompt_tokens or 0, request.received_at)
        buffers.setdefault(bucket, []).append(request)
        if reason is not None:
            batches.append(buffers.pop(bucket))
            counters.pop(bucket)
    return batches + list(buffers.values())  # delay timers: dicts keep first-arrival order


def random_model(tokenizer_folder: Path, shape: str, dtype: str, into: Path) -> Path:
    """A model folder with random weights of ``shape`` and the tokenizer, chat template and end tokens of
    ``tokenizer_folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    base = AutoConfig.from_pretrained(tokenizer_folder)
    config = type(base)(**{**base.to_dict(), **RANDOM_SHAPES[shape], "vocab_size": len(tokenizer),
                           "tie_word_embeddings": True})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(into)
    for name in TOKENIZER_FILES:
        if (tokenizer_folder / name).exists():
            shutil.copy(tokenizer_folder / name, into / name)
    LOGGER.info("Random %s model: %.2f B parameters in %s", shape, model.num_parameters() / 1e9, into)
    del model
    return into


@dataclass(frozen=True)
class Run:
    batching: str
    batch_size: int
    rep: int
    seconds: float
    tokens: int
    batches: int
    padding_share: float
    first_p50_s: float
    done_p50_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def measure(engine: Engine, config: BatchingConfig, requests: list[InferenceRequest], batching: str,
            rep: int) -> Run:
    now = time.time()
    fresh = [dataclasses.replace(r, received_at=now) for r in requests]
    batches = burst_batches(config, fresh)
    before = engine.stats()
    drive = drive_to_end(engine, [r for batch in batches for r in batch], batches=[len(b) for b in batches],
                         timeout_s=1800, poll_s=0.005)
    seconds = max(drive.finished_at.values()) - now
    after = engine.stats()
    completions = drive.completions()
    if len(completions) != len(requests):
        raise RuntimeError(f"{len(requests) - len(completions)} requests ended without a completion: "
                           f"{drive.dead_letters()[:2]}")
    tokens = sum(c["usage"]["completion_tokens"] for c in completions)
    positions = after["prompt_positions"] + after["decode_positions"] - before["prompt_positions"] - \
        before["decode_positions"]
    padding = after["prompt_padding"] + after["decode_padding"] - before["prompt_padding"] - before["decode_padding"]
    return Run(batching, config.batch_size_target, rep, seconds, tokens, len(batches), padding / positions,
               statistics.median(t - now for t in drive.first_at.values()),
               statistics.median(t - now for t in drive.finished_at.values()))


def main() -> None:
    from local.embedded_model import ensure_local_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: the embedded model)")
    parser.add_argument("--random-model", choices=sorted(RANDOM_SHAPES), default=None,
                        help="serve random weights of this shape with --model's tokenizer")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--batch-sizes", default="4", help="batch_size_target values, comma-separated")
    parser.add_argument("--budgets", default="record=16,question=32,long answer=96",
                        help="each kind's answer budget in tokens, as make bench-engines has them")
    parser.add_argument("--max-model-len", type=int, default=2048, help="what the default bucket bounds follow")
    parser.add_argument("--json", type=Path, default=None, help="also write every run here")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no repetition that would end past this many seconds (a machine lent for a while)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    for name in (__name__, "pipeline.engines.transformers_engine"):  # and each batch's line: rows, padding, seconds
        logging.getLogger(name).setLevel(logging.INFO)
    import torch

    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    model = args.model or ensure_local_checkpoint()
    scratch = Path(tempfile.mkdtemp(prefix="static-batches-"))
    try:
        if args.random_model:
            model = random_model(model, args.random_model, dtype, scratch)
        prompts = with_lengths(with_budgets(mixed(args.requests, args.seed), parse_budgets(args.budgets)), FIXED)
        meter = TokenizerMeter(str(model), "chat")
        requests = []
        for prompt in prompts:
            request = parse_request(json.dumps(prompt.as_message(96)).encode())
            if not isinstance(request, InferenceRequest):
                raise RuntimeError(f"the workload's request {prompt.id} was refused: {request}")
            requests.append(dataclasses.replace(request, prompt_tokens=meter(request)))
        asked = sum(r.max_tokens or 0 for r in requests)
        engine = transformers_engine(EngineSettings(
            server=ServerSpec(model=str(model), dtype=dtype, max_model_len=args.max_model_len),
            engine="transformers", max_in_flight=max(len(requests), 1)))
        sizes = [int(s) for s in args.batch_sizes.split(",")]
        plan = [(b, s) for s in sizes for b in (ARRIVAL, PROMPT_BUCKETS, LENGTH_BUCKETS)]
        for batching, size in plan:  # a pass unmeasured: kernels chosen, caches and the allocator grown for each shape
            measure(engine, batching_config(batching, size, args.max_model_len), requests, batching, -1)
        runs: list[Run] = []
        began = time.monotonic()
        for rep in range(args.reps):
            spent = time.monotonic() - began
            if rep and args.budget_s is not None and spent / rep * (rep + 1) > args.budget_s:
                print(f"{rep} repetitions in {spent:.0f} s: a further one would end past --budget-s", flush=True)
                break
            for batching, size in plan[rep % len(plan):] + plan[:rep % len(plan)]:
                run = measure(engine, batching_config(batching, size, args.max_model_len), requests, batching, rep)
                if run.tokens != asked:
                    raise RuntimeError(f"{batching}: generated {run.tokens} tokens, {asked} were asked for")
                runs.append(run)
                print(f"rep {rep} · batch {size:>2} · {batching:<24} {run.tokens_per_s:8.1f} tokens/s  "
                      f"{run.batches:3d} batches  padding {100 * run.padding_share:5.1f} %  "
                      f"done p50 {run.done_p50_s:6.2f} s", flush=True)
        engine.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "CPU"
    reps = len({r.rep for r in runs})
    report(runs, sizes, asked, f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {device}, torch "
           f"{torch.__version__}, {args.random_model or Path(model).name} in {dtype}, {len(requests)} requests, "
           f"{reps} interleaved repetitions")
    if args.json:
        args.json.write_text(json.dumps([{**r.__dict__, "tokens_per_s": r.tokens_per_s} for r in runs], indent=1))


def report(runs: list[Run], sizes: list[int], asked: int, stamp: str) -> None:
    print(f"\n{stamp}; every run generated the {asked} tokens asked for. Medians and (ranges).\n")
    print("| batch_size_target | batching | tokens/s | batches | padded | first chunk p50 | done p50 |")
    print("|---|---|---|---|---|---|---|")
    for size in sizes:
        spread: dict[str, Spread] = {}
        for batching in (ARRIVAL, PROMPT_BUCKETS, LENGTH_BUCKETS):
            mine = [r for r in runs if r.batching == batching and r.batch_size == size]
            spread[batching] = Spread.of(r.tokens_per_s for r in mine)
            print(f"| {size} | {batching} | {fmt(spread[batching])} | {mine[0].batches} | "
                  f"{100 * statistics.median(r.padding_share for r in mine):.1f} % | "
                  f"{fmt(Spread.of(r.first_p50_s for r in mine))} s | {fmt(Spread.of(r.done_p50_s for r in mine))} s |")
        print(f"\nbatch {size}: tokens/s, length buckets / arrival order "
              f"{ratio(spread[LENGTH_BUCKETS], spread[ARRIVAL]):.2f}×, prompt buckets / arrival order "
              f"{ratio(spread[PROMPT_BUCKETS], spread[ARRIVAL]):.2f}×\n")


if __name__ == "__main__":
    main()
