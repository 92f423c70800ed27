"""The ``wandb`` metrics backend: a Forge run as a Weights & Biases run.

On rank 0 (the ``RANK`` environment variable, 0 when unset) ``start()`` opens a W&B run with
the resolved config and the plugin manifest (under ``plugins``), ``log()`` records each
step's metrics at that step, and ``finish()`` writes the summary and closes the run. Other
ranks log nothing. A resumed training continues the W&B run whose id its checkpoint holds
(see :mod:`forge_wandb._runs`).

W&B never stops training: when it fails (no network, an init error, an exception in
``log`` or ``finish``), a :class:`WandbBackendWarning` names the cause and the backend turns
itself off for the rest of the run; the other backends go on.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from forge_lm.components import MetricsContext
from forge_lm.errors import PluginError
from forge_wandb import _runs

INSTALL_HINT = "pip install forge-wandb"


class WandbBackendWarning(UserWarning):
    """W&B failed; the wandb backend is off for the rest of the run, training goes on."""


class WandbBackend:
    def __init__(self, options: Any, context: MetricsContext, wandb: Any, rank: int = 0) -> None:
        self.options = options
        self.run_dir = Path(context.run_dir)
        self.run_name = options.run_name or Path(context.run_name).name or self.run_dir.resolve().name
        self.rank = rank
        self._wandb = wandb
        self._run: Any = None
        self._broken: Any = None  # the run W&B failed in, closed at finish()
        self._off = rank != 0  # only rank 0 logs

    @property
    def run(self) -> Any:
        """The W&B run being logged to, or None (another rank, not started, or turned off)."""
        return self._run

    def start(self, config: Mapping[str, Any], manifest: Sequence[Mapping[str, str]]) -> None:
        resume_id = _runs.run_id(self.run_dir)
        if self._off:
            _runs.started(self.run_dir, None)
            return
        arguments = dict(
            project=self.options.project,
            entity=self.options.entity,
            name=self.run_name,
            group=self.options.group,
            tags=list(self.options.tags) or None,
            mode=self.options.mode,
            dir=str(self._directory()),
            config={**config, "plugins": _plugins(manifest)},
            reinit="create_new",  # a run of its own, whatever other W&B runs this process has
        )
        if resume_id is not None:
            arguments.update(id=resume_id, resume="allow")
        run = None
        with self._shielded("could not start a run"):
            self._directory().mkdir(parents=True, exist_ok=True)
            run = self._wandb.init(**arguments)
        self._run = run
        # A disabled run (mode "disabled") has a throwaway id: save_state keeps the restored one.
        real = run is not None and not getattr(run, "disabled", False)
        _runs.started(self.run_dir, run.id if real else None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._run is None:
            return
        with self._shielded(f"failed to log step {step}"):
            self._run.log(dict(metrics), step=step)

    def finish(self, summary: Mapping[str, float]) -> None:
        status = _runs.finished(self.run_dir)
        failed = status not in (None, "completed")
        if self._run is not None:
            with self._shielded("failed to finish the run"):
                self._run.summary.update(dict(summary))
                self._run.finish(exit_code=1 if failed else 0)
            self._run = None
        elif self._broken is not None:
            # Turned off by a failure: close the run now that training is over, so that what it
            # logged is complete; a second failure here changes nothing and is not repeated.
            with contextlib.suppress(Exception):
                self._broken.finish(exit_code=1)
        self._broken = None

    def _directory(self) -> Path:
        return Path(self.options.dir) if self.options.dir is not None else self.run_dir

    @contextlib.contextmanager
    def _shielded(self, what: str) -> Iterator[None]:
        """Run a W&B call; if it raises, warn with the cause and turn the backend off."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - whatever W&B raises, training goes on (Ctrl-C still stops it)
            self._broken, self._run, self._off = self._run, None, True
            warnings.warn(
                f"W&B {what} ({type(exc).__name__}: {exc}); the wandb backend is off for the rest of this run, "
                "training and the other metrics backends go on",
                WandbBackendWarning,
                stacklevel=4,
            )


def _plugins(manifest: Sequence[Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """The manifest as ``{plugin: {distribution, version}}``: one config column per plugin in W&B."""
    return {p["name"]: {"distribution": p["distribution"], "version": p["version"]} for p in manifest}


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise PluginError(
            f"metrics backend 'wandb' needs the wandb package, which cannot be imported ({exc}). "
            f"Install it with `{INSTALL_HINT}`, or remove 'wandb' from [metrics] backends."
        ) from None
    return wandb


def build_wandb(options: Any, context: MetricsContext) -> WandbBackend:
    rank = _rank()
    # Imported here, not at start(), so a missing wandb stops the run before it trains; other
    # ranks, which log nothing, do not import it at all.
    return WandbBackend(options, context, _import_wandb() if rank == 0 else None, rank)
