"""What Forge lets lm-eval task files do: no Python code unless the user opts in, and templates in a sandbox.

Task YAML is read from configs and run directories, which Forge treats as untrusted input; loading
it must not run code. lm-eval runs code from task YAML in three ways, each handled here:

- ``!function module.name`` imports ``module.py`` from beside the file (or any importable module).
  :func:`scan_task_files` reads every task YAML lm-eval may load for Forge, except lm-eval's own
  installed tasks, before lm-eval sees it, and refuses such a tag.
- a ``metric_list`` metric that is not one of lm-eval's metrics (or has ``hf_evaluate: true``) is
  loaded with Hugging Face ``evaluate``, which runs the metric's Python script (a local file, or one
  downloaded from the Hub). The scan refuses those too.
- Jinja templates (``doc_to_text`` and the like) were rendered by a plain ``jinja2.Environment``, in
  which ``{{ cycler.__init__.__globals__.os.system(...) }}`` runs a command. :func:`sandbox_templates`
  swaps lm-eval's environment for a sandboxed one; that is unconditional.

The first two can be allowed with ``FORGE_LM_EVAL_TRUST_TASK_CODE=1`` in the environment: a process
setting, so a config file or a run directory cannot grant it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import yaml
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from forge_lm.errors import ForgeError

TRUST_ENV = "FORGE_LM_EVAL_TRUST_TASK_CODE"
FUNCTION_TAG = "!function"

# The same YAML parser lm-eval reads task files with (lm_eval/tasks/_yaml_loader.py: libyaml's when
# it is there, else PyYAML's own), so that a file is read the same way by the scan and by lm-eval:
# only composing is used (tags, strings, keys; nothing is constructed), which is identical for
# lm-eval's fallback FullLoader and SafeLoader.
_SAFE_BASE: type = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader

_FALSE = {"false", "no", "off"}

# lm-eval's own environment, as it was before :func:`sandbox_templates` replaced it (for tests).
LM_EVAL_ENV: jinja2.Environment | None = None


def trusts_task_code() -> bool:
    """Whether the user allowed task files to run Python code (the environment, never a config)."""
    return os.environ.get(TRUST_ENV, "").strip() == "1"


# --- Templates -------------------------------------------------------------------------------------


class TemplateSandboxError(SecurityError):
    """A task template tried something the sandbox forbids; carries the template's text."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(reason)
        self.source, self.reason = source, reason


class _SandboxedTemplate(jinja2.Template):
    source = ""

    def render(self, *args: object, **kwargs: object) -> str:
        try:
            return super().render(*args, **kwargs)
        except TemplateSandboxError:
            raise
        except SecurityError as exc:
            # lm-eval's apply_template knows the template but not its task: keep the text, so the
            # error can be traced to the task file that holds it.
            raise TemplateSandboxError(self.source, str(exc)) from None


class ForgeTemplateEnvironment(ImmutableSandboxedEnvironment):
    """lm-eval's template environment, sandboxed: no attributes starting with ``_``, no Python
    internals, no mutating of the document's lists and dicts."""

    template_class = _SandboxedTemplate

    def from_string(self, source, globals=None, template_class=None):
        template = super().from_string(source, globals, template_class)
        template.source = source if isinstance(source, str) else ""
        return template


def sandboxed_like(original: jinja2.Environment) -> ForgeTemplateEnvironment:
    """A sandboxed environment that renders as ``original`` (lm-eval's ``lm_eval.utils.env``) does.

    lm-eval 0.4 builds it as ``Environment(loader=BaseLoader, undefined=StrictUndefined,
    keep_trailing_newline=True)`` and registers the filter ``regex_replace``; those settings are
    copied from the object itself, and so are the filters, tests and globals it has that a fresh
    environment lacks (the sandbox's own ``range``, which bounds its length, is kept).
    """
    sandboxed = ForgeTemplateEnvironment(
        block_start_string=original.block_start_string,
        block_end_string=original.block_end_string,
        variable_start_string=original.variable_start_string,
        variable_end_string=original.variable_end_string,
        comment_start_string=original.comment_start_string,
        comment_end_string=original.comment_end_string,
        line_statement_prefix=original.line_statement_prefix,
        line_comment_prefix=original.line_comment_prefix,
        trim_blocks=original.trim_blocks,
        lstrip_blocks=original.lstrip_blocks,
        newline_sequence=original.newline_sequence,
        keep_trailing_newline=original.keep_trailing_newline,
        extensions=[type(extension) for extension in original.extensions.values()],
        optimized=original.optimized,
        undefined=original.undefined,
        finalize=original.finalize,
        autoescape=original.autoescape,
        loader=original.loader,
    )
    for mine, theirs in ((sandboxed.filters, original.filters), (sandboxed.tests, original.tests)):
        for name, function in theirs.items():
            mine.setdefault(name, function)
    for name, value in original.globals.items():
        sandboxed.globals.setdefault(name, value)
    return sandboxed


def sandbox_templates() -> None:
    """Make lm-eval render every task template in a sandbox (idempotent).

    lm-eval renders templates through ``lm_eval.utils.apply_template``, which looks up the module
    global ``env`` at each call; replacing that global covers every task. A module that imported
    ``env`` by name would keep the unsandboxed one, so any lm-eval module holding it is updated too
    (lm-eval 0.4.13 has none, but a later version might).
    """
    import lm_eval.utils

    original = lm_eval.utils.env
    if isinstance(original, ForgeTemplateEnvironment):
        return
    global LM_EVAL_ENV
    LM_EVAL_ENV, sandboxed = original, sandboxed_like(original)
    for name, module in list(sys.modules.items()):
        if (name == "lm_eval" or name.startswith("lm_eval.")) and getattr(module, "env", None) is original:
            module.env = sandboxed


def template_error(exc: BaseException) -> TemplateSandboxError | None:
    """The sandbox's error behind ``exc`` (lm-eval may wrap it), if there is one."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, TemplateSandboxError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


# --- Task files ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """Something in a task file that would make lm-eval run Python code."""

    path: Path
    line: int
    what: str


@dataclass
class TaskFileScan:
    """What the scan found: code lm-eval would run, and where each string value of the files is."""

    findings: list[Finding] = field(default_factory=list)
    strings: dict[str, tuple[Path, int]] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)

    def origin(self, text: str) -> tuple[Path, int] | None:
        return self.strings.get(text)


def lm_eval_tasks_dir() -> Path:
    """lm-eval's installed tasks: library code, trusted as the rest of lm-eval is."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


def scan_task_files(files: Sequence[Path], directories: Sequence[Path]) -> TaskFileScan:
    """Read ``files`` (task files given by path), every ``*.yaml`` under ``directories`` (the
    directories lm-eval indexes for Forge) and every file they ``include:``, as lm-eval would, and
    note each ``!function`` tag and metric lm-eval would load with ``evaluate``.

    A file under lm-eval's installed tasks is not read. A file YAML cannot parse is passed over:
    lm-eval's parser (the same) cannot parse it either, so lm-eval loads nothing from it.
    """
    from lm_eval.api.registry import metric_registry

    if len(metric_registry) == 0:
        import lm_eval.api.metrics  # noqa: F401 (registers lm-eval's metrics)

    installed = lm_eval_tasks_dir()
    scan = TaskFileScan()
    seen: set[Path] = set()
    pending = [path.resolve() for path in files]
    for directory in directories:
        # lm-eval's index walks each directory with this very pattern (lm_eval/tasks/_index.py).
        pending.extend(sorted(path.resolve() for path in directory.glob("**/*.yaml")))
    while pending:
        path = pending.pop(0)
        if path in seen or path.is_relative_to(installed) or not path.is_file():
            continue
        seen.add(path)
        try:
            root = yaml.compose(path.read_bytes(), Loader=_TaskYamlScanner)
        except (OSError, yaml.YAMLError):
            continue
        scan.files.append(path)
        if root is None:
            continue
        for node, key in _walk(root):
            line = node.start_mark.line + 1
            if node.tag == FUNCTION_TAG:
                reference = node.value if isinstance(node, yaml.ScalarNode) else "..."
                scan.findings.append(Finding(path, line, f"`{FUNCTION_TAG} {reference}` (lm-eval imports Python code)"))
            elif isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:str":
                scan.strings.setdefault(node.value, (path, line))
            if key == "include":
                # lm-eval follows the top-level ``include`` only; following every one is a superset
                # (a merge key ``<<`` can bring one to the top level from anywhere in the file).
                for target in _scalars(node):
                    # Where lm-eval looks (a relative path beside the file, ``~`` expanded only at
                    # the start of an absolute one), and the expanded path too: both are read.
                    given = Path(target)
                    pending.append((given if given.is_absolute() else path.parent / given).expanduser().resolve())
                    pending.append((path.parent / given.expanduser()).resolve())
            elif key == "metric_list" and isinstance(node, yaml.SequenceNode):
                scan.findings.extend(_metric_findings(path, node, metric_registry))
    return scan


def refuse_task_code(scan: TaskFileScan) -> None:
    """Stop, naming every place, when the scan found code and the user did not allow it."""
    if not scan.findings or trusts_task_code():
        return
    shown = scan.findings[:5]
    places = "\n".join(f"  {finding.path}, line {finding.line}: {finding.what}" for finding in shown)
    more = f"\n  ... and {len(scan.findings) - len(shown)} more" if len(scan.findings) > len(shown) else ""
    raise ForgeError(
        "refusing to load lm-eval task files that would run Python code:\n"
        f"{places}{more}\n"
        "Task files are read from configs and run directories, so Forge does not run code from them. "
        f"If you trust these files and the code beside them, set the environment variable {TRUST_ENV}=1 "
        "where you run forge (a config file cannot set it); otherwise remove the `!function` tags and use "
        "lm-eval's own metrics."
    )


def describe_template_error(error: TemplateSandboxError, scan: TaskFileScan, specs: Iterable[str]) -> ForgeError:
    """A Forge error for a template the sandbox stopped: which file and line hold it, and why."""
    template = error.source if len(error.source) <= 120 else error.source[:117] + "..."
    origin = scan.origin(error.source)
    where = f"task file '{origin[0]}', line {origin[1]}" if origin else f"one of the tasks {list(specs)}"
    return ForgeError(
        f"the template {template!r} in {where} was stopped: {error.reason.rstrip('.')}. "
        "Under Forge, lm-eval task templates run sandboxed: they can read the document's fields and use "
        "Jinja's filters, but not attributes starting with '_' or Python internals, nor change the "
        f"document. Rewrite the template without them ({TRUST_ENV} does not lift the sandbox)."
    )


class _TaskYamlScanner(_SAFE_BASE):
    """Composes task YAML without constructing anything: tags stay as written, nothing is imported."""


def _walk(root: yaml.Node) -> Iterator[tuple[yaml.Node, str | None]]:
    """Every node once (anchors and aliases may share or nest nodes), with the mapping key above it."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str | None]] = [(root, None)]
    while stack:
        node, key = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node, key
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                name = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                stack.append((key_node, None))
                stack.append((value_node, name))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, key) for item in node.value)


def _scalars(node: yaml.Node) -> list[str]:
    if isinstance(node, yaml.ScalarNode):
        return [node.value]
    if isinstance(node, yaml.SequenceNode):
        return [item.value for item in node.value if isinstance(item, yaml.ScalarNode)]
    return []


def _metric_findings(path: Path, metrics: yaml.SequenceNode, registry: object) -> Iterator[Finding]:
    """Metrics lm-eval would hand to Hugging Face ``evaluate`` (lm_eval.api.registry.get_metric):
    a name lm-eval does not register, or any name with ``hf_evaluate: true``."""
    for entry in metrics.value:
        if not isinstance(entry, yaml.MappingNode):
            continue
        values = {key.value: value for key, value in entry.value if isinstance(key, yaml.ScalarNode)}
        metric, hf_evaluate = values.get("metric"), values.get("hf_evaluate")
        if not isinstance(metric, yaml.ScalarNode) or metric.tag == FUNCTION_TAG:
            continue  # a !function metric is reported as the tag
        line, name = metric.start_mark.line + 1, metric.value
        if name not in registry:  # type: ignore[operator]
            what = f"metric '{name}' is not one of lm-eval's, so `evaluate` would load it (runs its code)"
            yield Finding(path, line, what)
        elif hf_evaluate is not None and not (
            isinstance(hf_evaluate, yaml.ScalarNode) and hf_evaluate.value.strip().lower() in _FALSE
        ):
            yield Finding(path, line, f"metric '{name}' with hf_evaluate: `evaluate` would load it (runs its code)")
