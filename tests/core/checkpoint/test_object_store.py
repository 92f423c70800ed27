"""Checkpoints on an object store (``[checkpoint] dir = "s3://bucket/prefix"``), against a real
S3-compatible server: moto's server mode, started once on localhost as a subprocess. Nothing
of the client library (s3fs, botocore) is mocked; each test has a bucket of its own.

The references: an uninterrupted run with its checkpoints on the local disk (a run killed and
resumed from the bucket must end bit for bit where it does), the retention rule written out,
and the weights the saving model held."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from forge_lm import hookimpl
from forge_lm.checkpoint import CheckpointManager, CheckpointSaveError, UnsafeCheckpointError
from forge_lm.checkpoint._object_store import ObjectFiles, ObjectStore
from forge_lm.cli._main import main
from forge_lm.config import load_config, to_toml
from forge_lm.errors import ConfigError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.testing import TINY_MODEL
from forge_lm.train import train
from forge_lm.train.inference import load_for_inference, locate_checkpoint

pytest.importorskip("s3fs", reason="the object-store tests need forge-lm[s3] (s3fs)")
pytest.importorskip("moto", reason="the object-store tests need moto[server] (requirements-dev.txt)")

KEY_ID = "forge-test-key-id-" + uuid.uuid4().hex[:8]
SECRET = "forge-test-secret-" + uuid.uuid4().hex  # must appear in nothing a run writes or prints
# A run of 6 steps of a tiny model on synthetic data, checkpointed every 2 steps (with TINY_MODEL).
RUN = """
[train]
batch_size = 4
seq_len = 16
max_steps = 6

[data]
name = "synthetic"

[eval]
interval = 0

[metrics]
log_interval = 1
backends = ["jsonl"]
peak_flops = 1e12

[checkpoint]
interval = 2
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> str:
    """moto's S3 server on a free localhost port, for the whole session; its endpoint URL."""
    port = _free_port()
    log = (tmp_path_factory.mktemp("moto") / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=log, stderr=log)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"moto's server did not start (exit {server.poll()}); see {log.name}")
            time.sleep(0.2)
    yield endpoint
    server.terminate()
    server.wait(timeout=30)
    log.close()


def _clear_s3fs_instances() -> None:
    """fsspec keeps one filesystem per set of options: a test that changes the environment's
    endpoint or credentials must not be handed the previous test's client."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_env(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment of a client of the test server (also for subprocesses), and a new bucket."""
    env = {
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # never wait for an instance-metadata service
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_CONFIG_FILE": os.devnull,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _clear_s3fs_instances()
    bucket = "forge-" + uuid.uuid4().hex[:12]
    import s3fs

    s3fs.S3FileSystem().mkdir(bucket)
    env["bucket"] = bucket
    yield env
    _clear_s3fs_instances()


def _objects(bucket: str) -> list[str]:
    import s3fs

    return sorted(key.partition("/")[2] for key in s3fs.S3FileSystem(use_listings_cache=False).find(bucket))


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


# -- the checkpoint manager on a bucket --------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
def test_saved_steps_load_back_bitwise_and_latest_names_the_newest(s3_env, tmp_path, async_save):
    url = f"s3://{s3_env['bucket']}/runs/a"
    model, optimizer = _model()
    checkpoints = CheckpointManager(tmp_path, async_save=async_save, location=url)
    for step in (1, 2):
        _train_step(model, optimizer)
        checkpoints.save(step, model, optimizer, {"tokens_seen": step})
    checkpoints.close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    assert str(checkpoints.latest()) == f"{url}/step_2"
    assert [str(p) for p in checkpoints.complete()] == [f"{url}/step_1", f"{url}/step_2"]
    fresh, fresh_optimizer = _model()
    state = CheckpointManager(tmp_path, location=url).load(fresh, fresh_optimizer)
    assert (state["step"], state["tokens_seen"], state["path"]) == (2, 2, f"{url}/step_2")
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    assert fresh_optimizer.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert not any(tmp_path.iterdir())  # nothing of the checkpoints is kept locally


def test_retention_rules_prune_in_the_bucket(s3_env, tmp_path):
    """keep_last_n = 1, keep_every_n_steps = 3, keep_best_n = 1 by eval/loss over saves 1..6:
    the newest (6), every 3rd (3, 6) and the best (2, with the lowest loss) remain."""
    url = f"s3://{s3_env['bucket']}/pruned"
    rules = SimpleNamespace(
        keep_every_n_steps=3, keep=[], keep_best_n=1, keep_best_mode="min", keep_best_metric="eval/loss"
    )
    model, optimizer = _model()
    checkpoints = CheckpointManager(tmp_path, keep_last_n=1, retention=rules, location=url)
    for step in range(1, 7):
        checkpoints.note_metrics(step, {"eval/loss": 1.0 if step == 2 else 2.0 + step})
        checkpoints.save(step, model, optimizer, {})
    steps = sorted({key.split("/")[1] for key in _objects(s3_env["bucket"]) if key.startswith("pruned/step_")})
    assert steps == ["step_2", "step_3", "step_6"]
    assert "pruned/step_2/eval_metrics.json" in _objects(s3_env["bucket"])


def test_a_step_without_its_trainer_state_is_never_the_newest(s3_env, tmp_path, capsys):
    """A save cut short (tensor objects, no trainer_state.json, written last) is passed over;
    when it is all there is, it is moved aside and the run starts from step 0."""
    url = f"s3://{s3_env['bucket']}/cut"
    model, optimizer = _model()
    checkpoints = CheckpointManager(tmp_path, location=url)
    checkpoints.save(1, model, optimizer, {})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    _train_step(model, optimizer)
    ObjectFiles(checkpoints.store.fs, f"{s3_env['bucket']}/cut/step_2").write_text("__0_0.distcp", "partial")
    fresh, fresh_optimizer = _model()
    _train_step(fresh, fresh_optimizer)
    state = CheckpointManager(tmp_path, location=url).load(fresh, fresh_optimizer)
    assert state["step"] == 1
    assert state["passed_over"] == ["step_2: incomplete: trainer_state.json is missing (the save was interrupted)"]
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())

    alone = f"s3://{s3_env['bucket']}/only-cut"
    ObjectFiles(checkpoints.store.fs, f"{s3_env['bucket']}/only-cut/step_5").write_text("__0_0.distcp", "partial")
    assert CheckpointManager(tmp_path, location=alone).load(fresh, fresh_optimizer) is None
    assert "moved it aside" in capsys.readouterr().err
    assert [k for k in _objects(s3_env["bucket"]) if k.startswith("only-cut/")] == [
        "only-cut/step_5.incomplete/__0_0.distcp"
    ]


def test_a_bucket_checkpoint_is_as_untrusted_as_one_on_disk(s3_env, tmp_path):
    """Metadata that would run code stops loading (the payload never runs); a step holding a
    nested key is passed over like a directory holding a subdirectory."""
    url = f"s3://{s3_env['bucket']}/hostile"
    model, optimizer = _model()
    checkpoints = CheckpointManager(tmp_path, location=url)
    checkpoints.save(1, model, optimizer, {})
    checkpoints.save(2, model, optimizer, {})
    fs = checkpoints.store.fs
    fs.pipe_file(f"{s3_env['bucket']}/hostile/step_2/nested/file", b"x")
    fresh, fresh_optimizer = _model()
    state = CheckpointManager(tmp_path, location=url).load(fresh, fresh_optimizer)
    assert state["step"] == 1
    assert state["passed_over"] == ["step_2: holds 'nested', which is not a plain object of the checkpoint"]

    sentinel = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    checkpoints.save(3, model, optimizer, {})
    fs.pipe_file(f"{s3_env['bucket']}/hostile/step_3/.metadata", pickle.dumps(Exploit()))
    with pytest.raises(UnsafeCheckpointError, match=r"(posix|os)\.system"):
        CheckpointManager(tmp_path, location=url).load(fresh, fresh_optimizer)
    assert not sentinel.exists()


def test_a_failed_upload_is_retried_then_fails_as_a_save_does(s3_env, tmp_path, monkeypatch, capsys):
    url = f"s3://{s3_env['bucket']}/flaky"
    monkeypatch.setattr(ObjectStore, "retry_wait", lambda self, attempt: 0.0)
    real_write = ObjectFiles.write_text
    failures = iter([True])  # the first trainer-state upload fails, the retry succeeds

    def flaky_write(self, name, text):
        if name == "trainer_state.json" and next(failures, False):
            raise ConnectionResetError(104, "Connection reset by peer")
        real_write(self, name, text)

    monkeypatch.setattr(ObjectFiles, "write_text", flaky_write)
    model, optimizer = _model()
    checkpoints = CheckpointManager(tmp_path, location=url)
    checkpoints.save(1, model, optimizer, {})
    assert "writing checkpoint 's3://" in capsys.readouterr().err
    assert str(checkpoints.latest()) == f"{url}/step_1"

    def broken_write(self, name, text):
        if name == "trainer_state.json":
            raise ConnectionResetError(104, "Connection reset by peer")
        real_write(self, name, text)

    monkeypatch.setattr(ObjectFiles, "write_text", broken_write)
    with pytest.raises(CheckpointSaveError, match=r"\(3 attempts\): Connection reset by peer.*step_1\) is intact"):
        checkpoints.save(2, model, optimizer, {})
    assert not [k for k in _objects(s3_env["bucket"]) if k.startswith("flaky/step_2")]  # the partial step is gone
    assert str(checkpoints.latest()) == f"{url}/step_1"


# -- bad settings: exit 2 before training, nothing written ------------------------------------


@pytest.mark.parametrize(
    "value",
    ["/tmp/checkpoints", "s3://key:secret@bucket/x", "s3://bucket/../other", "s3://bucket/x?endpoint_url=y", "s3://B"],
)
def test_a_dir_that_is_no_plain_bucket_url_is_refused(value, manager):
    with pytest.raises(ConfigError, match=r"checkpoint.*dir.*is not an object-store URL"):
        load_config(None, [f"--checkpoint.dir={value}"], manager.registry)


def test_gs_without_gcsfs_names_the_package(tmp_path):
    """gcsfs is no dependency of the test environment: the refusal is the real one."""
    assert importlib.util.find_spec("gcsfs") is None, "gcsfs is installed here; this test needs it absent"
    with pytest.raises(ConfigError, match=r"needs gcsfs \(pip install gcsfs\)"):
        CheckpointManager(tmp_path, location="gs://bucket/prefix")


def _run_config(tmp_path: Path) -> Path:
    config = tmp_path / "run.toml"
    config.write_text(RUN)
    return config


def _bad_start(tmp_path: Path, overrides: list[str], capsys) -> str:
    run_dir = tmp_path / "run"
    code = main(["train", str(_run_config(tmp_path)), *TINY_MODEL, f"--train.output_dir={run_dir}", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not run_dir.exists()  # nothing written
    return err


def test_a_missing_bucket_unreachable_endpoint_or_missing_credentials_exit_2_writing_nothing(
    s3_env, tmp_path, monkeypatch, capsys
):
    url = f"s3://{s3_env['bucket']}-missing/run"
    err = _bad_start(tmp_path, [f"--checkpoint.dir={url}"], capsys)
    assert f"[checkpoint] dir = '{url}': the bucket '{s3_env['bucket']}-missing' does not exist" in err

    url = f"s3://{s3_env['bucket']}/run"
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    _clear_s3fs_instances()
    err = _bad_start(tmp_path, [f"--checkpoint.dir={url}"], capsys)
    assert "the object store cannot be reached" in err
    assert "Check AWS_ENDPOINT_URL" in err

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env["AWS_ENDPOINT_URL"])
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    _clear_s3fs_instances()
    err = _bad_start(tmp_path, [f"--checkpoint.dir={url}"], capsys)
    assert "no credentials for the object store were found" in err
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    _clear_s3fs_instances()
    assert _objects(s3_env["bucket"]) == []


# -- a real run: killed after a save, resumed from the bucket ---------------------------------

KILLER = """
import os, signal
from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"

@hookimpl
def forge_lm_step_end(context, step, metrics):
    if step == int(os.environ.get("FORGE_TEST_KILL_AT_STEP", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_run_killed_after_a_save_resumes_from_the_bucket_bit_for_bit(s3_env, tmp_path, manager, fake_site, capsys):
    """A ``forge train`` subprocess checkpointing to the bucket every 2 steps is killed (SIGKILL)
    at step 5; a save of step 6 cut short is planted; the resumed run ends where a run with local
    checkpoints that was never interrupted ends, bit for bit (losses and weights). The run's
    secret key appears in nothing it wrote or printed, in the run directory or the bucket."""
    run_config = _run_config(tmp_path)
    straight = load_config(run_config, [*TINY_MODEL, f"--train.output_dir={tmp_path / 'straight'}"], manager.registry)
    train(straight, manager)

    url = f"s3://{s3_env['bucket']}/killed"
    run_dir = tmp_path / "killed"
    overrides = [*TINY_MODEL, f"--train.output_dir={run_dir}", f"--checkpoint.dir={url}"]
    config = load_config(run_config, overrides, manager.registry)
    config_file = tmp_path / "killed.toml"
    config_file.write_text(to_toml(config))
    fake_site.install("forge-test-killer", KILLER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_LM_")}
    env.update(FORGE_TEST_KILL_AT_STEP="5", OMP_NUM_THREADS="1")
    killed = subprocess.run(
        [sys.executable, "-m", "forge_lm", "train", str(config_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    saved = _objects(s3_env["bucket"])
    assert "killed/step_4/trainer_state.json" in saved
    assert "killed/latest" in saved
    assert not (run_dir / "checkpoints").exists()  # the run directory keeps no checkpoint
    ObjectStore(url).files("step_6").write_text("__0_0.distcp", "cut short")  # an interrupted save of step 6

    result = train(load_config(config_file, [], manager.registry), manager)
    assert result.status == "completed"
    resumed_err = capsys.readouterr().err
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}
    reference = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "straight" / "metrics.jsonl") if "loss" in r}
    assert losses == reference

    # forge generate / export-hf / eval load through these: the run directory, or one of its steps.
    expected, _, _ = load_for_inference(tmp_path / "straight", manager)
    for address in (run_dir, run_dir / "checkpoints" / "step_6"):
        model, loaded_config, _ = load_for_inference(address, manager)
        assert loaded_config.checkpoint.dir == url
        assert all(torch.equal(v, expected.state_dict()[k]) for k, v in model.state_dict().items())
    assert locate_checkpoint(run_dir) == (run_dir / "checkpoints" / "step_6", run_dir, 6)

    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"events.jsonl", "config.toml"} <= {p.name for p in written}
    outputs = [killed.stdout, killed.stderr, resumed_err, *(p.read_bytes().decode("utf-8", "replace") for p in written)]
    bucket_files = ObjectStore(f"s3://{s3_env['bucket']}")
    outputs += [bucket_files.top.read(key, 10**9).decode("utf-8", "replace") for key in _objects(s3_env["bucket"])]
    for secret in (SECRET, KEY_ID):
        assert not [text[:80] for text in outputs if secret in text]


def test_the_resume_rules_hold_for_a_run_whose_checkpoints_are_in_a_bucket(s3_env, tmp_path, manager, capsys):
    """The bucket's checkpoints make the run a resumed one, as a local checkpoints/ does: a
    setting fixed on resume cannot change (exit 2), and a new run directory is not given another
    run's bucket prefix (exit 2, nothing written)."""
    url = f"s3://{s3_env['bucket']}/ruled"
    run_dir = tmp_path / "ruled"
    overrides = [*TINY_MODEL, f"--train.output_dir={run_dir}", f"--checkpoint.dir={url}", "--train.max_steps=2"]
    assert train(load_config(_run_config(tmp_path), overrides, manager.registry), manager).status == "completed"
    capsys.readouterr()
    assert main(["train", str(run_dir / "config.toml"), "--model.dim=64", "--model.n_heads=8"]) == 2
    assert "holds a run with other settings for model.dim" in capsys.readouterr().err

    err = _bad_start(tmp_path, [f"--checkpoint.dir={url}"], capsys)
    assert f"[checkpoint] dir: '{url}' holds checkpoints, but '{tmp_path / 'run'}' holds no run they belong to" in err


# -- resharding on load: two FSDP2 ranks load a one-process checkpoint from the bucket ---------


def _whole_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and the optimizer, whole (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()

    model_state, optimizer_state = get_state_dict(model, optimizer)
    tensors = {f"model.{k}": whole(v) for k, v in model_state.items()}
    for name, state in optimizer_state["state"].items():
        tensors.update({f"optimizer.{name}.{k}": whole(v) for k, v in state.items()})
    return tensors


def _built(config_file: Path, run_dir: Path, manager, *overrides: str):
    """The run's parts as forge train builds them (under torchrun: joined to the process group)."""
    from forge_lm.train.parts import build_parts

    config = load_config(config_file, [*TINY_MODEL, f"--train.output_dir={run_dir}", *overrides], manager.registry)
    return build_parts(config, manager)


def test_two_sharded_ranks_load_a_one_process_checkpoint_from_the_bucket(s3_env, tmp_path, manager):
    """Saved by one process, loaded by two FSDP2 ranks (dp_shard = 2): DCP reshards through the
    fsspec reader, and every whole tensor, model and AdamW moments, equals the one saved."""
    from forge_lm.testing.distributed import torchrun
    from forge_lm.train.step import compute_gradients

    url = f"s3://{s3_env['bucket']}/resharded"
    config_file = _run_config(tmp_path)
    parts = _built(config_file, tmp_path / "run", manager)
    compute_gradients(parts, iter(parts.train_batches), load_config(config_file, list(TINY_MODEL), manager.registry))
    parts.optimizer.step()
    CheckpointManager(tmp_path / "run", location=url).save(1, parts.model, parts.optimizer, {})
    expected = _whole_state(parts.model, parts.optimizer)

    result = torchrun([__file__, "reshard", str(tmp_path), url], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[key], expected[key]) for key in expected)
    sharded = json.loads((tmp_path / "sharded.json").read_text())
    assert sharded == [True, True]  # each rank held half of a weight, not a copy of it


def _reshard_worker(out: Path, url: str) -> int:
    """Under torchrun: build the run with dp_shard = 2, load step 1 from ``url``; rank 0 writes
    the whole tensors, and every rank whether its first weight is a shard."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from forge_lm.plugins import PluginManager, PluginSettings

    manager = PluginManager(PluginSettings(autoload=False))
    parts = _built(out / "run.toml", out / "run", manager, "--distributed.dp_shard=2")  # the test wrote run.toml
    state = CheckpointManager(out / "run", location=url).load(parts.model, parts.optimizer)
    assert state["step"] == 1
    weight = next(p for p in parts.model.parameters() if p.ndim == 2)
    sharded = isinstance(weight, DTensor) and weight.to_local().numel() < weight.numel()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sharded)
    whole = _whole_state(parts.model, parts.optimizer)
    if dist.get_rank() == 0:
        torch.save(whole, out / "loaded.pt")
        (out / "sharded.json").write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# -- two FSDP2 ranks save to the bucket, and resume from it --------------------------------


def test_two_sharded_ranks_save_to_the_bucket_and_resume_from_it_bit_for_bit(s3_env, tmp_path):
    """Two FSDP2 ranks (dp_shard = 2, gloo) train 2 steps, each uploading its own shard of step 2
    to the bucket, then resume from there and train step 3: the step's loss and every whole
    tensor of the model and the AdamW moments equal those of the same ranks' uninterrupted
    3-step run with local checkpoints, bit for bit."""
    from forge_lm.testing.distributed import torchrun

    url = f"s3://{s3_env['bucket']}/sharded"
    _run_config(tmp_path)
    result = torchrun([__file__, "save", str(tmp_path), url], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]

    # After the first run: one complete step, both ranks' shards and the shared objects.
    step_2 = sorted(json.loads((tmp_path / "saved_objects.json").read_text()))
    assert step_2 == [
        "sharded/latest",
        "sharded/step_2/.metadata",
        "sharded/step_2/__0_0.distcp",
        "sharded/step_2/__1_0.distcp",
        "sharded/step_2/trainer_state.json",
    ]
    assert not (tmp_path / "bucketed" / "checkpoints").exists()
    shards = [f"sharded/step_3/__{rank}_0.distcp" for rank in (0, 1)]
    assert {*shards, "sharded/step_3/trainer_state.json"} <= set(_objects(s3_env["bucket"]))

    reference = torch.load(tmp_path / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "bucketed.pt", weights_only=True)
    assert resumed.keys() == reference.keys()
    assert [key for key in reference if not torch.equal(resumed[key], reference[key])] == []
    events = [json.loads(line) for line in (tmp_path / "bucketed" / "events.jsonl").read_text().splitlines()]
    resumes = [(e["from_step"], e["checkpoint"]) for e in events if e["type"] == "resume"]
    assert resumes == [(2, "step_2")]  # the second run resumed from the bucket, not from step 0
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert losses["bucketed"]["3"] == losses["straight"]["3"]  # the resumed step, bit for bit
    assert losses["bucketed"]["1"] == losses["straight"]["1"]  # the first run's steps, too


class _EndState:
    """Keeps every whole tensor of the model and optimizer at the end of a run (a collective)."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self) -> None:
        self.whole: dict[str, torch.Tensor] = {}

    @hookimpl
    def forge_lm_train_end(self, context, status):
        self.whole = _whole_state(context.model, context.optimizer)


def _save_worker(out: Path, url: str) -> int:
    """Under torchrun: with dp_shard = 2, an uninterrupted 3-step run checkpointed locally, then
    2 steps checkpointed to ``url`` and a resume from there to step 3. Rank 0 writes what the
    bucket held after the save, both runs' whole end states and their losses."""
    import torch.distributed as dist

    from forge_lm.plugins import PluginManager, PluginSettings
    from forge_lm.testing.distributed import metrics_by_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # ours: train() leaves it up between the runs
    manager = PluginManager(PluginSettings(autoload=False))
    watch = _EndState()
    manager.add_plugin(watch, "end-state")
    # A constant learning rate: a cosine's would follow max_steps, which the first run shortens.
    shared = [*TINY_MODEL, "--distributed.dp_shard=2", "--checkpoint.interval=0", "--scheduler.name=constant"]

    def run(name: str, steps: int, *extra: str) -> dict[str, torch.Tensor]:
        overrides = [*shared, f"--train.output_dir={out / name}", f"--train.max_steps={steps}", *extra]
        assert train(load_config(out / "run.toml", overrides, manager.registry), manager).status == "completed"
        return watch.whole

    ends = {"straight": run("straight", 3)}
    run("bucketed", 2, f"--checkpoint.dir={url}")  # its last step, 2, is saved to the bucket
    bucket = url.removeprefix("s3://").partition("/")[0]
    saved = _objects(bucket) if dist.get_rank() == 0 else None
    ends["bucketed"] = run("bucketed", 3, f"--checkpoint.dir={url}")
    if dist.get_rank() == 0:
        (out / "saved_objects.json").write_text(json.dumps(saved))
        for name, whole in ends.items():
            torch.save(whole, out / f"{name}.pt")
        losses = {
            name: {step: m["loss"] for step, m in metrics_by_step(out / name).items() if "loss" in m} for name in ends
        }
        (out / "losses.json").write_text(json.dumps(losses))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # the multi-rank tests' ranks: torchrun runs this file
    workers = {"reshard": _reshard_worker, "save": _save_worker}
    sys.exit(workers[sys.argv[1]](Path(sys.argv[2]), sys.argv[3]))
