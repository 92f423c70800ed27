"""Every rank must run the same code: the same plugins, at the same versions, resolved the same way."""

from __future__ import annotations

import torch.distributed as dist

from forge_lm.errors import PluginError


def check_same_plugins(manifest: list[dict[str, str]], manifest_hash: str) -> None:
    """Compare this rank's plugin manifest with every other rank's; on any difference raise
    (on every rank) a PluginError naming the ranks and the plugins that differ."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    gathered: list[tuple[str, list[dict[str, str]]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (manifest_hash, manifest))
    reference_hash, reference = gathered[0]
    problems = []
    for rank, (digest, other) in enumerate(gathered):
        if digest != reference_hash:
            problems.append(f"rank {rank}: " + "; ".join(_differences(reference, other)))
    if problems:
        raise PluginError(
            "the ranks resolved different plugin sets (compared with rank 0):\n  "
            + "\n  ".join(problems)
            + "\nInstall the same packages in every node's environment and use the same plugin switches "
            "(FORGE_LM_PLUGINS, FORGE_LM_BLOCK_PLUGINS, --plugins, --block-plugin) on every rank."
        )


def _differences(reference: list[dict[str, str]], other: list[dict[str, str]]) -> list[str]:
    ours = {entry["name"]: entry for entry in reference}
    theirs = {entry["name"]: entry for entry in other}
    notes = [f"lacks plugin '{name}' ({ours[name]['distribution']})" for name in sorted(ours.keys() - theirs.keys())]
    notes += [
        f"has extra plugin '{name}' ({theirs[name]['distribution']})" for name in sorted(theirs.keys() - ours.keys())
    ]
    for name in sorted(ours.keys() & theirs.keys()):
        if ours[name] != theirs[name]:
            changed = sorted(
                key for key in ours[name].keys() | theirs[name].keys() if ours[name].get(key) != theirs[name].get(key)
            )
            notes += [
                f"plugin '{name}' {key} {theirs[name].get(key)!r} (rank 0: {ours[name].get(key)!r})" for key in changed
            ]
    return notes or ["a different plugin manifest"]
