"""Notes: the messages the core leaves for a front end to show, each under the key of its cause.

The core neither logs nor warns; it adds a note, and a front end shows the first note of each key, once (a cause that
recurs, such as the same layer overflowing at step 3 and at step 9, is said once). The key is chosen by whoever adds
the note, never read back from the message's text.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import overload


class Notes(Sequence[str]):
    """The messages, in the order they were added (it reads as a list of strings), with their keys.

    :meth:`add` always appends; :meth:`add_once` appends unless the same ``(key, per)`` was added with it before
    (``per``: e.g. the step, for a cause that is noted once per step).
    """

    def __init__(self) -> None:
        self._keys: list[str] = []
        self._messages: list[str] = []
        self._once: set[tuple[str, Hashable]] = set()
        self.added = 0
        """How many notes were added (a plain attribute: a front end compares it with what it showed, every step)."""

    def add(self, key: str, message: str) -> None:
        self._keys.append(key)
        self._messages.append(message)
        self.added += 1

    def add_once(self, key: str, message: str, *, per: Hashable = None) -> bool:
        """Append unless ``(key, per)`` was added once already; returns whether it was appended."""
        if (key, per) in self._once:
            return False
        self._once.add((key, per))
        self.add(key, message)
        return True

    def keyed(self, start: int = 0) -> list[tuple[str, str]]:
        """``(key, message)`` of the notes from index ``start`` on."""
        return list(zip(self._keys[start:], self._messages[start:]))

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self._messages[index]

    def __len__(self) -> int:
        return len(self._messages)

    def __iter__(self) -> Iterator[str]:
        return iter(self._messages)

    def __repr__(self) -> str:
        return f"Notes({self._messages!r})"
