"""The prompts every system gets, and when they arrive.

The mix stands for this template's users: most of a stream is records to
classify or extract from (a short question, or a long record with a short
question about it: prefill-heavy, short answers) and the rest is chat-like
requests for a long answer (decode-heavy). It follows no published trace;
the shares are options, and ``--prompts FILE.jsonl`` replaces it with yours.
Decoding is greedy and every request has the same ``max_tokens``, because
Beam's handler takes one ``inference_args`` for all elements; ``--budgets``
gives each kind its own, as a stream of classifications would set them.

Answers come in two lengths. *Fixed*: each answer runs to its budget
(``min_tokens`` = ``max_tokens``, as vLLM's own serving benchmark ignores the
end token), so every system generates the same tokens and tokens/s compare
equal work; greedy answers of natural length differ between systems, since
vLLM's output depends on what else is in the batch. *Natural*: answers end
where the model stops, which is what users see.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path

QUESTIONS = ("What is the capital of France?", "Name a primary color.", "What is 7 times 8?",
             "Say hello in Spanish.", "Which planet is closest to the sun?", "What do bees make?",
             "How many days are in a week?", "What is the opposite of hot?")
LONG_ANSWERS = ("Write a detailed essay about the history of the printing press.",
                "Explain step by step how a bicycle works.", "Describe a journey across the Sahara desert.",
                "Write a long story about a lighthouse keeper.", "Explain how vaccines train the immune system.",
                "Describe the water cycle in detail.")
RECORD_QUESTIONS = ("Classify the sentiment of this ticket as positive, negative or neutral.",
                    "Which product is this ticket about? Answer with the product name only.",
                    "Extract the customer's order number, or say none.")
_PRODUCTS = ("router", "laptop", "phone", "printer", "monitor", "headset")
_SENTENCES = ("I bought the {p} last month and it worked well at first.",
              "Since the update the {p} restarts every few hours.", "Support told me to reset it, which I did twice.",
              "My order number is {n} and I still have the receipt.", "The delivery was two days late.",
              "Honestly the {p} is the best I have owned.", "I would like a refund or a replacement {p}.",
              "The manual does not explain the settings at all.", "Nothing changed after the second reset.")


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str
    kind: str  # "question", "record" or "long answer": reported separately
    max_tokens: int | None = None  # None: the run's --max-tokens
    fixed: bool = False  # the answer runs to its budget (min_tokens = max_tokens)

    def budget(self, run_max_tokens: int) -> int:
        return self.max_tokens or run_max_tokens

    def min_tokens(self, run_max_tokens: int) -> int | None:
        """What the request sets as vLLM's min_tokens: its budget when its length is fixed."""
        return self.budget(run_max_tokens) if self.fixed else None

    def as_message(self, max_tokens: int) -> dict:
        message = {"id": self.id, "prompt": self.prompt, "max_tokens": self.budget(max_tokens), "temperature": 0}
        if self.fixed:
            message["min_tokens"] = message["max_tokens"]
        return message


FIXED, NATURAL = "fixed lengths", "natural lengths"


def with_lengths(prompts: list[Prompt], lengths: str) -> list[Prompt]:
    """The prompts with answers of ``FIXED`` or ``NATURAL`` length."""
    if lengths not in (FIXED, NATURAL):
        raise ValueError(f"lengths are {FIXED!r} or {NATURAL!r}, got {lengths!r}")
    return [dataclasses.replace(p, fixed=lengths == FIXED) for p in prompts]


def requested_tokens(prompts: list[Prompt], run_max_tokens: int) -> int | None:
    """The output tokens a run of fixed-length prompts must generate (None: natural lengths)."""
    if not prompts or not all(p.fixed for p in prompts):
        return None
    return sum(p.budget(run_max_tokens) for p in prompts)


def parse_budgets(text: str) -> dict[str, int]:
    """'record=16,question=32' -> {"record": 16, "question": 32}."""
    budgets = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, number = part.partition("=")
        if not number.strip().isdigit() or int(number) < 1:
            raise ValueError(f"budgets are KIND=TOKENS with TOKENS at least 1, got {part!r}")
        budgets[kind.strip()] = int(number)
    return budgets


def with_budgets(prompts: list[Prompt], budgets: dict[str, int]) -> list[Prompt]:
    """Each prompt with its kind's max_tokens; kinds not named keep the run's."""
    unknown = set(budgets) - {p.kind for p in prompts}
    if unknown:
        raise ValueError(f"no prompts of kind {sorted(unknown)}; the kinds are {sorted({p.kind for p in prompts})}")
    return [dataclasses.replace(p, max_tokens=budgets.get(p.kind, p.max_tokens)) for p in prompts]


def _record(rng: random.Random) -> str:
    product = rng.choice(_PRODUCTS)
    sentences = [rng.choice(_SENTENCES).format(p=product, n=rng.randint(10000, 99999))
                 for _ in range(rng.randint(12, 40))]
    return f"{rng.choice(RECORD_QUESTIONS)}\n\nTicket: {' '.join(sentences)}"


def mixed(count: int, seed: int, *, record_share: float = 0.4, long_share: float = 0.25) -> list[Prompt]:
    """``count`` seeded prompts: records, long-answer requests, and short questions for the rest."""
    if not 0 <= record_share + long_share <= 1:
        raise ValueError("record_share + long_share must be between 0 and 1")
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        roll = rng.random()
        if roll < record_share:
            prompts.append(Prompt(f"p{index}", _record(rng), "record"))
        elif roll < record_share + long_share:
            prompts.append(Prompt(f"p{index}", rng.choice(LONG_ANSWERS), "long answer"))
        else:
            prompts.append(Prompt(f"p{index}", rng.choice(QUESTIONS), "question"))
    return prompts


def from_jsonl(path: Path, count: int) -> list[Prompt]:
    """The first ``count`` lines of a JSONL file of ``{"prompt": ...}`` objects (``id``, ``kind`` optional)."""
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                text = item["prompt"]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: expected a JSON object with a \"prompt\" string "
                                 f"({error})") from None
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{number}: \"prompt\" must be a non-empty string")
            prompts.append(Prompt(str(item.get("id", f"p{len(prompts)}")), text, str(item.get("kind", "yours"))))
            if len(prompts) == count:
                break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def arrivals(count: int, rate_per_s: float | None, seed: int) -> list[float]:
    """Send offsets in seconds: all at 0 for a burst (``rate_per_s`` None), else Poisson arrivals."""
    if rate_per_s is None:
        return [0.0] * count
    if rate_per_s <= 0:
        raise ValueError(f"rate must be positive, got {rate_per_s}")
    rng = random.Random(seed)
    offsets, at = [], 0.0
    for _ in range(count):
        offsets.append(at)
        at += rng.expovariate(rate_per_s)
    return offsets
