"""Names that changed keep working for one release, with a DeprecationWarning
naming their replacement.

Vendors ship plugins from their own repositories, and engines call the
runner from theirs: neither moves in step with graphmode. So a public name
(docs/hooks.md lists them) that is renamed keeps its old spelling for a
release; the warning says what to write instead. Remove an entry one release
after it was added.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["renamed_keywords", "warn_deprecated"]

F = TypeVar("F", bound=Callable[..., Any])


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (both as the
    caller would write them), pointing at the caller's caller by default."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_keywords(where: str, **renames: str) -> Callable[[F], F]:
    """Accept each old keyword argument (``old=new`` pairs) as its new name,
    with a DeprecationWarning; passing both is a TypeError. ``where`` names
    the callable in the warning (``"build_graph_runner"``)."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(
                            f"{where} got both {old}= (deprecated) and {new}=; pass {new}= only"
                        )
                    warn_deprecated(f"{where}({old}=...)", f"{where}({new}=...)")
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
