"""Fixtures shared by every test: fresh plugin managers, fake installed plugins, the CLI."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from forge_lm.plugins import PluginManager, PluginSettings


@pytest.fixture(autouse=True)
def _no_plugin_switches_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start from the default switches, whatever the developer's shell exports."""
    for name in list(os.environ):
        if name.startswith("FORGE_LM_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session", autouse=True)
def _ctrl_c_as_in_a_terminal() -> None:
    """Python's own Ctrl-C handling in this process and the commands it starts, even where pytest
    was started with SIGINT ignored (a background job of a non-interactive shell): the Ctrl-C
    tests send real SIGINTs, which an inherited "ignore" would swallow."""
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def manager() -> PluginManager:
    """A plugin manager with the built-ins only (third-party autoloading off)."""
    return PluginManager(PluginSettings(autoload=False))


class FakeSite:
    """A directory on ``sys.path`` into which tests install real (tiny) distributions.

    Each distribution gets a ``.dist-info`` with METADATA and ``entry_points.txt`` and a
    module, so ``importlib.metadata`` finds it exactly as it finds a pip-installed plugin.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: list[str] = []

    def install(
        self,
        dist: str,
        source: str = "",
        *,
        version: str = "1.0",
        module: str | None = None,
        entry_points: dict[str, str] | None = None,
    ) -> str:
        """Install ``dist`` whose module holds ``source``; return the module name."""
        module = module or dist.replace("-", "_")
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        points = entry_points if entry_points is not None else {dist.rpartition("-")[2]: module}
        lines = "".join(f"{name} = {target}\n" for name, target in points.items())
        (info / "entry_points.txt").write_text(f"[forge_lm]\n{lines}")
        self.modules.append(module)
        importlib.invalidate_caches()
        return module


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSite:
    site = FakeSite(tmp_path / "site")
    site.root.mkdir()
    monkeypatch.syspath_prepend(str(site.root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site.root), os.environ.get("PYTHONPATH", "")]))
    yield site
    for module in site.modules:
        sys.modules.pop(module, None)


@pytest.fixture
def forge_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the ``forge`` command in a fresh interpreter; returns the completed process."""

    def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        full_env = {**os.environ, **(env or {})}
        return subprocess.run(
            [sys.executable, "-m", "forge_lm", *args],
            capture_output=True,
            text=True,
            env=full_env,
            cwd=cwd,
            timeout=120,
        )

    return run


# --- Test tiers -----------------------------------------------------------------------------
# `make test` runs everything but `bench`; `make test-fast` runs `-m "not slow and not bench"`.
# A test is `slow` when it launches ranks (torchrun, spawned process groups), runs the `forge`
# command in a fresh interpreter, or trains a model for more than a few seconds; the files and
# tests below are marked here, by path, so the tiering is in one place and a test module needs no
# marker of its own (one may still carry `@pytest.mark.slow` itself). An entry is a file, a
# directory (ending in "/"), a test ("file::name", every parametrization of it) or, ending in ":",
# the start of test ids. Tests using a fixture of SLOW_FIXTURES are slow wherever they are.
SLOW_TESTS: tuple[str, ...] = (
    # Ranks launched with torchrun or spawned process groups.
    "tests/core/checkpoint/test_finite.py::test_two_ranks_agree_on_a_nan_in_one_ranks_shard",
    "tests/core/checkpoint/test_staging.py::test_two_ranks_gather_the_skeletons_to_rank_0_only",
    "tests/core/checkpoint/test_object_store.py::test_two_sharded_ranks_load_a_one_process_checkpoint_from_the_bucket",
    "tests/core/checkpoint/test_object_store.py::test_two_sharded_ranks_save_to_the_bucket_and_resume_from_it_bit_for_bit",
    "tests/core/data/test_streaming.py::test_two_rank_training_resumes_bit_for_bit_from_a_checkpoint_holding_both_ranks_positions",
    "tests/core/data/test_streaming.py::test_a_loader_reading_ahead_gathers_the_ranks_positions_only_for_a_checkpoint",
    "tests/core/distributed/test_context_parallel.py",
    "tests/core/distributed/test_data_parallel.py",
    "tests/core/distributed/test_meta_init.py",
    "tests/core/distributed/test_pp_validation.py",
    "tests/core/distributed/test_teardown.py",
    "tests/core/testing/test_torchrun_launcher.py",
    "tests/core/distributed/test_tensor_parallel.py",
    "tests/core/distributed/test_torchrun_cli.py",
    "tests/core/observability/test_collective_timeout.py",
    "tests/core/observability/test_hang_under_torchrun.py",
    "tests/core/distributed/test_fp16_ranks.py",
    "tests/core/train/test_growth_fsdp.py",
    "tests/core/observability/test_health.py::test_doctor_under_torchrun_reports_the_health_check_of_each_rank",
    "tests/core/observability/test_health.py::test_doctor_under_torchrun_fails_naming_a_slow_rank",
    "tests/hostile/test_distributed.py",
    "tests/plugins/forge_deepseek/test_distributed.py",
    "tests/plugins/forge_float8/test_fsdp.py",
    "tests/plugins/forge_moe/test_checkpointing.py",
    "tests/plugins/forge_optim_muon/test_distributed_checkpoint.py",
    "tests/plugins/forge_moe/test_expert_parallel.py::test_ep2_gives_the_single_process_loss_and_gradients",
    "tests/plugins/forge_optim_muon/test_fsdp.py",
    "tests/plugins/forge_vlm/test_distributed.py",
    "tests/test_readme.py::test_readme_torchrun_command_trains_on_two_cpu_ranks",
    # Subprocesses: the forge command, benchmark scripts, watchdogs and signals, fresh interpreters.
    "tests/benchmarks/test_bench_gpu.py",
    "tests/core/cli/test_train_commands.py",
    "tests/core/cli/test_log_interval.py",
    "tests/core/checkpoint/test_object_store.py::test_a_run_killed_after_a_save_resumes_from_the_bucket_bit_for_bit",
    "tests/core/checkpoint/test_object_store.py::test_the_resume_rules_hold_for_a_run_whose_checkpoints_are_in_a_bucket",
    "tests/core/observability/test_watchdog.py",
    "tests/core/test_import_noise.py",
    "tests/examples/",
    "tests/hostile/test_hangs.py",
    "tests/hostile/test_run_dirs.py",
    "tests/hostile/test_disk.py",
    "tests/hostile/test_startup.py",
    "tests/hostile/test_messages.py",
    "tests/packaging/test_metadata.py::test_make_dist_builds_one_wheel_and_one_sdist_per_distribution",
    "tests/packaging/test_wheels.py",
    "tests/plugins/forge_float8/test_benchmark.py",
    "tests/plugins/forge_lm_eval/test_cli.py",
    # Training runs, compilation and measurements of several seconds each: the training tests
    # of the core and the hostile-input cases that train or resume a run.
    "tests/core/train/",
    "tests/hostile/test_checkpoints.py",
    "tests/hostile/test_component_failures.py",
    "tests/hostile/test_integrity.py",
    "tests/hostile/test_interop.py",
    "tests/hostile/test_plugins.py",
    "tests/kit_mutants/",
    "tests/plugins/forge_lm_eval/test_readme.py",
    "tests/plugins/forge_vlm/test_pretrained.py",
    "tests/plugins/forge_vlm/test_training.py",
    "tests/plugins/forge_wandb/test_training.py",
    "tests/core/checkpoint/test_optimizer_settings.py",
    "tests/core/cli/test_finished_run.py",
    "tests/core/config/test_component_change.py::test_forge_train_notes_the_drop_before_it_trains",
    "tests/core/data/test_streaming.py::test_training_resumed_from_a_checkpoint_matches_the_uninterrupted_run_bit_for_bit",
    "tests/core/distributed/test_compile_blocks.py",
    "tests/core/metrics/test_mfu.py::test_the_real_measurement_is_a_positive_finite_rate",
    "tests/core/distributed/test_activation_checkpointing.py",
    "tests/core/model/test_attention_backends.py",
    "tests/core/model/test_export_tokenizer.py",
    "tests/core/model/test_load_pretrained.py",
    "tests/core/model/test_memory_estimate.py::test_validation_reports_the_estimate_and_refuses_what_train_would",
    "tests/core/observability/test_profiling.py",
    "tests/core/plugins/test_hook_failures.py",
    "tests/core/testing/test_builtin_conformance.py::test_builtin_component_honours_its_contract[optimizers:",
    "tests/core/testing/test_writing_a_plugin_doc.py",
    "tests/core/testing/test_model_family_checks.py",
    "tests/core/testing/test_attention_checks.py",
    "tests/core/testing/test_kit_catches_broken_components.py::test_optimizer_failure_states_the_pass_mark",
    "tests/plugins/forge_deepseek/test_hf.py::test_forge_import_hf_of_a_deepseek_v3_gives_transformers_logits",
    "tests/plugins/forge_deepseek/test_optimizers_and_float8.py",
    "tests/plugins/forge_deepseek/test_training.py",
    "tests/plugins/forge_float8/test_training.py",
    "tests/plugins/forge_lm_eval/test_parity.py",
    "tests/plugins/forge_lm_eval/test_python_lines.py::test_a_trained_model_scores_clearly_above_an_untrained_one",
    "tests/plugins/forge_lm_eval/test_training.py",
    "tests/plugins/forge_moe/test_compile_moe.py",
    "tests/plugins/forge_moe/test_training.py",
    "tests/plugins/forge_prometheus/test_training.py",
    "tests/plugins/forge_vlm/test_cross_attention_training.py",
    "tests/plugins/forge_vlm/test_generate.py",
    "tests/test_readme.py::test_readme_demo_loss_starts_where_the_readme_says_and_step_1_is_logged",
    "tests/test_tiers.py::test_the_fast_tier_deselects_what_the_entries_mark",
)
# Fixtures that launch ranks, build wheels or train a run: every test using one is slow (its
# first user pays for it). "ranks" is test_health.py's two-rank launch; "one_process_runs" and
# "launches_by_rank_count" are tests/core/distributed/conftest.py's forge train runs and worker
# launches shared by the distributed tests.
SLOW_FIXTURES = frozenset(
    {"forge_cli", "pipelined", "using_forge", "wheelhouse", "ep_run", "two_rank_saves", "ranks", "one_process_runs",
     "launches_by_rank_count"}
)  # fmt: skip


def _is_slow(nodeid: str, fixturenames: list[str]) -> bool:
    if SLOW_FIXTURES.intersection(fixturenames):
        return True
    path, _, name = nodeid.partition("::")
    test = name.partition("[")[0]
    for entry in SLOW_TESTS:
        if entry.endswith("/") and path.startswith(entry):
            return True
        if entry in (path, f"{path}::{test}") or (entry.endswith(":") and nodeid.startswith(entry)):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_slow(item.nodeid, list(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.slow)
