"""A base for objects that own resources: ``close()`` and a ``with`` block, never ``__del__``."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class Closeable:
    """Use as a context manager; subclasses implement ``close()`` (idempotent)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
