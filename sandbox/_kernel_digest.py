"""A digest of the interpreter state, computed INSIDE the sandbox after a line runs (part of the kernel program).

``sandbox.launch`` hands this file's source to ``_kernel_side.py`` (which runs it in a namespace of its own), so it
may use the standard library only; the host imports it too (``sandbox.state``), to name the state of a fresh
kernel and to unit-test the encoding. Only two short hashes leave the kernel, never a value.

What counts as state: every binding in the user's namespace except the dunder names the interpreter puts there
(``__name__``, ``__doc__``, ``__builtins__``, ...), ``_`` (the throw-away name; the display hook keeps the last value
in ``builtins._``, outside the namespace) and the injected tools (``submit``). A module counts as ``module <name>``;
a function as its code (bytecode, constants, referenced names, defaults; not its own name or its argument names), so
``def f(x): return x + 1`` and ``def g(y): return y + 1`` are the same value; a class as ``class <qualname>``.

Values are encoded with the base types' own methods, never the object's (no ``__repr__``, ``__eq__``, ``__hash__``
or property of the user's runs): None, bool, int, float, complex, str, bytes, range, and list / tuple / dict / set /
frozenset of them (dicts and sets in a canonical order). Anything else -- instances of user classes, subclasses of
the base types, generators, files -- is the marker ``<type name>``; so is a value too large to digest cheaply (a str
or bytes past ``MAX_CHARS``, an int past ``MAX_INT_BITS``, a container past ``MAX_ITEMS`` elements or ``MAX_DEPTH``
levels), and every value met after ``BUDGET`` elements in one digest. The cost is bounded by those limits, not by
the namespace.

Two digests: ``named`` hashes the sorted (name, value) pairs; ``values`` hashes the sorted multiset of values alone,
so ``a = 4175`` and ``total = 4175`` give the same ``values`` digest. Hashes are blake2b, independent of
``PYTHONHASHSEED`` and of object ids: equal states in two kernels give equal digests.
"""

import hashlib
import time
import types

MAX_CHARS = 10_000
"""A str or bytes longer than this is the marker ``<str>`` / ``<bytes>``."""
MAX_INT_BITS = 65_536
"""An int longer than this many bits is the marker ``<int>``."""
MAX_ITEMS = 1_000
"""A container with more elements than this is the marker ``<list>``, ``<dict>``, ..."""
MAX_DEPTH = 4
"""Containers nested deeper than this are markers."""
BUDGET = 20_000
"""Elements encoded per digest; every value after that is a marker (bounds the cost of a big namespace)."""
DIGEST_BYTES = 8
"""Length of each hash (16 hex characters)."""


class _Walk:
    """One digest's encoder: counts elements against BUDGET and values that became markers."""

    def __init__(self):
        self.left = BUDGET
        self.marked = 0

    def marker(self, value):
        self.marked += 1
        return b"<" + type(value).__name__.encode("utf-8", "replace") + b">"

    def encode(self, value, depth=0):
        self.left -= 1
        if self.left < 0:
            return self.marker(value)
        t = type(value)
        if value is None or t is bool:
            return repr(value).encode()
        if t is int:
            if int.bit_length(value) > MAX_INT_BITS:
                return self.marker(value)
            return b"i" + int.to_bytes(value, (int.bit_length(value) + 8) // 8, "little", signed=True)
        if t is float:
            return b"f" + float.hex(value).encode()
        if t is complex:
            return b"c" + float.hex(value.real).encode() + b"," + float.hex(value.imag).encode()
        if t is str:
            if len(value) > MAX_CHARS:
                return self.marker(value)
            return b"s" + str.encode(value, "utf-8", "surrogatepass")
        if t is bytes:
            return b"b" + value if len(value) <= MAX_CHARS else self.marker(value)
        if t is range:
            return b"r" + repr((value.start, value.stop, value.step)).encode()
        if t is types.ModuleType:
            name = vars(value).get("__name__")
            return b"m" + (str.encode(name, "utf-8", "replace") if type(name) is str else b"?")
        if t is types.FunctionType:
            return b"F" + self.code(value.__code__) + b"|" + self.encode(value.__defaults__, depth + 1)
        if t is type:
            return b"T" + type.__dict__["__qualname__"].__get__(value).encode("utf-8", "replace")
        if t in (list, tuple, dict, set, frozenset):
            if depth >= MAX_DEPTH or len(value) > MAX_ITEMS:
                return self.marker(value)
            if t is dict:
                parts = sorted(self.encode(k, depth + 1) + b":" + self.encode(v, depth + 1)
                               for k, v in dict.items(value))
            elif t in (set, frozenset):
                members = (set.__iter__ if t is set else frozenset.__iter__)(value)
                parts = sorted(self.encode(v, depth + 1) for v in members)
            else:
                parts = [self.encode(v, depth + 1) for v in (list.__iter__ if t is list else tuple.__iter__)(value)]
            return t.__name__[:2].encode() + b"(" + _hash(b"\x00".join(parts)) + b")"
        return self.marker(value)

    def code(self, co):
        """A code object by what it computes: bytecode, constants (nested code included), referenced names."""
        self.left -= 1
        consts = [self.code(c) if type(c) is types.CodeType else self.encode(c, MAX_DEPTH - 1) for c in co.co_consts]
        return _hash(b"\x00".join([co.co_code, repr(co.co_names).encode(), repr(co.co_argcount).encode(), *consts]))


def _hash(data):
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).hexdigest().encode()


def _counts_as_state(name, hidden):
    return type(name) is str and name != "_" and not (name.startswith("__") and name.endswith("__")) \
        and name not in hidden


def state_digest(namespace, hidden=()):
    """``{"named": hex, "values": hex, "ms": float, "marked": int, "names": int}`` of a namespace (see the module
    docstring); ``hidden`` are names that are not state (the injected tools)."""
    t0 = time.perf_counter()
    walk = _Walk()
    pairs = sorted((str.encode(name, "utf-8", "surrogatepass"), _hash(walk.encode(value)))
                   for name, value in list(dict.items(namespace)) if _counts_as_state(name, hidden))
    named = _hash(b"\x00".join(n + b"=" + v for n, v in pairs)).decode()
    values = _hash(b"\x00".join(sorted(v for _, v in pairs))).decode()
    return {"named": named, "values": values, "ms": (time.perf_counter() - t0) * 1000.0, "marked": walk.marked,
            "names": len(pairs)}

