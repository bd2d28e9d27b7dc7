"""An attribute of a torch class or module replaced while any of dynshard's compiles needs it replaced.

Compiles may overlap (threads), so each replacement is counted: the first context in installs it, the
last one out restores the original, unless something else replaced the attribute since (then it is
left as that other code set it).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator


class CountedPatch:
    """``owner().<name>`` set to ``replace(original)`` while :meth:`applied` is entered anywhere.
    ``owner`` is a function, so that the class or module (Inductor's) is imported at first use only."""

    def __init__(self, owner: Callable[[], Any], name: str, replace: Callable[[Any], Any]):
        self.owner, self.name, self.replace = owner, name, replace
        self.count, self.original, self.replacement = 0, None, None
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        owner = self.owner()
        with self.lock:
            self.count += 1
            if self.count == 1:
                self.original = vars(owner)[self.name]
                self.replacement = self.replace(self.original)
                setattr(owner, self.name, self.replacement)
        try:
            yield
        finally:
            with self.lock:
                self.count -= 1
                if self.count == 0:
                    if vars(owner).get(self.name) is self.replacement:
                        setattr(owner, self.name, self.original)
                    self.original = self.replacement = None
