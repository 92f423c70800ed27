"""Task files cannot run code: a ``!function`` tag (or a metric lm-eval would load with
``evaluate``) is refused unless FORGE_LM_EVAL_TRUST_TASK_CODE=1 is set where forge runs, and
templates always render in a Jinja sandbox, as they rendered before when they are ordinary."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import lm_eval.utils
import pytest
import torch
from lm_eval.api.model import LM

from forge_lm.cli._main import main
from forge_lm.errors import ForgeError
from forge_lm_eval import safety
from forge_lm_eval.harness import TaskSet, metrics_of, run_tasks
from forge_lm_eval.safety import TRUST_ENV, ForgeTemplateEnvironment, lm_eval_tasks_dir, scan_task_files

from .conftest import CHOICE, COMPLETE, ROLLING, TASKS, TINY

DATA = TASKS / "data" / "choice.jsonl"


def task_yaml(name: str, **fields: str) -> str:
    """A multiple-choice task over the tests' choice data (by absolute path), with ``fields``
    (raw YAML values) replacing or adding keys."""
    keys = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": f"{{data_files: {{train: {json.dumps(str(DATA))}}}}}",
        "output_type": "multiple_choice",
        "test_split": "train",
        "doc_to_text": '"{{question}}"',
        "doc_to_choice": '"{{choices}}"',
        "doc_to_target": '"{{answer}}"',
        "metric_list": "[{metric: acc, aggregation: mean, higher_is_better: true}]",
        **fields,
    }
    return "".join(f"{key}: {value}\n" for key, value in keys.items())


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    return tmp_path / "code-ran"


@pytest.fixture
def function_task(tmp_path: Path, sentinel: Path) -> Path:
    """A task whose process_docs is ``!function evil.docs``: importing evil.py creates ``sentinel``."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).write_text('ran')\n\ndef docs(dataset):\n    return dataset\n"
    )
    path = tasks / "task.yaml"
    path.write_text(task_yaml("forge_test_evil", process_docs="!function evil.docs"))
    return path


def jinja_payload(sentinel: Path) -> str:
    return json.dumps(f"{{{{ cycler.__init__.__globals__.os.system('touch {sentinel}') }}}}")


class ConstantLM(LM):
    """An lm-eval model that answers every request the same way, so that tasks run in an instant."""

    device = torch.device("cpu")

    def loglikelihood(self, requests):
        return [(-1.0, False) for _ in requests]

    def loglikelihood_rolling(self, requests):
        return [-1.0 for _ in requests]

    def generate_until(self, requests):
        return ["" for _ in requests]


def test_a_function_tag_is_refused_naming_the_file_the_line_and_the_variable(function_task, sentinel, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    with pytest.raises(ForgeError) as refused:
        TaskSet([str(function_task)], 64)
    message = str(refused.value)
    assert f"{function_task}, line 10: `!function evil.docs`" in message
    assert f"{TRUST_ENV}=1" in message
    assert not sentinel.exists()


def test_a_config_naming_such_a_task_stops_forge_train_with_one_message_and_exit_2(
    function_task, sentinel, tmp_path, monkeypatch, capsys
):
    # The review's reproducer: a run config (or a run's config.toml, re-run) naming the task.
    monkeypatch.delenv(TRUST_ENV, raising=False)
    config = tmp_path / "config.toml"
    config.write_text(
        f'[eval]\ninterval = 1\nevaluators = ["lm_eval"]\n[eval.lm_eval]\ntasks = [{json.dumps(str(function_task))}]\n'
    )
    run_dir = tmp_path / "run"
    args = [*TINY, "--eval.interval=1", f"--train.output_dir={run_dir}"]
    assert main(["--plugins", "lm_eval", "train", str(config), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("forge: error: refusing to load lm-eval task files that would run Python code:\n")
    assert f"{TRUST_ENV}=1" in err
    assert "Traceback" not in err
    assert not sentinel.exists()
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize("value", ["", "0", "true", "yes"])
def test_only_the_variable_set_to_1_trusts_task_code(function_task, sentinel, monkeypatch, value):
    monkeypatch.setenv(TRUST_ENV, value)
    with pytest.raises(ForgeError, match="refusing to load lm-eval task files"):
        TaskSet([str(function_task)], 64)
    assert not sentinel.exists()


def test_with_the_variable_set_the_code_of_a_task_file_runs(function_task, sentinel, monkeypatch):
    monkeypatch.setenv(TRUST_ENV, "1")
    tasks = TaskSet([str(function_task)], 64)
    assert sentinel.read_text() == "ran"
    assert list(tasks.specs) == [str(function_task)]


def test_code_in_an_included_file_a_sibling_or_an_include_path_directory_is_refused(tmp_path, sentinel, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "base.yaml").write_text("process_docs: !function evil.docs\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    given = mine / "task.yaml"
    given.write_text(f"include: {shared / 'base.yaml'}\n" + task_yaml("forge_test_included"))
    with pytest.raises(ForgeError, match=rf"{shared / 'base.yaml'}, line 1: `!function evil.docs`"):
        TaskSet([str(given)], 64)

    # lm-eval indexes the given file's directory and each include_path directory, subdirectories too.
    given.write_text(task_yaml("forge_test_plain"))
    (mine / "sibling.yaml").write_text(task_yaml("forge_test_sibling", doc_to_text="!function evil.text"))
    with pytest.raises(ForgeError, match=r"sibling.yaml, line 6: `!function evil.text`"):
        TaskSet([str(given)], 64)
    (mine / "sibling.yaml").unlink()
    deep = tmp_path / "more" / "deep"
    deep.mkdir(parents=True)
    (deep / "other.yaml").write_text(task_yaml("forge_test_other", **{"class": "!function evil.Task"}))
    with pytest.raises(ForgeError, match=r"other.yaml, line 10: `!function evil.Task`"):
        TaskSet([str(given)], 64, include_path=[str(tmp_path / "more")])
    assert not sentinel.exists()


def test_a_metric_lm_eval_would_load_with_evaluate_is_refused(tmp_path, sentinel, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    script = tmp_path / "metric.py"
    script.write_text(f"import pathlib\npathlib.Path({str(sentinel)!r}).write_text('ran')\n")
    given = tmp_path / "task.yaml"
    given.write_text(task_yaml("forge_test_metric", metric_list=f"[{{metric: {json.dumps(str(script))}}}]"))
    with pytest.raises(ForgeError, match=rf"line 9: metric '{script}' is not one of lm-eval's"):
        TaskSet([str(given)], 64)
    given.write_text(task_yaml("forge_test_metric", metric_list="[{metric: exact_match, hf_evaluate: true}]"))
    with pytest.raises(ForgeError, match="metric 'exact_match' with hf_evaluate: `evaluate` would load it"):
        TaskSet([str(given)], 64)
    assert not sentinel.exists()


def test_lm_evals_installed_tasks_are_library_code_and_not_scanned(tmp_path):
    installed = lm_eval_tasks_dir() / "hellaswag" / "hellaswag.yaml"
    assert "!function" in installed.read_text()  # lm-eval's own task code, beside it in the package
    given = tmp_path / "task.yaml"
    given.write_text(f"include: {installed}\ntask: my_hellaswag\n")
    assert scan_task_files([given], [tmp_path]).findings == []


@pytest.mark.parametrize("trusted", [False, True])
def test_a_template_reaching_for_python_is_stopped_even_when_code_is_trusted(tmp_path, sentinel, monkeypatch, trusted):
    if trusted:
        monkeypatch.setenv(TRUST_ENV, "1")
    given = tmp_path / "task.yaml"
    given.write_text(task_yaml("forge_test_jinja", doc_to_text=jinja_payload(sentinel)))
    with pytest.raises(ForgeError) as stopped:
        TaskSet([str(given)], 64)
    message = str(stopped.value)
    assert f"in task file '{given}', line 6 was stopped: access to attribute '__init__'" in message
    assert "run sandboxed" in message
    assert not sentinel.exists()


def test_a_template_stopped_on_a_later_document_is_named_when_the_tasks_run(tmp_path, sentinel):
    # The first document loads cleanly; the second one reaches for a class when lm-eval renders it.
    template = json.dumps("{% if 'os.path' in question %}{{ question.__class__.__mro__ }}{% endif %}{{question}}")
    given = tmp_path / "task.yaml"
    given.write_text(task_yaml("forge_test_later", doc_to_text=template))
    tasks = TaskSet([str(given)], 64)
    with pytest.raises(ForgeError, match=rf"in task file '{given}', line 6 was stopped: .*'__class__'"):
        run_tasks(ConstantLM(), tasks, limit=3)


def test_lm_evals_environment_is_replaced_by_a_sandbox_with_the_same_settings():
    original = safety.LM_EVAL_ENV
    assert isinstance(original, jinja2.Environment)
    assert not isinstance(original, ForgeTemplateEnvironment)
    env = lm_eval.utils.env
    assert isinstance(env, ForgeTemplateEnvironment)
    assert env.sandboxed
    assert (env.loader, env.undefined, env.keep_trailing_newline) == (
        original.loader,
        original.undefined,
        original.keep_trailing_newline,
    )
    assert env.filters["regex_replace"] is lm_eval.utils.regex_replace
    assert set(env.filters) == set(original.filters)
    assert set(env.tests) == set(original.tests)


@pytest.mark.parametrize(
    ("template", "doc"),
    [
        ("{{question}}", {"question": "def add(a, b):\n    return a"}),
        ("{{choices}}", {"choices": [" + b", " - b"]}),
        ("{{answer}}", {"answer": 0}),
        ("{{text}}\n", {"text": "trailing newline kept"}),
        # From lm-eval's own tasks (lambada_cloze, polemo2) and its regex_replace filter.
        ("{{text.split(' ')[:-1]|join(' ')}} ____. ->", {"text": "the quick brown fox"}),
        ("{{['__label__a', '__label__b'].index(target)}}", {"target": "__label__b"}),
        ("{{ query|regex_replace('\\\\s+', ' ') }}", {"query": "a  b\t c"}),
        ("{% for c in choices %}{{ loop.index }}. {{ c|trim }}\n{% endfor %}", {"choices": [" x", "y "]}),
        ("{{ '%s: %s'|format(a, b) }} {{ '{}!'.format(a) }}", {"a": "1", "b": "2"}),
    ],
)
def test_ordinary_templates_render_as_lm_evals_own_environment_renders_them(template, doc):
    expected = safety.LM_EVAL_ENV.from_string(template).render(**doc)
    assert lm_eval.utils.apply_template(template, doc) == expected


def test_a_missing_field_is_still_an_error_as_in_lm_eval():
    with pytest.raises(jinja2.UndefinedError):
        lm_eval.utils.apply_template("{{missing}}", {"question": "x"})


def test_the_plugins_test_tasks_load_and_run_in_the_sandbox(in_tasks_dir):
    tasks = TaskSet([CHOICE, COMPLETE, ROLLING], 64)
    assert tasks.scan.findings == []
    results = run_tasks(ConstantLM(), tasks, limit=2)
    assert {"eval/forge_test_choice/acc", "eval/forge_test_complete/exact_match"} <= set(metrics_of(results))


def test_the_readme_says_how_task_code_is_trusted_and_that_templates_are_sandboxed():
    text = (Path(__file__).resolve().parents[3] / "plugins" / "forge-lm-eval" / "README.md").read_text()
    section = text.split("### Task code and templates", 1)[1].split("\n## ", 1)[0]
    assert f"`{TRUST_ENV}=1`" in section
    assert "a config file cannot set it" in section
    assert "in a sandbox: always" in section
