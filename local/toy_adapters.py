"""Small LoRA adapters for the embedded model, built here with peft: what the LoRA tests and make bench-lora serve.

An adapter is either *taught* a few question-answer pairs (a few dozen steps of
training, seconds on a CPU: its answers are then far from the model's own and
decided by wide margins, which is what a test of exact greedy output needs), or
left *untrained* with peft's random, non-zero initialisation (a benchmark needs
an adapter's cost, not its answers). Seeded, so the same call builds the same
adapter.
"""

from __future__ import annotations

import logging
from pathlib import Path

LOGGER = logging.getLogger(__name__)
# Every linear layer of a Llama block: the modules vLLM's LoRA layers replace.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """The token ids vLLM's chat endpoint builds for one user message (the model's chat template)."""
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def build_adapter(checkpoint: Path, target: Path, *, lessons: tuple[tuple[str, str], ...] = (), rank: int = 8,
                  seed: int = 0, max_steps: int = 80, target_loss: float = 0.02) -> Path:
    """Saves a peft LoRA adapter for ``checkpoint`` in ``target``: taught ``lessons`` (question, answer), or
    untrained (random weights) without them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_MODULES), lora_dropout=0.0,
                        # Untrained, peft's random A and B (not its zero B): an adapter that changes the answers.
                        bias="none", task_type="CAUSAL_LM", init_lora_weights=bool(lessons))
    model = get_peft_model(model, config)
    if lessons:
        _teach(model, tokenizer, lessons, max_steps, target_loss)
    model.save_pretrained(target)
    return target


def _teach(model, tokenizer, lessons: tuple[tuple[str, str], ...], max_steps: int, target_loss: float) -> None:
    """Trains the adapter on the answers' tokens (the end-of-turn token included) until the loss is tiny."""
    import torch

    examples = []
    for question, answer in lessons:
        prompt = chat_prompt_ids(tokenizer, question)
        answer_ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + answer_ids])
        labels = torch.tensor([[-100] * len(prompt) + answer_ids])
        examples.append((ids, labels))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    loss_value = float("inf")
    for step in range(max_steps):  # noqa: B007 - the log says how many it took
        optimizer.zero_grad()
        loss = sum(model(input_ids=ids, labels=labels).loss for ids, labels in examples) / len(examples)
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
        if loss_value < target_loss:
            break
    model.eval()
    LOGGER.info("Adapter taught %d lesson(s) in %d steps (loss %.4f)", len(lessons), step + 1, loss_value)
