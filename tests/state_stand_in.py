"""State cells and timers as a runner keeps them between work items, for tests that call a DoFn's methods."""

from __future__ import annotations


class Cell:
    """A value or bag state cell."""

    def __init__(self, value=None) -> None:
        self.value = value

    def read(self):
        return self.value

    def write(self, value) -> None:
        self.value = value

    def add(self, value) -> None:
        self.value = [*(self.value or []), value]

    def clear(self) -> None:
        self.value = None


class Timer:
    """A timer: when it is set for (None when cleared, or fired)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def set(self, timestamp) -> None:
        self.at = float(timestamp)

    def clear(self) -> None:
        self.at = None
