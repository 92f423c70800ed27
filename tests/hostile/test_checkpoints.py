"""Hostile and damaged checkpoints: no payload runs, no path leads out of the run, no tampered
state is restored, and the newest intact checkpoint always survives.

Each payload of ``_payloads`` is tried twice: directly against the metadata reader (every
payload, fast) and through the commands that open checkpoints (``train`` resuming,
``generate``, ``export-hf``).
"""

from __future__ import annotations

import json
import os
import pickle

import _payloads as p
import pytest
from _hostile import Case, Workspace, case_params

from forge_lm.checkpoint._safe import DamagedCheckpointError, UnsafeCheckpointError, read_metadata

UNSAFE = {
    "reduce-protocol-0": p.reduce_with_protocol(0),
    "reduce-protocol-1": p.reduce_with_protocol(1),
    "reduce-protocol-2": p.reduce_with_protocol(2),
    "reduce-protocol-3": p.reduce_with_protocol(3),
    "reduce-protocol-4": p.reduce_with_protocol(4),
    "reduce-protocol-5": p.reduce_with_protocol(5),
    "global-os-system": p.global_opcode("os", "system"),
    "global-builtins-eval": p.global_opcode("builtins", "eval"),
    "global-builtins-exec": p.global_opcode("builtins", "exec"),
    "stack-global-dotted-under-dcp": p.stack_global_reduce(p.DCP, "os.system"),
    "stack-global-dotted-under-dcp-filesystem": p.stack_global_reduce(
        "torch.distributed.checkpoint.filesystem", "os.system"
    ),
    "stack-global-dotted-class-globals": p.stack_global_reduce(p.DCP, "Metadata.__init__.__globals__"),
    "stack-global-torch-load": p.stack_global_reduce("torch", "load"),
    "stack-global-torch-serialization-load": p.stack_global_reduce("torch.serialization", "load"),
    "stack-global-torch-hub-load": p.stack_global_reduce("torch.hub", "load"),
    "stack-global-torch-dotted-os": p.stack_global_reduce("torch", "os.system"),
    "stack-global-builtins-getattr": p.stack_global_reduce("builtins", "getattr"),
    "stack-global-builtins-dunder-import": p.stack_global_reduce("builtins", "__import__"),
    "stack-global-subprocess-getoutput": p.stack_global_reduce("subprocess", "getoutput"),
    "inst-os-system": p.inst_opcode("os", "system"),
    "inst-subprocess-popen": p.inst_opcode("subprocess", "Popen"),
    "obj-os-system": p.obj_opcode("os", "system"),
    "newobj-subprocess-popen": p.newobj("subprocess", "Popen"),
    "newobj-ex-subprocess-popen": p.newobj_ex("subprocess", "Popen"),
    "functools-partial": p.partial_of_system(),
    "operator-methodcaller": p.methodcaller(),
    "build-replaces-setstate": p.build_setstate_on_allowed("StorageMeta"),
    "persistent-id": p.persistent_id(),
    "persistent-id-protocol-0": p.persistent_id_protocol0(),
}
DAMAGED = {
    "build-on-an-allowed-class-object": p.build_on_allowed_harmless("Metadata"),
    "extension-code": p.extension_code(1),
    "memo-slot-never-written": p.memo_confusion(),
    "empty-file": lambda sentinel: b"",
    "not-a-pickle": lambda sentinel: b"PK\x03\x04 this is a zip",
    "storage-path-up-and-out": p.metadata_like("../../../../etc/passwd"),
    "storage-path-absolute": p.metadata_like("/etc/passwd"),
    "storage-path-in-a-subfolder": p.metadata_like("sub/__0_0.distcp"),
    "tensor-larger-than-its-bytes": p.metadata_like("__0_0.distcp", size=(2**40, 2**20)),
    "tensor-with-a-negative-dimension": p.metadata_like("__0_0.distcp", size=(-4,)),
}


@pytest.mark.parametrize(("name", "payload"), UNSAFE.items(), ids=UNSAFE)
def test_the_metadata_reader_refuses_every_payload_naming_code(name, payload, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    (tmp_path / ".metadata").write_bytes(payload(sentinel))
    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 64)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(UnsafeCheckpointError):
            read_metadata(tmp_path)
    finally:
        os.chdir(cwd)
    assert not sentinel.exists()


@pytest.mark.parametrize(("name", "payload"), DAMAGED.items(), ids=DAMAGED)
def test_the_metadata_reader_calls_malformed_metadata_damaged(name, payload, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    (tmp_path / ".metadata").write_bytes(payload(sentinel))
    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 64)
    with pytest.raises(DamagedCheckpointError):
        read_metadata(tmp_path)
    assert not sentinel.exists()


def test_the_metadata_reader_rebuilds_what_dcp_wrote(trained_run):
    """Against DCP's own (trusting) unpickler on a checkpoint Forge wrote itself."""
    step = trained_run / "checkpoints" / "step_4"
    ours = read_metadata(step)
    with (step / ".metadata").open("rb") as handle:
        theirs = pickle.load(handle)
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data
    assert len(ours.state_dict_metadata) > 10


# -- through the commands ---------------------------------------------------------------------

RESUME = ("train", "{tiny}", "--train.max_steps=6", "--train.output_dir={run}")
GENERATE = ("generate", "{run}", "--prompt", "ab", "--max-new-tokens", "2")
EXPORT = ("export-hf", "{run}", "{root}/hf")
DOCTOR = ("doctor", "--run-dir", "{run}", "--min-free-gib", "0", "--json")
REFUSED = r"forge: error: refusing to load checkpoint '.*step_4': its metadata "
PASSED_OVER = r"forge: warning: passed over checkpoint step_4: "


def doctor_says(status: str, found: str):
    """The doctor's checkpoints line has ``status`` and mentions ``found``."""

    def check(ws: Workspace, outcome) -> None:
        report = json.loads(outcome.stdout)
        line = next(c for c in report["checks"] if c["check"] == "checkpoints")
        assert line["status"] == status, line
        assert found in line["detail"], line

    return check


def plant_metadata(payload):
    def setup(ws: Workspace) -> None:
        (ws.damage("step_4") / ".metadata").write_bytes(payload(ws.sentinel))

    return setup


def edit_state(edit):
    """Setup that rewrites step_4's trainer_state.json with ``edit(state)``."""

    def setup(ws: Workspace) -> None:
        path = ws.damage("step_4") / "trainer_state.json"
        state = json.loads(path.read_text())
        edit(state)
        path.write_text(json.dumps(state))

    return setup


def resumed_from(step: int):
    def check(ws: Workspace, outcome) -> None:
        assert f"resumed from {ws.checkpoints / f'step_{step}'} (step {step})" in outcome.stderr

    return check


def _set(path: str, value):
    def edit(state):
        *parents, last = path.split(".")
        target = state
        for key in parents:
            target = target[key]
        target[last] = value

    return edit


def link_latest_out(ws: Workspace) -> None:
    other = ws.root / "other-run"
    other.mkdir()
    latest = ws.checkpoints / "latest"
    latest.unlink()
    latest.symlink_to(other)


def latest_names_parent(ws: Workspace) -> None:
    (ws.checkpoints / "latest").write_text("../../other-run\n")


def latest_names_older(ws: Workspace) -> None:
    (ws.checkpoints / "latest").write_text("step_2\n")


def step_dir_is_a_link(ws: Workspace) -> None:
    """step_6 is a link to another run's checkpoint: passed over, never loaded."""
    elsewhere = ws.root / "elsewhere"
    (ws.checkpoints / "step_4").rename(ws.root / "moved")
    import shutil

    shutil.copytree(ws.root / "moved", elsewhere)
    (ws.root / "moved").rename(ws.checkpoints / "step_4")
    (ws.checkpoints / "step_6").symlink_to(elsewhere, target_is_directory=True)
    ws.damaged.add("step_6")


def shard_is_a_link(ws: Workspace) -> None:
    shard = next(ws.damage("step_4").glob("*.distcp"))
    (ws.root / "outside.distcp").write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(ws.root / "outside.distcp")


def unicode_digits_step(ws: Workspace) -> None:
    import shutil

    shutil.copytree(ws.checkpoints / "step_4", ws.checkpoints / "step_\u0661\u0660")  # Arabic-Indic "10"


def truncate_shard(ws: Workspace) -> None:
    shard = next(ws.damage("step_4").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def state_not_json(ws: Workspace) -> None:
    (ws.damage("step_4") / "trainer_state.json").write_bytes(b"\xff\xfe not json")


def edit_metadata(edit):
    """Setup that rewrites step_4's ``.metadata`` (a file Forge wrote: the test may unpickle it)
    with ``edit(metadata)``, keeping it a well-formed DCP metadata pickle."""

    def setup(ws: Workspace) -> None:
        path = ws.damage("step_4") / ".metadata"
        with path.open("rb") as handle:
            metadata = pickle.load(handle)  # written by this test's own training run
        edit(metadata)
        path.write_bytes(pickle.dumps(metadata))

    return setup


WQ = "state.model.layers.0.attention.wq.weight"
EXP_AVG = "state.optimizer.state.layers.0.attention.wq.weight.exp_avg"


def no_chunks(key: str):
    """The tensor ``key`` has no chunk and no storage entry: nothing of it would be loaded."""

    def edit(metadata) -> None:
        metadata.state_dict_metadata[key].chunks = []
        metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != key}

    return edit


def half_chunk(key: str):
    """The chunk of ``key`` shrunk to its first half of rows: the rest would stay as it was."""

    def edit(metadata) -> None:
        import torch
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        (chunk,) = metadata.state_dict_metadata[key].chunks
        half = torch.Size([chunk.sizes[0] // 2, *chunk.sizes[1:]])
        metadata.state_dict_metadata[key].chunks = [ChunkStorageMetadata(offsets=chunk.offsets, sizes=half)]

    return edit


def chunk_without_storage(key: str):
    def edit(metadata) -> None:
        metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != key}

    return edit


def _group(index: int, **values):
    return lambda state: state["optimizer"]["param_groups"][index].update(values)


def both_tampered(ws: Workspace) -> None:
    for step in ("step_2", "step_4"):
        path = ws.damage(step) / "trainer_state.json"
        state = json.loads(path.read_text())
        state["step"] = "2"
        path.write_text(json.dumps(state))


CASES = [
    *(
        Case(f"train-resume-{name}", RESUME, 2, REFUSED, setup=plant_metadata(payload), needs_run=True)
        for name, payload in UNSAFE.items()
    ),
    *(
        Case(f"generate-{name}", GENERATE, 2, REFUSED, setup=plant_metadata(UNSAFE[name]), needs_run=True)
        for name in ("stack-global-dotted-under-dcp", "reduce-protocol-2", "functools-partial")
    ),
    *(
        Case(f"export-hf-{name}", EXPORT, 2, REFUSED, setup=plant_metadata(UNSAFE[name]), needs_run=True)
        for name in ("stack-global-dotted-under-dcp", "inst-os-system")
    ),
    *(
        Case(
            f"train-resume-{name}",
            RESUME,
            0,
            PASSED_OVER,
            setup=plant_metadata(payload),
            needs_run=True,
            check=resumed_from(2),
        )
        for name, payload in DAMAGED.items()
    ),
    Case(
        "generate-a-run-whose-config-was-edited-to-a-huge-model",
        GENERATE,
        2,
        r"forge: error: the model of '.*run' needs (about|at least) [\d.]+ [TP]B for its weights and optimizer "
        r"state, more than the",
        setup=lambda ws: (ws.run / "config.toml").write_text(
            (ws.run / "config.toml").read_text().replace("n_layers = 2\n", "n_layers = 1000000000\n")
        ),
        needs_run=True,
    ),
    Case(
        "generate-damaged-metadata-uses-older",
        GENERATE,
        0,
        PASSED_OVER,
        setup=plant_metadata(DAMAGED["storage-path-up-and-out"]),
        needs_run=True,
    ),
    # forge doctor reads checkpoints the same way, loading no tensor
    Case(
        "doctor-unsafe-metadata",
        DOCTOR,
        1,
        r"$",
        setup=plant_metadata(UNSAFE["stack-global-dotted-under-dcp"]),
        needs_run=True,
        check=doctor_says(
            "fail", "step_4: its metadata would import 'torch.distributed.checkpoint.metadata.os.system'"
        ),
    ),
    Case(
        "doctor-damaged-newest",
        DOCTOR,
        0,
        r"$",
        setup=plant_metadata(DAMAGED["storage-path-up-and-out"]),
        needs_run=True,
        check=doctor_says("warning", "a resumed run starts from step_2; passed over: step_4"),
    ),
    # trainer_state.json tampered: passed over like a damaged checkpoint, the older one used
    *(
        Case(f"state-{name}", RESUME, 0, PASSED_OVER, setup=edit_state(edit), needs_run=True, check=resumed_from(2))
        for name, edit in {
            "step-is-a-string": _set("step", "4"),
            "step-is-negative": _set("step", -1),
            "step-is-a-float": _set("step", 4.0),
            "step-claims-an-earlier-step": _set("step", 2),
            "step-is-a-bool": _set("step", True),
            "tokens-seen-is-a-string": _set("trainer.tokens_seen", "many"),
            "tokens-seen-is-missing": lambda state: state["trainer"].pop("tokens_seen"),
            "data-state-is-a-string": _set("trainer.data", "corrupt"),
            "data-position-is-a-string": _set("trainer.data.batches", "12"),
            "scheduler-state-is-a-list": _set("trainer.scheduler", [1, 2]),
            "scheduler-lr-is-a-string": _set("trainer.scheduler.base_lrs", ["0.1"]),
            "rng-state-is-short": _set("rng.torch", [1, 2, 3]),
            "rng-python-is-a-dict": _set("rng.python", {"a": 1}),
            "tensor-reference-is-a-number": lambda state: state["model"].update(output_weight={"__tensor__": 7}),
            "plugins-is-a-list": _set("trainer.plugins", ["x"]),
            "model-is-missing": lambda state: state.pop("model"),
            # the optimizer's settings and the scheduler's per-group state
            "weight-decay-is-a-string": _group(0, weight_decay="x"),
            "maximize-flipped": _group(0, maximize=True),
            "eps-hugely-negative": _group(1, eps=-1e30),
            "lr-is-negative": _group(0, lr=-1.0),
            "lr-is-infinite": _group(0, lr=float("inf")),
            "scheduler-base-lrs-short": lambda state: state["trainer"]["scheduler"]["base_lrs"].pop(),
            "scheduler-last-lr-long": lambda state: state["trainer"]["scheduler"]["_last_lr"].append(1.0),
        }.items()
    ),
    # ... and with the reason named (the optimizer would have refused these, in its own words)
    *(
        Case(
            f"state-{name}",
            RESUME,
            0,
            PASSED_OVER + reason,
            setup=edit_state(edit),
            needs_run=True,
            check=resumed_from(2),
        )
        for name, (edit, reason) in {
            "param-groups-one-fewer": (
                lambda state: state["optimizer"]["param_groups"].pop(),
                r"trainer_state\.json: optimizer\.param_groups has 1 groups",
            ),
            "param-group-gains-a-key": (_group(0, momentum=0.9), r"trainer_state\.json: optimizer\.param_groups\[0\]"),
            "optimizer-state-refers-to-another-tensor": (
                lambda state: state["optimizer"]["state"]["layers.0.attention.wq.weight"].update(
                    exp_avg={"__tensor__": "state.optimizer.state.layers.0.attention.wk.weight.exp_avg"}
                ),
                r"trainer_state\.json: optimizer\.state\['layers\.0\.attention\.wq\.weight'\] refers",
            ),
        }.items()
    ),
    # .metadata whose chunks do not cover a tensor: passed over, not loaded half-way
    *(
        Case(
            f"metadata-{name}",
            RESUME,
            0,
            PASSED_OVER + reason,
            setup=edit_metadata(edit),
            needs_run=True,
            check=resumed_from(2),
        )
        for name, (edit, reason) in {
            "parameter-with-no-chunks": (no_chunks(WQ), r"the chunks of '.*wq\.weight' do not cover it"),
            "parameter-chunk-of-half-its-rows": (half_chunk(WQ), r"the chunks of '.*wq\.weight' do not cover it"),
            "parameter-chunk-without-storage": (chunk_without_storage(WQ), r"no storage is listed for the chunk"),
            "optimizer-state-chunk-of-half-its-rows": (
                half_chunk(EXP_AVG),
                r"the chunks of '.*wq\.weight\.exp_avg' do not cover it",
            ),
            "optimizer-state-with-no-chunks": (no_chunks(EXP_AVG), r"the chunks of '.*exp_avg' do not cover it"),
        }.items()
    ),
    Case("state-not-json", RESUME, 0, PASSED_OVER, setup=state_not_json, needs_run=True, check=resumed_from(2)),
    Case(
        "both-checkpoints-tampered-no-usable",
        RESUME,
        2,
        r"forge: error: no usable checkpoint in .*checkpoints:",
        setup=both_tampered,
        needs_run=True,
    ),
    Case("shard-truncated", RESUME, 0, PASSED_OVER, setup=truncate_shard, needs_run=True, check=resumed_from(2)),
    # links and names that lead out of the run
    Case(
        "latest-is-a-link-out-of-the-run",
        RESUME,
        0,
        r"forge: warning: .*checkpoints/latest: not a small plain file; ignored",
        setup=link_latest_out,
        needs_run=True,
        check=resumed_from(4),
    ),
    Case(
        "latest-names-a-parent-path",
        RESUME,
        0,
        r"forge: warning: .*checkpoints/latest: names '\.\./\.\./other-run'",
        setup=latest_names_parent,
        needs_run=True,
        check=resumed_from(4),
    ),
    Case(
        "latest-names-an-older-step-newer-is-not-overwritten",
        RESUME,
        0,
        r"forge: warning: checkpoint step_4 is newer than the one checkpoints/latest names",
        setup=latest_names_older,
        needs_run=True,
        check=resumed_from(4),
    ),
    Case(
        "step-directory-is-a-link",
        RESUME,
        0,
        r"forge: warning: passed over checkpoint step_6: a link or not a directory",
        setup=step_dir_is_a_link,
        needs_run=True,
        check=resumed_from(4),
    ),
    Case(
        "shard-is-a-link-out-of-the-run",
        RESUME,
        0,
        r"forge: warning: passed over checkpoint step_4: holds '__0_0.distcp', which is a link",
        setup=shard_is_a_link,
        needs_run=True,
        check=resumed_from(2),
    ),
    Case(
        "step-name-with-non-ascii-digits-is-not-a-checkpoint",
        RESUME,
        0,
        r"$",  # not a checkpoint name at all: nothing to say
        setup=unicode_digits_step,
        needs_run=True,
        check=resumed_from(4),
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case):
    run_case(case)


def test_a_tampered_newest_checkpoint_never_makes_the_run_delete_an_intact_one(run_case):
    """step_4's state claims step 2: passed over; the run resumes from step_2 and saves step_4
    anew (replacing only the tampered one); step_2 is never deleted or rewritten."""
    ws, _ = run_case(Case("tampered", RESUME, 0, PASSED_OVER, setup=edit_state(_set("step", 2)), needs_run=True))
    state = json.loads((ws.checkpoints / "step_4" / "trainer_state.json").read_text())
    assert state["step"] == 4
    assert sorted(p.name for p in ws.checkpoints.glob("step_*")) == ["step_2", "step_4", "step_6"]
