"""The chunk policy: first text at once, then by token count or interval, gapless sequence."""

from __future__ import annotations

import pytest

from pipeline.contract.chunking import ChunkAssembler, ChunkPolicy


def test_first_text_is_emitted_at_once_then_every_n_tokens():
    assembler = ChunkAssembler("r", 1, ChunkPolicy(chunk_tokens=3, interval_ms=10_000), started_at=0.0)
    assert assembler.add("", 0, 0.1) == []  # role-only event carries no text
    first = assembler.add("Hel", 1, 0.5)
    assert [(c.seq, c.text, c.tokens) for c in first] == [(0, "Hel", 1)]
    assert first[0].time_to_first_token_ms == 500.0
    assert assembler.add("lo", 2, 0.6) == []
    assert assembler.add(",", 3, 0.7) == []
    chunks = assembler.add(" w", 4, 0.8)
    assert [(c.seq, c.text, c.tokens) for c in chunks] == [(1, "lo, w", 4)]


def test_interval_emits_waiting_text_even_below_the_token_count():
    assembler = ChunkAssembler("r", 1, ChunkPolicy(chunk_tokens=100, interval_ms=200), started_at=0.0)
    assembler.add("a", 1, 0.0)
    assert assembler.add("b", 2, 0.1) == []
    assert assembler.due(0.15) == []
    assert [c.text for c in assembler.due(0.25)] == ["b"]
    assert assembler.due(0.9) == []  # nothing waiting
    assert [c.text for c in assembler.add("c", 3, 1.0)] == ["c"]  # interval passed since last chunk


def test_final_chunk_carries_the_rest_and_the_finish_reason():
    assembler = ChunkAssembler("r", 2, ChunkPolicy(chunk_tokens=10, interval_ms=10_000), started_at=0.0)
    emitted = assembler.add("x", 1, 0.1) + assembler.add("yz", 2, 0.2)
    final = assembler.finish("length", 2, 0.3)
    chunks = emitted + [final]
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert "".join(c.text for c in chunks) == assembler.text == "xyz"
    assert (final.final, final.finish_reason, final.tokens, final.attempt) == (True, "length", 2, 2)
    with pytest.raises(RuntimeError):
        assembler.add("more", 3, 0.4)


def test_empty_completion_still_ends_with_one_final_chunk():
    assembler = ChunkAssembler("r", 1, ChunkPolicy(), started_at=0.0)
    final = assembler.finish("stop", 0, 0.2)
    assert (final.seq, final.text, final.final, final.time_to_first_token_ms) == (0, "", True, None)


@pytest.mark.parametrize("tokens, interval", [(0, 100), (1, 0)])
def test_invalid_policy_is_rejected(tokens, interval):
    with pytest.raises(ValueError):
        ChunkPolicy(tokens, interval)
