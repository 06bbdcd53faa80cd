"""``make bench-step-cost``: what one model step costs by its rows and its prompt tokens, on whatever device runs it.

Beside a bulk lane a live request waits at the model server for steps it shares (docs/operations.md#the-bulk-lane):
the step in progress when it arrives (up to vLLM's ``max_num_batched_tokens`` of prompt), the step that reads
its own prompt, then one decoding step per token, each with every bulk stream's row in it. Whether that is
cheap is a property of the device: on a CPU a step's arithmetic grows with its rows and tokens; on a GPU a
decoding step is bound by reading the weights, whatever its rows. This times both kinds of step on a decoder
with random weights (no weights to download; equal shapes are all a step's time needs):

- **prompt steps**: one forward pass over ``--prompt-tokens`` tokens of prompt, no cache;
- **decoding steps**: ``--rows`` sequences, each with a cache of ``--past`` tokens (one more each step timed),
  one new token each.

Each figure is the median (and range) of ``--reps`` timed steps after ``--warmup`` untimed ones; the kinds and
sizes interleave within each repetition. On a GPU each step is also run once more under torch's profiler for
the time its kernels took, the launches between them left out (vLLM's CUDA graphs leave them out too). These are
transformers' eager kernels, not vLLM's: a step here is an upper figure for what vLLM's fused kernels take for
the same shapes. Only torch and transformers are imported, so it runs on a GPU machine with nothing else
installed. Figures only; nothing is asserted.

    python -m benchmarks.step_cost [--shape 1b] [--dtype bfloat16] [--rows 1,16,48,64] [--prompt-tokens 64,256,2048]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

# Decoder shapes (Llama-style): about 1.1 B parameters (Llama-3.2-1B's), and SmolLM2-135M's, the local model.
RANDOM_SHAPES: dict[str, dict[str, int]] = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3),
}
VOCABULARY = 49152  # SmolLM2's tokenizer, which the template's local runs use


def build(shape: str, dtype: str, device: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCABULARY, tie_word_embeddings=True, **RANDOM_SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    return model.eval()


def timer(device: str) -> Callable[[Callable[[], Any]], float]:
    import torch

    def timed(step: Callable[[], Any]) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start
    return timed


def kernel_time(step: Callable[[], Any]) -> float:
    """Seconds the GPU spent in kernels for one ``step``, gaps between them left out. Eager transformers launches
    each layer's kernels from Python, so a step's wall time here is mostly those launches; vLLM captures its
    decoding steps in CUDA graphs, which leaves the kernels. Their time is what grows with a step's rows, if
    anything does."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    if kernels:
        return sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    return sum(e.self_device_time_total for e in events) / 1e6  # kernels attributed to the ops that launched them


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import DynamicCache

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(RANDOM_SHAPES), default="1b")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--rows", default="1,16,48,64", help="decoding steps' rows")
    parser.add_argument("--past", type=int, default=96, help="tokens each decoding row has in its cache")
    parser.add_argument("--prompt-tokens", default="64,256,2048", help="prompt steps' tokens")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's own)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args.shape, dtype, device)
    timed = timer(device)
    rows = [int(n) for n in args.rows.split(",")]
    prompts = [int(n) for n in args.prompt_tokens.split(",")]
    generator = torch.Generator(device="cpu").manual_seed(1)

    def tokens(batch: int, length: int) -> Any:
        return torch.randint(0, VOCABULARY, (batch, length), generator=generator).to(device)

    caches: dict[int, Any] = {}
    with torch.inference_mode():
        for n in rows:  # each decoding row's cache of --past tokens
            cache = DynamicCache()
            model(tokens(n, args.past), past_key_values=cache, use_cache=True)
            caches[n] = cache
        steps: dict[str, Callable[[], Any]] = {}
        for n in prompts:
            steps[f"prompt step, {n} tokens"] = lambda n=n: model(tokens(1, n), use_cache=False)
        for n in rows:
            # The cache grows a token a step: from --past to --past + --warmup + --reps over a run.
            steps[f"decoding step, {n} rows"] = lambda n=n: model(tokens(n, 1), past_key_values=caches[n],
                                                                    use_cache=True)
        for _ in range(args.warmup):
            for step in steps.values():
                timed(step)
        times: dict[str, list[float]] = {name: [] for name in steps}
        kernels: dict[str, list[float]] = {name: [] for name in steps}
        for rep in range(args.reps):
            names = list(steps)
            names = names[rep % len(names):] + names[:rep % len(names)]  # a rotating order
            for name in names:
                times[name].append(timed(steps[name]))
                if device == "cuda":
                    kernels[name].append(kernel_time(steps[name]))
    where = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or platform.machine()} CPU"
    threads = "" if device == "cuda" else f", {torch.get_num_threads()} threads"
    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {where}{threads}; torch {torch.__version__}; "
          f"{args.shape} decoder ({model.num_parameters() / 1e9:.2f} B parameters, random) in {dtype}; "
          f"decoding rows with {args.past} tokens cached; {args.reps} timed steps each, median (range):")
    columns = {"ms": times, "GPU kernels, ms": kernels} if device == "cuda" else {"ms": times}
    print(f"| step | {' | '.join(columns)} |\n|---|{'---|' * len(columns)}")
    for name in steps:
        print(f"| {name} | " + " | ".join(spread(figures[name]) for figures in columns.values()) + " |")
    for column, figures in columns.items():
        one = statistics.median(figures[f"decoding step, {rows[0]} rows"])
        for n in rows[1:]:
            against = statistics.median(figures[f"decoding step, {n} rows"]) / one
            print(f"decoding step, {n} rows against {rows[0]} ({column}): {against:.2f}×")
    return 0


def spread(seconds: list[float]) -> str:
    """Median (range) in milliseconds."""
    return f"{statistics.median(seconds) * 1000:.1f} ({min(seconds) * 1000:.1f}-{max(seconds) * 1000:.1f})"


if __name__ == "__main__":
    raise SystemExit(main())
