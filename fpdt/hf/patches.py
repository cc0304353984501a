"""Every change :func:`fpdt.hf.apply_fpdt` makes to a Transformers model, recorded so that
:func:`fpdt.hf.remove_fpdt` can undo it.

:class:`Patches` is the one way ``fpdt.hf`` modifies a module: :meth:`Patches.set` replaces an
instance attribute (a bound ``forward``, a bookkeeping attribute) and remembers what was there,
or that nothing was (the class's own attribute then shows through again after :meth:`undo`);
:meth:`Patches.replace` puts another module in place of a child module.
"""

from __future__ import annotations

import types
from typing import Any, Callable

_ABSENT = object()


class Patches:
    """The attributes set on a model's modules, in order, with what they replaced."""

    def __init__(self):
        self._done: list[tuple[Any, str, Any]] = []
        self._registered: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        """``obj.name = value``, remembering the instance's previous value (or its absence)."""
        self._done.append((obj, name, obj.__dict__.get(name, _ABSENT)))
        setattr(obj, name, value)

    def replace(self, parent: Any, name: str, module: Any) -> None:
        """Put ``module`` in place of ``parent``'s child module ``name``, remembering the child."""
        self._done.append((parent, name, getattr(parent, name)))
        setattr(parent, name, module)

    def remember(self, obj: Any, name: str) -> None:
        """Record ``obj.name`` as it is now (a dict as a copy of its items), for a change another
        library is about to make (DeepSpeed's external-parameter registry)."""
        before = obj.__dict__.get(name, _ABSENT)
        self._done.append((obj, name, dict(before) if isinstance(before, dict) else before))

    def register(self, interface: Any, key: str, value: Callable) -> None:
        """``interface.register(key, value)`` in one of Transformers' process-wide registries
        (``AttentionInterface``, ``AttentionMaskInterface``), remembering what ``key`` held."""
        self._registered.append((interface, key, interface._global_mapping.get(key, _ABSENT)))
        interface.register(key, value)

    def bind(self, obj: Any, name: str, function: Callable) -> None:
        """Replace the method ``obj.name`` with ``function`` bound to ``obj`` (its first argument)."""
        self.set(obj, name, types.MethodType(function, obj))

    def changed(self, obj: Any) -> set[str]:
        """The names set on ``obj`` so far."""
        return {name for o, name, _ in self._done if o is obj}

    def undo(self) -> None:
        """Restore every attribute, newest first, then every registry entry; the record is then empty."""
        while self._done:
            obj, name, before = self._done.pop()
            if before is _ABSENT:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, before)
        while self._registered:
            interface, key, before = self._registered.pop()
            if before is _ABSENT:
                interface._global_mapping.pop(key, None)
            else:
                interface.register(key, before)

    def __len__(self) -> int:
        return len(self._done) + len(self._registered)

    def __deepcopy__(self, memo) -> "Patches":
        # A copied model carries its own patched attributes (deep-copied with it) but cannot be
        # restored through the original's record: it gets an empty one.
        return Patches()
