"""The ``python_stdlib`` dataset: the source code of Python's standard library, as text.

The default corpus, because every machine that runs Forge has it and it needs no network:
the source files of a fixed, sorted list of pure-Python standard-library modules (about
3 MB), one document per module, read from the running interpreter's standard library.
Held-out modules form the "eval" split (``eval_fraction`` of them, spread through the list);
the rest are "train". Each split is packed into one token stream in memory; nothing is
cached on disk. The corpus is the running Python's: another Python version gives slightly
different text.
"""

from __future__ import annotations

import sysconfig
import tokenize
from pathlib import Path
from typing import Any

from forge_lm.components import DataContext
from forge_lm.data.packing import TokenStream, check_tokenizer, pack_documents
from forge_lm.data.splits import SplitIndices
from forge_lm.data.windows import WindowDataset
from forge_lm.errors import ConfigError, ForgeError

# Pure-Python modules present in every CPython from 3.11 on (none of those PEP 594 removed),
# sorted. A package contributes its __init__.py. Changing this list changes the default corpus.
MODULES = (
    "abc", "argparse", "ast", "base64", "bdb", "bisect", "calendar", "cmd", "code", "codecs",
    "codeop", "colorsys", "configparser", "contextlib", "copy", "copyreg", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "dis", "doctest", "enum", "filecmp", "fileinput", "fnmatch",
    "fractions", "ftplib", "functools", "genericpath", "getopt", "gettext", "glob", "graphlib",
    "gzip", "hashlib", "heapq", "hmac", "imaplib", "inspect", "ipaddress", "keyword", "linecache",
    "locale", "lzma", "mailbox", "mimetypes", "netrc", "ntpath", "numbers", "opcode", "operator",
    "optparse", "os", "pathlib", "pdb", "pickle", "pickletools", "pkgutil", "platform", "plistlib",
    "poplib", "posixpath", "pprint", "profile", "pstats", "py_compile", "pyclbr", "queue", "quopri",
    "random", "reprlib", "rlcompleter", "runpy", "sched", "secrets", "selectors", "shelve", "shlex",
    "shutil", "signal", "smtplib", "socket", "socketserver", "ssl", "stat", "statistics", "string",
    "stringprep", "struct", "subprocess", "symtable", "tabnanny", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "token", "tokenize", "trace", "traceback", "tracemalloc", "types",
    "typing", "uuid", "warnings", "wave", "weakref", "webbrowser", "zipapp", "zipfile",
)  # fmt: skip


def stdlib_directory() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_source(root: Path, module: str) -> Path | None:
    """The source file of ``module`` under ``root``: ``name.py``, or ``name/__init__.py``."""
    for candidate in (root / f"{module}.py", root / module / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def read_documents(root: Path | None = None) -> list[str]:
    """The source text of every module in :data:`MODULES` found under ``root``, in order.

    A module a distribution left out is skipped (some ship parts of the standard library
    separately); if none is found, the source files are not installed at all.
    """
    root = root if root is not None else stdlib_directory()
    sources = [path for module in MODULES if (path := module_source(root, module)) is not None]
    if not sources:
        raise ForgeError(
            f"the Python standard library's source files are not installed under '{root}' (only compiled "
            "files, or none): dataset 'python_stdlib' cannot read them. Install the Python source "
            "(e.g. a full CPython rather than an embedded one), or choose another [data] dataset."
        )
    texts = []
    for path in sources:
        with tokenize.open(path) as file:  # honours a module's coding declaration, if any
            texts.append(file.read())
    return texts


def build_python_stdlib(options: Any, context: DataContext) -> WindowDataset:
    tokenizer = check_tokenizer(context.tokenizer, context.vocab_size, "python_stdlib")
    documents = read_documents()
    chosen = SplitIndices(len(documents), options.eval_fraction, context.split)
    if not chosen:
        raise ConfigError(
            f"the {context.split} split of dataset 'python_stdlib' has no modules (eval_fraction = "
            f"{options.eval_fraction} of {len(documents)}); choose eval_fraction between "
            f"{1 / len(documents):.3f} and {1 - 1 / len(documents):.3f}, or set [eval] interval = 0."
        )
    tokens = pack_documents((documents[index] for index in chosen), tokenizer)
    source = f"the {context.split} split of dataset 'python_stdlib'"
    return WindowDataset(TokenStream([tokens]), context, eos_id=tokenizer.eos_id, source=source)
