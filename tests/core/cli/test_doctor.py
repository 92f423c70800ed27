"""``forge doctor``: each check finds what is wrong, names the fix, and sets the exit code.

The command runs in-process (``main([...])``) so that a broken environment can be simulated
with monkeypatch: another torch version, a missing dependency, a GPU without NCCL, an
unwritable directory (tests run as root, so chmod cannot make one). Plugins are fake installed
distributions (the ``fake_site`` fixture); ``--no-plugin-autoload`` or ``--plugins`` keeps the
real installed plugins out of the verdict.
"""

from __future__ import annotations

import email.message
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from forge_lm import hardware
from forge_lm.cli import _doctor
from forge_lm.cli._doctor import _environment, _gpu, _paths
from forge_lm.cli._main import main

REAL_METADATA = _environment.distribution_metadata
DOCS = Path(__file__).resolve().parents[3] / "docs" / "packaging.md"


@pytest.fixture(autouse=True)
def _a_cpu_machine(monkeypatch):
    """Every test starts on a CPU-only machine with no sign of a GPU, whatever runs it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(_gpu, "_gpu_hint", lambda: None)


@pytest.fixture
def doctor(capsys, tmp_path):
    """``forge doctor --json ARGS`` (run directory in tmp_path unless given): (exit code, rows by check)."""

    def run(*args: str) -> tuple[int, dict[str, tuple[str, str]]]:
        argv = ["doctor", "--json", *args]
        if "--run-dir" not in args and not any(a.startswith("--train.output_dir=") for a in args):
            argv += ["--run-dir", str(tmp_path / "run")]
        code = main(argv)
        report = json.loads(capsys.readouterr().out)
        rows = {row["check"]: (row["status"], row["detail"]) for row in report["checks"]}
        assert len(rows) == len(report["checks"])  # every check has its own name
        assert report["ok"] is (code == 0)
        return code, rows

    return run


def _with_core_metadata(monkeypatch, *, requires_python: str = ">=3.11", requires: tuple[str, ...] = ()):
    """Pretend the installed forge-lm declares these requirements."""
    fake = email.message.Message()
    fake["Name"] = "forge-lm"
    fake["Requires-Python"] = requires_python
    for line in requires:
        fake["Requires-Dist"] = line
    monkeypatch.setattr(
        _environment, "distribution_metadata", lambda name: fake if name == "forge-lm" else REAL_METADATA(name)
    )


def _statuses(rows):
    return {check: status for check, (status, _) in rows.items()}


# -- a healthy environment ----------------------------------------------------------------------


def test_healthy_cpu_environment_passes_every_check_with_exit_0(doctor):
    code, rows = doctor("--no-plugin-autoload")

    assert code == 0
    assert _statuses(rows) == {
        "python": "ok",
        "torch": "ok",
        "dependencies": "ok",
        "gpu": "ok",
        "distributed": "ok",
        "health": "ok",
        "core plugins": "ok",
        "plugin deepseek": "ok",
        "plugin moe": "ok",  # installed but disabled by the switch: deliberate, so fine
        "plugin muon": "ok",
        "plugin float8": "ok",
        "plugin lm_eval": "ok",
        "plugin prometheus": "ok",
        "plugin vlm": "ok",
        "plugin wandb": "ok",
        "config": "ok",
        "device": "ok",
        "precision": "ok",
        "peak flops": "ok",
        "linear kernel": "ok",
        "run directory": "ok",
        "disk": "ok",
        "cache directory": "ok",
    }
    assert rows["gpu"][1] == "CPU only (no GPU found): training runs on the CPU"
    assert rows["peak flops"][1].startswith("cpu fp32: ")
    assert rows["distributed"][1].startswith("backends: gloo")
    assert rows["torch"][1].startswith(f"torch {torch.__version__} ")
    assert "forge-lm requires torch" in rows["torch"][1]
    assert rows["plugin moe"][1].startswith("forge-moe 0.1.0: disabled (")


def test_report_is_a_table_of_checks_ending_with_the_verdict(capsys, tmp_path):
    assert main(["doctor", "--no-plugin-autoload", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for heading in ("Check", "Status", "Detail", "python", "torch", "distributed", "run directory", "disk"):
        assert heading in out
    assert out.rstrip().endswith("ready to train: every check passed.")


# -- Python, torch, dependencies ----------------------------------------------------------------


def test_python_outside_the_cores_requires_python_fails(doctor, monkeypatch):
    _with_core_metadata(monkeypatch, requires_python=">=3.99", requires=("torch>=2",))

    code, rows = doctor("--no-plugin-autoload")

    assert code == 1
    status, detail = rows["python"]
    assert status == "fail"
    assert "forge-lm requires Python >=3.99" in detail
    assert "Fix: create the environment with a Python >=3.99 interpreter" in detail


def test_torch_outside_the_declared_range_fails_with_the_pip_command(doctor, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.5.1")

    code, rows = doctor("--no-plugin-autoload")

    assert code == 1
    status, detail = rows["torch"]
    assert status == "fail"
    assert detail.startswith("torch 2.5.1 (CPU build), but forge-lm requires torch<3,>=2.6.")
    assert "Fix: pip install 'torch<3,>=2.6'" in detail


def test_missing_or_too_old_core_dependency_fails_naming_each(doctor, monkeypatch):
    _with_core_metadata(monkeypatch, requires=("torch>=2", "pluggy>=99", "forge-doctor-absent-package>=1"))

    code, rows = doctor("--no-plugin-autoload")

    assert code == 1
    status, detail = rows["dependencies"]
    assert status == "fail"
    assert "pluggy>=99 (1." in detail  # the installed version is shown
    assert "forge-doctor-absent-package>=1 (not installed)" in detail
    assert detail.endswith("Fix: pip install 'pluggy>=99' 'forge-doctor-absent-package>=1'")


# -- GPU, NCCL, torch.distributed ---------------------------------------------------------------


def _a_gpu(monkeypatch, *, nccl: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: nccl)


def test_gpu_with_nccl_passes(doctor, monkeypatch):
    _a_gpu(monkeypatch, nccl=True)

    code, rows = doctor("--no-plugin-autoload", "--train.device=cpu")

    assert code == 0
    assert rows["gpu"] == ("ok", "2 GPU(s): NVIDIA H100 80GB HBM3; CUDA 12.8")
    assert rows["distributed"] == ("ok", "backends: gloo, nccl 2.27.3")


def test_gpu_without_nccl_fails_naming_the_fix(doctor, monkeypatch):
    _a_gpu(monkeypatch, nccl=False)

    code, rows = doctor("--no-plugin-autoload", "--train.device=cpu")

    assert code == 1
    status, detail = rows["distributed"]
    assert status == "fail"
    assert "runs on GPUs communicate through NCCL, which this torch build lacks" in detail
    assert "Fix: install an official CUDA build of torch" in detail


@pytest.mark.parametrize(
    ("bf16_units", "precision", "status", "says"),
    [
        (True, "auto", "ok", "fp32 on cpu; this CPU has bf16 matrix instructions (AVX-512 BF16 or AMX): "
         "--train.precision=bf16 trains faster"),
        (True, "bf16", "ok", "bf16 autocast on cpu; this CPU has bf16 matrix instructions"),
        (False, "auto", "ok", "fp32 on cpu; this CPU has no bf16 matrix instructions, so fp32 is its fastest"),
        (False, "bf16", "warning", "torch emulates bf16 products, several times slower than fp32. Use "
         "--train.precision=fp32"),
    ],
)  # fmt: skip
def test_the_precision_row_says_whether_bf16_pays_on_this_cpu(doctor, monkeypatch, bf16_units, precision, status, says):
    """The CPU's bf16 units stood in for, so the test means the same on every machine."""
    monkeypatch.setattr(hardware, "cpu_multiplies_bf16", lambda: bf16_units)

    code, rows = doctor("--no-plugin-autoload", "--train.device=cpu", f"--train.precision={precision}")

    assert code == 0  # a slow precision warns; the run can still start
    assert rows["precision"][0] == status
    assert says in rows["precision"][1]


def test_on_a_gpu_the_precision_row_states_the_autocast_dtype(doctor, monkeypatch):
    _a_gpu(monkeypatch, nccl=True)
    monkeypatch.setattr("forge_lm.train.device.resolve_device", lambda setting: torch.device("cuda"))

    _, rows = doctor("--no-plugin-autoload", "--train.device=cpu")

    assert rows["precision"] == ("ok", "train.precision 'auto': bf16 autocast on cuda")


@pytest.mark.parametrize(
    ("fp16_units", "status", "says"),
    [
        (True, "ok", "train.precision 'fp16': fp16 autocast with a dynamic loss scale on cpu; fp16 autocast runs, "
         "on this CPU's fp16 matrix instructions"),
        (False, "warning", "fp16 autocast runs, but this CPU has no fp16 matrix instructions (AVX512-FP16, "
         "AMX-FP16): torch emulates fp16 products"),
    ],
)  # fmt: skip
def test_the_precision_row_says_fp16_autocast_runs_on_this_cpu_and_how_fast(doctor, monkeypatch, fp16_units, status,
                                                                            says):  # fmt: skip
    """The autocast product is really run (this torch runs it); the fp16 units are stood in for."""
    monkeypatch.setattr(hardware, "cpu_multiplies_fp16", lambda: fp16_units)

    code, rows = doctor("--no-plugin-autoload", "--train.device=cpu", "--train.precision=fp16")

    assert code == 0
    assert rows["precision"][0] == status
    assert says in rows["precision"][1]
    assert rows["peak flops"][1].startswith("cpu fp16: ")


def _linear_shapes_of_default_model():
    """The default model's fp32 linear products at its tokens per micro-batch, built for real:
    the reference the doctor's meta-device build must agree with."""
    from forge_lm.config import load_config
    from forge_lm.model import build_model
    from forge_lm.model.linear_choice import linear_shapes
    from forge_lm.plugins import PluginManager, PluginSettings

    registry = PluginManager(PluginSettings(autoload=False)).registry
    config = load_config(None, [], registry)
    model = build_model(config.model, config.tokenizer.build().vocab_size, registry)
    return linear_shapes(model, config.train.batch_size * config.train.seq_len)


def test_the_linear_kernel_row_reports_the_choice_this_host_cached_for_the_models_products(
    doctor, monkeypatch, tmp_path
):
    """A choice cached by an earlier run (idle machine) for exactly these products is what the row
    reports; a cache for other products, or none, says the first run measures it. Nothing is timed."""
    from forge_lm.model import linear_choice

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(linear_choice, "_MADE", {})
    monkeypatch.setattr(hardware, "machine_load", lambda: (0.0, 2))
    monkeypatch.setattr(linear_choice, "_time_product", lambda name, shape: pytest.fail("the doctor timed a product"))
    monkeypatch.setattr("forge_lm.model.linear.onednn_available", lambda: True)  # whatever this torch build has

    _, rows = doctor("--no-plugin-autoload")
    assert rows["linear kernel"][0] == "ok"
    assert rows["linear kernel"][1].startswith("auto: not measured on this host yet; the first fp32 run times")

    shapes = _linear_shapes_of_default_model()
    linear_choice.choose(shapes, lambda name, shape: 1.0 if name == "onednn" else 3.0)  # as a run would cache it
    _, rows = doctor("--no-plugin-autoload")
    assert rows["linear kernel"][0] == "ok"
    assert rows["linear kernel"][1].startswith("auto: oneDNN: oneDNN measured 3.00x torch's speed")
    assert "cached " in rows["linear kernel"][1]

    _, rows = doctor("--no-plugin-autoload", "--model.dim=128")  # other products: not measured for them
    assert rows["linear kernel"][1].startswith("auto: not measured on this host yet")


def test_the_linear_kernel_row_states_a_configured_kernel_and_is_left_out_off_fp32_cpu(doctor):
    _, rows = doctor("--no-plugin-autoload", "--train.cpu_linear_kernel=aten")
    assert rows["linear kernel"] == ("ok", "cpu_linear_kernel = 'aten': torch's own kernel (F.linear), as configured")

    _, rows = doctor("--no-plugin-autoload", "--train.precision=bf16")  # autocast's kernels, not this setting's
    assert "linear kernel" not in rows


def test_onednn_asked_for_on_a_torch_without_it_fails_the_linear_kernel_row(doctor, monkeypatch):
    monkeypatch.setattr("forge_lm.model.linear.onednn_available", lambda: False)

    code, rows = doctor("--no-plugin-autoload", "--train.cpu_linear_kernel=onednn")

    assert code == 1
    assert rows["linear kernel"] == (
        "fail",
        "cpu_linear_kernel = 'onednn', but this torch build has no oneDNN (mkldnn) linear kernel; set it to 'auto' "
        "or 'aten'",
    )


def test_fp16_autocast_that_does_not_run_on_this_cpu_fails_the_precision_row(doctor, monkeypatch):
    def refused(*args, **kwargs):
        raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")

    monkeypatch.setattr(torch.nn.functional, "linear", refused)

    code, rows = doctor("--no-plugin-autoload", "--train.device=cpu", "--train.precision=fp16")

    assert code == 1
    assert rows["precision"] == (
        "fail",
        "train.precision 'fp16': fp16 autocast with a dynamic loss scale on cpu, but fp16 autocast does not run on "
        f"this CPU with torch {torch.__version__} (RuntimeError: \"addmm_impl_cpu_\" not implemented for 'Half'). "
        "Use --train.precision=fp32",
    )


@pytest.mark.parametrize(
    ("gpu_name", "peak", "label"),
    [("NVIDIA H100 80GB HBM3", 989.4e12, "NVIDIA H100 SXM"), ("Tesla V100-SXM2-32GB", 125e12, "NVIDIA V100")],
)
def test_on_a_gpu_fp16_runs_and_its_peak_is_the_tables_fp16_rate(doctor, monkeypatch, gpu_name, peak, label):
    _a_gpu(monkeypatch, nccl=True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: gpu_name)
    monkeypatch.setattr("forge_lm.train.device.resolve_device", lambda setting: torch.device("cuda"))

    _, rows = doctor("--no-plugin-autoload", "--train.device=cpu", "--train.precision=fp16")

    assert rows["precision"] == (
        "ok",
        "train.precision 'fp16': fp16 autocast with a dynamic loss scale on cuda; every CUDA GPU computes in fp16",
    )
    assert rows["peak flops"] == ("ok", f"cuda fp16: {peak:.3g} FLOP/s, GPU table: {label} fp16")


def test_gpu_without_bf16_warns_to_use_fp32(doctor, monkeypatch):
    _a_gpu(monkeypatch, nccl=True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)

    code, rows = doctor("--no-plugin-autoload", "--train.device=cpu")

    assert code == 0  # warnings do not fail
    assert rows["gpu"][0] == "warning"
    assert "--train.precision=fp32" in rows["gpu"][1]


def test_gpu_that_torch_cannot_use_is_a_warning_naming_the_cause(doctor, monkeypatch):
    monkeypatch.setattr(_gpu, "_gpu_hint", lambda: "/dev/nvidiactl exists")
    monkeypatch.setattr(torch.version, "cuda", None)

    code, rows = doctor("--no-plugin-autoload")

    assert code == 0
    status, detail = rows["gpu"]
    assert status == "warning"
    assert detail.startswith(
        f"a GPU seems present (/dev/nvidiactl exists) but torch cannot use it: torch {torch.__version__} is a CPU build"
    )
    assert "Fix: install the torch build for this machine's CUDA driver" in detail


def test_torch_without_distributed_fails(doctor, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)

    code, rows = doctor("--no-plugin-autoload")

    assert code == 1
    assert rows["distributed"][0] == "fail"
    assert "no torch.distributed, which checkpoints and multi-process runs need" in rows["distributed"][1]


def test_cpu_torch_without_gloo_fails(doctor, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: False)

    code, rows = doctor("--no-plugin-autoload")

    assert code == 1
    assert rows["distributed"] == (
        "fail",
        "backends: none; CPU runs communicate through gloo, which this torch build lacks. "
        "Fix: install an official torch build (pip install torch)",
    )


def test_config_asking_for_a_missing_cuda_device_fails(doctor):
    code, rows = doctor("--no-plugin-autoload", "--train.device=cuda")

    assert code == 1
    assert rows["device"] == (
        "fail",
        "[train] device: 'cuda' asked for, but CUDA is not available; use 'cpu' or 'auto'.",
    )


# -- plugins and the config ---------------------------------------------------------------------


def test_broken_plugin_fails_with_reinstall_uninstall_or_block(doctor, fake_site):
    fake_site.install("forge-doctorbroken", "import forge_doctor_no_such_module\n")

    code, rows = doctor("--plugins", "doctorbroken")

    assert code == 1
    status, detail = rows["plugin doctorbroken"]
    assert status == "fail"
    assert detail.startswith("forge-doctorbroken 1.0 is broken: import failed: ModuleNotFoundError")
    assert detail.endswith(
        "Fix: reinstall it with its dependencies (pip install --force-reinstall forge-doctorbroken), "
        "uninstall it (pip uninstall forge-doctorbroken), or run without it (--block-plugin doctorbroken)"
    )


def test_incompatible_plugin_fails_with_upgrade_or_uninstall(doctor, fake_site):
    fake_site.install("forge-doctorold", 'FORGE_LM_PLUGIN_API = ">=2,<3"\n', version="3.0")  # made for a future core

    code, rows = doctor("--plugins", "doctorold")

    assert code == 1
    status, detail = rows["plugin doctorold"]
    assert status == "fail"
    assert detail.startswith("forge-doctorold 3.0 is incompatible: supports plugin API >=2,<3 but this core provides")
    assert detail.endswith("Fix: pip install --upgrade forge-doctorold, or pip uninstall forge-doctorold")


def test_plugin_whose_distribution_requires_another_core_fails(doctor, fake_site):
    source = textwrap.dedent(
        """
        from forge_lm import hookimpl
        FORGE_LM_PLUGIN_API = ">=1,<2"
        """
    )
    fake_site.install("forge-doctorpinned", source, version="0.9")
    metadata = fake_site.root / "forge_doctorpinned-0.9.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text() + "Requires-Dist: forge-lm<0.1,>=0.0.1\n")

    code, rows = doctor("--plugins", "doctorpinned")

    assert code == 1
    status, detail = rows["plugin doctorpinned"]
    assert status == "fail"
    assert detail.startswith("forge-doctorpinned 0.9 needs forge-lm<0.1,>=0.0.1 (0.1.0 installed).")
    assert "Fix: pip install --upgrade forge-doctorpinned" in detail


def test_healthy_fake_plugin_is_ok_with_its_components(doctor, fake_site):
    source = textwrap.dedent(
        """
        from forge_lm import hookimpl
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_register_losses(register):
            register("doctor_loss", "forge_doctorgood:build", description="A loss for the doctor's tests")
        """
    )
    fake_site.install("forge-doctorgood", source)

    code, rows = doctor("--plugins", "doctorgood")

    assert code == 0
    assert rows["plugin doctorgood"] == ("ok", "forge-doctorgood 1.0: 1 component(s)")


def test_switch_naming_no_installed_plugin_is_a_warning(doctor):
    code, rows = doctor("--no-plugin-autoload", "--block-plugin", "doctor-nonexistent")

    assert code == 0
    assert rows["plugin switches"][0] == "warning"
    assert "'doctor-nonexistent', which is not an installed plugin" in rows["plugin switches"][1]


def test_invalid_config_fails_with_its_message_and_checks_the_current_directory(doctor, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "bad.toml"
    config.write_text("[model]\nn_head = 8\n")

    code, rows = doctor("--no-plugin-autoload", str(config), "--run-dir", ".")

    assert code == 1
    status, detail = rows["config"]
    assert status == "fail"
    assert detail.startswith(f"{config}: [model] n_head: unknown key for model family 'llama'. Did you mean 'n_heads'?")
    assert "device" not in rows  # nothing to check without a valid config
    assert rows["run directory"] == ("ok", ". is writable")


def test_config_using_a_disabled_plugins_component_fails_saying_so(doctor):
    code, rows = doctor("--no-plugin-autoload", "--optimizer.name=muon")

    assert code == 1
    status, detail = rows["config"]
    assert status == "fail"
    assert (
        "the default config with 1 override(s): [optimizer] name = 'muon': optimizer 'muon' is provided by plugin "
        "'muon' (forge-optim-muon 0.1.0), which is installed but disabled"
    ) in detail


# -- run directory, disk, writable paths ---------------------------------------------------------


def test_run_directory_defaults_to_the_configs_output_dir(doctor, tmp_path):
    out = tmp_path / "runs" / "mine"

    code, rows = doctor("--no-plugin-autoload", f"--train.output_dir={out}")

    assert code == 0
    assert rows["run directory"] == ("ok", f"{out} will be created in {tmp_path}")
    assert rows["disk"][1].endswith(f"GiB free at {tmp_path}")


def test_run_directory_that_cannot_be_created_fails(doctor, tmp_path):
    (tmp_path / "a-file").write_text("")

    code, rows = doctor("--no-plugin-autoload", "--run-dir", str(tmp_path / "a-file" / "run"))

    assert code == 1
    assert rows["run directory"] == (
        "fail",
        f"{tmp_path / 'a-file' / 'run'} cannot be created: {tmp_path / 'a-file'} is not a directory. "
        "Fix: choose another --train.output_dir",
    )
    assert "disk" not in rows


def test_run_directory_that_is_a_file_fails(doctor, tmp_path):
    (tmp_path / "run").write_text("")

    code, rows = doctor("--no-plugin-autoload", "--run-dir", str(tmp_path / "run"))

    assert code == 1
    assert rows["run directory"][1].startswith(f"{tmp_path / 'run'} exists and is not a directory.")


def test_unwritable_run_directory_fails_naming_the_fix(doctor, tmp_path, monkeypatch):
    def refuse(directory):
        if directory == tmp_path:
            raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_paths, "_probe_writable", refuse)

    code, rows = doctor("--no-plugin-autoload", "--run-dir", str(tmp_path / "run"))

    assert code == 1
    assert rows["run directory"] == (
        "fail",
        f"{tmp_path / 'run'}: cannot write in {tmp_path}: Permission denied. "
        "Fix: choose a writable --train.output_dir, or give this user write access",
    )


def test_little_free_disk_is_a_warning_with_exit_0(doctor):
    code, rows = doctor("--no-plugin-autoload", "--min-free-gib", "1e12")

    assert code == 0
    status, detail = rows["disk"]
    assert status == "warning"
    assert "under 1e+12 GiB: checkpoints may not fit" in detail
    assert "checkpoint.keep_last_n" in detail


def test_unwritable_cache_directory_is_a_warning(doctor, tmp_path, monkeypatch):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))

    code, rows = doctor("--no-plugin-autoload")

    assert code == 0
    status, detail = rows["cache directory"]
    assert status == "warning"
    assert detail.startswith(f"{tmp_path / 'not-a-dir' / 'forge_lm'}: not a directory;")
    assert "Fix: set XDG_CACHE_HOME to a writable directory" in detail


def test_doctor_is_a_forge_command():
    from forge_lm.cli._main import build_parser

    assert "doctor" in build_parser().format_help()


# -- sections: their order, a check that crashes, no torch at import -----------------------------


def _documented_checks() -> list[list[str]]:
    """The check column of docs/packaging.md's table, top to bottom: the names on each line."""
    text = DOCS.read_text(encoding="utf-8")
    start = text.index("| check | fails when | warns when |")
    lines = text[start : text.index("\n\n", start)].splitlines()[2:]  # below the header and its rule
    return [re.findall(r"`([^`]+)`", line.split("|")[1]) for line in lines]


def _documented_place(row: str, documented: list[list[str]]) -> int:
    """The line documenting ``row``: the one naming it, else the one whose NAME (any plugin) or
    N (any rank) stands for it ('plugin switches' is its own line, not a plugin's)."""
    places = [index for index, names in enumerate(documented) if row in names]
    if not places:
        for index, names in enumerate(documented):
            for name in names:
                words = [r"\S+" if w == "NAME" else r"\d+" if w == "N" else re.escape(w) for w in name.split()]
                if re.fullmatch(" ".join(words), row):
                    places.append(index)
    assert len(places) == 1, f"check {row!r} is documented on {len(places)} lines of the table in {DOCS}"
    return places[0]


def test_rows_come_in_the_order_the_docs_list_them_and_every_one_is_documented(doctor, tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # so that the checkpoints row shows too
    documented = _documented_checks()

    code, rows = doctor("--no-plugin-autoload", "--block-plugin", "doctor-nonexistent")

    assert code == 0
    places = [_documented_place(row, documented) for row in rows]
    assert places == sorted(places), list(rows)
    # every documented line showed, except the per-rank health rows (only under torchrun)
    assert [names for index, names in enumerate(documented) if index not in places] == [["health rank N"]]
    assert rows["checkpoints"] == ("ok", "none yet")


def test_sections_are_ordered_with_each_check_in_exactly_one():
    checks = [check for section in _doctor.SECTIONS for check in section.CHECKS]

    assert [section.__name__.rsplit(".", 1)[1] for section in _doctor.SECTIONS] == [
        "_environment",
        "_gpu",
        "_plugins",
        "_config",
        "_health",
        "_paths",
    ]
    assert len(set(checks)) == len(checks)
    assert all(check.__module__ == section.__name__ for section in _doctor.SECTIONS for check in section.CHECKS)


def test_a_check_that_raises_is_one_failed_row_naming_it_and_the_others_still_run(doctor, monkeypatch):
    _, healthy = doctor("--no-plugin-autoload")

    def crash():
        raise RuntimeError("the probe exploded")

    monkeypatch.setattr(_gpu, "_gpu_hint", crash)  # inside the gpu check, the first of its section
    code, rows = doctor("--no-plugin-autoload")

    assert code == 1
    assert list(rows) == list(healthy)  # the same rows, in the same order: every other check ran
    status, detail = rows["gpu"]
    assert status == "fail"
    assert detail.startswith(
        "the check crashed, so this was not checked (the other checks ran): forge_lm.cli._doctor._gpu.gpu raised "
        "RuntimeError: the probe exploded at test_doctor.py:"
    )
    assert detail.endswith("This is a bug: report it with this message and the output of 'forge --version'")
    assert {name: row for name, row in rows.items() if name != "gpu"} == {
        name: row for name, row in healthy.items() if name != "gpu"
    }


def test_a_crashed_config_check_leaves_out_what_needs_the_config_and_runs_the_rest(doctor, monkeypatch):
    from forge_lm.plugins import PluginManager

    def configure(self, config):
        raise KeyError("a plugin's configure hook went wrong")

    monkeypatch.setattr(PluginManager, "configure", configure)
    code, rows = doctor("--no-plugin-autoload")

    assert code == 1
    assert rows["config"][0] == "fail"
    assert "forge_lm.cli._doctor._config.config raised KeyError: " in rows["config"][1]
    assert "device" not in rows  # no valid config to check it against
    assert "peak flops" not in rows
    statuses = _statuses(rows)
    assert [statuses[name] for name in ("health", "run directory", "disk", "cache directory")] == ["ok"] * 4


def test_without_torch_the_torch_row_fails_and_the_checks_that_need_it_are_left_out(doctor, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError

    code, rows = doctor("--no-plugin-autoload")

    assert code == 1
    status, detail = rows["torch"]
    assert status == "fail"
    assert detail.startswith("import torch failed: ModuleNotFoundError: ")
    assert detail.endswith("Fix: pip install 'torch<3,>=2.6'")
    assert [name for name in rows if not name.startswith("plugin ")] == [
        "python",
        "torch",
        "dependencies",
        "core plugins",
        "config",
        "run directory",
        "disk",
    ]
    assert all(status == "ok" for name, (status, _) in rows.items() if name != "torch")


def test_the_doctor_package_imports_no_torch_so_forge_help_stays_fast():
    probe = "import sys, forge_lm.cli._doctor; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"

    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)

    assert result.stdout.strip() == "[]"
