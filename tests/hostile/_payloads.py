"""Hostile pickles for a checkpoint's ``.metadata``: each would create ``sentinel`` if an
unpickler ran what it names. Written opcode by opcode (``pickletools`` documents them), so that
each exercises one way into an unpickler: GLOBAL and STACK_GLOBAL, dotted names, REDUCE, BUILD,
INST, OBJ, NEWOBJ, NEWOBJ_EX, persistent ids, extension codes, every protocol."""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Callable
from pathlib import Path

DCP = "torch.distributed.checkpoint.metadata"


def _str(text: str) -> bytes:
    """SHORT_BINUNICODE / BINUNICODE of ``text``."""
    data = text.encode()
    return (b"\x8c" + bytes([len(data)]) if len(data) < 256 else b"X" + struct.pack("<I", len(data))) + data


def _stack_global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"


def _proto(n: int) -> bytes:
    return b"\x80" + bytes([n])


def command(sentinel: Path) -> str:
    return f"touch {sentinel}"


class _Exploit:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (command(self.sentinel),))


def reduce_with_protocol(protocol: int) -> Callable[[Path], bytes]:
    """What ``pickle.dumps`` writes for an object whose ``__reduce__`` names ``os.system``."""
    return lambda sentinel: pickle.dumps(_Exploit(sentinel), protocol=protocol)


def global_opcode(module: str, name: str) -> Callable[[Path], bytes]:
    """Protocol 0: GLOBAL module name, a one-string argument tuple, REDUCE."""
    return lambda sentinel: f"c{module}\n{name}\n(V{command(sentinel)}\ntR.".encode()


def stack_global_reduce(module: str, name: str) -> Callable[[Path], bytes]:
    """Protocol 4: STACK_GLOBAL (which resolves dotted names), a string argument, REDUCE."""
    return lambda sentinel: _proto(4) + _stack_global(module, name) + _str(command(sentinel)) + b"\x85R."


def inst_opcode(module: str, name: str) -> Callable[[Path], bytes]:
    """INST: MARK, arguments, then INST module name (finds and calls the class)."""
    return lambda sentinel: f"(V{command(sentinel)}\ni{module}\n{name}\n.".encode()


def obj_opcode(module: str, name: str) -> Callable[[Path], bytes]:
    """OBJ: MARK, the callable, its arguments, OBJ."""
    return lambda sentinel: _proto(2) + b"(" + f"c{module}\n{name}\n".encode() + _str(command(sentinel)) + b"o."


def newobj(module: str, name: str) -> Callable[[Path], bytes]:
    """NEWOBJ: cls.__new__(cls, *args); a class whose __new__ would act (subprocess.Popen)."""
    return lambda sentinel: (
        _proto(4) + _stack_global(module, name) + _str("sh") + _str("-c") + _str(command(sentinel)) + b"\x87\x85\x81."
    )


def newobj_ex(module: str, name: str) -> Callable[[Path], bytes]:
    """NEWOBJ_EX: cls.__new__(cls, *args, **kwargs)."""
    return lambda sentinel: (
        _proto(4) + _stack_global(module, name) + _str(command(sentinel)) + b"\x85}\x92."  # args, {} kwargs
    )


def partial_of_system() -> Callable[[Path], bytes]:
    """functools.partial(os.system, cmd)() through two REDUCEs."""
    return lambda sentinel: (
        _proto(4)
        + _stack_global("functools", "partial")
        + _stack_global("os", "system")
        + _str(command(sentinel))
        + b"\x86R)R."
    )


def methodcaller() -> Callable[[Path], bytes]:
    """operator.methodcaller('system', cmd)(os): a call through a method name."""
    return lambda sentinel: (
        _proto(4)
        + _stack_global("operator", "methodcaller")
        + _str("system")
        + _str(command(sentinel))
        + b"\x86R"
        + _stack_global("builtins", "__import__")
        + _str("os")
        + b"\x85R\x85R."
    )


def build_setstate_on_allowed(target: str) -> Callable[[Path], bytes]:
    """BUILD on an allowed class with slot state that would replace its ``__setstate__`` by
    ``os.system``, then a second object whose BUILD would call it."""
    return lambda sentinel: (
        _proto(4)
        + _stack_global(DCP, target)
        + b")\x81"  # an instance, NEWOBJ
        + b"N}"
        + _str("__setstate__")
        + _stack_global("os", "system")
        + b"s\x86b"  # (None, {"__setstate__": os.system}), BUILD
        + b"0"  # POP
        + _stack_global(DCP, target)
        + b")\x81"
        + _str(command(sentinel))
        + b"b."
    )


def build_on_allowed_harmless(target: str) -> Callable[[Path], bytes]:
    """Only allowed globals, but BUILD sets attributes on the class object itself."""
    return lambda sentinel: (
        _proto(4)
        + _stack_global(DCP, target)
        + b"N}"
        + _str("__reduce__")
        + _stack_global("torch", "Size")
        + b"s\x86b."
    )


def persistent_id() -> Callable[[Path], bytes]:
    return lambda sentinel: _proto(2) + _str(command(sentinel)) + b"Q."  # BINPERSID


def persistent_id_protocol0() -> Callable[[Path], bytes]:
    return lambda sentinel: f"P{command(sentinel)}\n.".encode()  # PERSID


def extension_code(code: int) -> Callable[[Path], bytes]:
    """EXT1: an object from copyreg's extension registry (resolved through find_class)."""
    return lambda sentinel: _proto(2) + b"\x82" + bytes([code]) + b"."


def memo_confusion() -> Callable[[Path], bytes]:
    """BINGET of a memo slot never written."""
    return lambda sentinel: _proto(2) + b"h\x07."


def metadata_like(relative_path: str, size: tuple[int, ...] = (4,), length: int = 16) -> Callable[[Path], bytes]:
    """A structurally plausible DCP Metadata whose storage points at ``relative_path``, built
    from the real classes so that only the chosen field is hostile."""

    def make(sentinel: Path) -> bytes:
        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        fqn = "state.model.tok_embeddings.weight"
        shape = torch.Size(size)
        tensor = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), shape, [ChunkStorageMetadata(torch.Size([0] * len(size)), shape)]
        )
        storage = {MetadataIndex(fqn, [0] * len(size), 0): _StorageInfo(relative_path, 0, length)}
        return pickle.dumps(Metadata({fqn: tensor}, storage_data=storage, planner_data={fqn: (fqn,)}))

    return make


def deeply_nested_toml(kind: str = "array", depth: int = 5000) -> str:
    """``x = [[[...]]]`` (``kind="array"``) or ``x = {a={a=...}}`` (``"table"``) nested ``depth``
    deep: deeper than Python's recursion limit, which a recursive TOML parser runs into."""
    if kind == "array":
        return "x = " + "[" * depth + "]" * depth + "\n"
    return "x = " + "{a=" * depth + "1" + "}" * depth + "\n"
