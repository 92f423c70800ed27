"""forge_lm.safe_write, the one rule by which the core replaces a file: the old file or the whole
new one under the name (a crash between the write and the rename leaves the old file), never a
write through a link (at the target or at a temporary name), fsync of the file before the rename
and of the directory after it, and the mode open() gives a new file."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forge_lm import safe_write
from forge_lm.safe_write import PARTIAL_SUFFIX, replacing, write_atomically

PRECIOUS = b"precious: must never be overwritten"


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file outside the directory written to, which a planted link points at."""
    path = tmp_path / "elsewhere" / "victim.txt"
    path.parent.mkdir()
    path.write_bytes(PRECIOUS)
    return path


@pytest.fixture
def folder(tmp_path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_text_and_bytes_are_written_whole_and_nothing_else_is_left(folder):
    write_atomically(folder / "a.json", '{"ü": 1}\n')
    write_atomically(folder / "b.bin", b"\x00\xff")
    write_atomically(folder / "a.json", "replaced")
    assert (folder / "a.json").read_text(encoding="utf-8") == "replaced"
    assert (folder / "b.bin").read_bytes() == b"\x00\xff"
    assert _names(folder) == ["a.json", "b.bin"]


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_a_written_file_gets_the_mode_open_gives_a_new_file(folder, mask):
    previous = os.umask(mask)
    try:
        write_atomically(folder / "text", "x")
        with replacing(folder / "by_path") as partial:
            partial.write_bytes(b"y")
        with replacing(folder / "recreated") as partial:  # as safetensors does: a new file, 0600
            partial.unlink()
            os.close(os.open(partial, os.O_WRONLY | os.O_CREAT, 0o600))
        with open(folder / "reference", "w") as file:  # what open() itself gives
            file.write("z")
    finally:
        os.umask(previous)
    for name in ("text", "by_path", "recreated", "reference"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o666 & ~mask, name


def test_a_link_at_the_target_is_refused_as_o_nofollow_refuses_it(folder, victim):
    link = folder / "config.toml"
    link.symlink_to(victim)
    for write in (
        lambda: write_atomically(link, "new"),
        lambda: replacing(link).__enter__(),
    ):
        with pytest.raises(OSError, match="symbolic links") as caught:
            write()
        assert caught.value.errno == errno.ELOOP
        assert caught.value.filename == str(link)
    assert victim.read_bytes() == PRECIOUS
    assert link.is_symlink()
    assert _names(folder) == ["config.toml"]  # no temporary file left


def test_with_replace_link_the_link_itself_is_replaced_and_its_target_untouched(folder, victim):
    (folder / "latest").symlink_to(victim)
    (folder / "trace.json").symlink_to(victim)
    write_atomically(folder / "latest", "step_4\n", replace_link=True)
    with replacing(folder / "trace.json", replace_link=True) as partial:
        partial.write_text("{}")
    assert victim.read_bytes() == PRECIOUS
    for name, text in (("latest", "step_4\n"), ("trace.json", "{}")):
        assert not (folder / name).is_symlink()
        assert (folder / name).read_text() == text


def test_a_link_planted_at_a_temporary_name_is_never_written_through(folder, victim, monkeypatch):
    """The temporary name is random and created exclusively: even a planted link at the very
    name drawn is not opened (O_EXCL | O_NOFOLLOW); another name is drawn."""
    draws = iter([b"\x00" * 4, b"\x01" * 4])
    monkeypatch.setattr(safe_write.os, "urandom", lambda n: next(draws))
    planted = folder / f".state.json.00000000{PARTIAL_SUFFIX}"
    planted.symlink_to(victim)
    write_atomically(folder / "state.json", "new")
    assert victim.read_bytes() == PRECIOUS
    assert (folder / "state.json").read_text() == "new"
    assert planted.is_symlink()  # left as it was: not Forge's to remove


def test_a_crash_between_write_and_rename_leaves_the_old_file(folder):
    """A process killed (SIGKILL) after writing the new data, before the rename: the name still
    holds the old file whole; the new data is only in the temporary file beside it."""
    target = folder / "trainer_state.json"
    target.write_text("old state")
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from forge_lm import safe_write
        def killed(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        safe_write.os.replace = killed
        safe_write.write_atomically({str(target)!r}, "new state")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, check=False, timeout=60)
    assert run.returncode == -9, run.stderr
    assert target.read_text() == "old state"
    leftovers = [p for p in folder.iterdir() if p != target]
    assert [p.name.endswith(PARTIAL_SUFFIX) and p.name.startswith(".trainer_state.json.") for p in leftovers] == [True]
    assert leftovers[0].read_text() == "new state"


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(folder, monkeypatch, failing):
    target = folder / "config.toml"
    target.write_text("old")

    def no_space(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safe_write.os, failing, no_space)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, "new")
    with pytest.raises(OSError, match="No space left"), replacing(target) as partial:
        partial.write_text("new")
    assert target.read_text() == "old"
    assert _names(folder) == ["config.toml"]


def test_an_error_inside_the_block_keeps_the_old_file(folder):
    target = folder / "model.safetensors"
    target.write_bytes(b"old weights")

    def write_then_break() -> None:
        with replacing(target) as partial:
            partial.write_bytes(b"half")
            raise RuntimeError("writer broke")

    with pytest.raises(RuntimeError, match="writer broke"):
        write_then_break()
    assert target.read_bytes() == b"old weights"
    assert _names(folder) == ["model.safetensors"]


def test_a_missing_directory_is_an_error_and_creates_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_atomically(tmp_path / "no" / "file", "x")
    assert not (tmp_path / "no").exists()


def _fsynced(monkeypatch) -> list[str]:
    """What os.fsync is called on, in order: the written file's path, or its directory's."""
    calls: list[str] = []
    real = os.fsync

    def recording(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(safe_write.os, "fsync", recording)
    return calls


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names a descriptor's file through /proc")
def test_durable_writes_fsync_the_file_before_the_rename_then_the_directory(folder, monkeypatch):
    calls = _fsynced(monkeypatch)
    renamed: list[int] = []
    real_replace = os.replace
    monkeypatch.setattr(safe_write.os, "replace", lambda a, b: (renamed.append(len(calls)), real_replace(a, b)))
    write_atomically(folder / "latest", "step_2\n")
    with replacing(folder / "weights") as partial:
        partial.write_bytes(b"w")
    assert len(calls) == 4
    for file_call, dir_call in (calls[0:2], calls[2:4]):
        assert Path(file_call).parent == folder
        assert Path(file_call).name.endswith(PARTIAL_SUFFIX)
        assert dir_call == str(folder)
    assert renamed == [1, 3]  # each rename after its file's fsync, before its directory's

    calls.clear()
    write_atomically(folder / "cache.json", "{}", durable=False)
    with replacing(folder / "trace.json", durable=False) as partial:
        partial.write_text("{}")
    assert calls == []


def test_new_creates_and_refuses_anything_already_there(folder, victim):
    write_atomically(folder / "meta.json", "first", new=True)
    (folder / "dangling").symlink_to(folder / "nowhere")
    (folder / "to_victim").symlink_to(victim)
    for name in ("meta.json", "dangling", "to_victim"):
        with pytest.raises(FileExistsError):
            write_atomically(folder / name, "second", new=True)
    assert (folder / "meta.json").read_text() == "first"
    assert not (folder / "nowhere").exists()
    assert victim.read_bytes() == PRECIOUS
    assert _names(folder) == ["dangling", "meta.json", "to_victim"]


def test_new_without_hard_links_still_refuses_and_creates(folder, monkeypatch):
    def unsupported(*args, **kwargs):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(safe_write.os, "link", unsupported)
    write_atomically(folder / "meta.json", "first", new=True)
    with pytest.raises(FileExistsError):
        write_atomically(folder / "meta.json", "second", new=True)
    assert (folder / "meta.json").read_text() == "first"
    assert _names(folder) == ["meta.json"]


def test_a_long_name_still_gets_a_temporary_name_the_file_system_takes(folder):
    name = "n" * 250
    write_atomically(folder / name, "x")
    assert (folder / name).read_text() == "x"
