"""``forge list-plugins --requirements``: the installed Forge distributions as pinned requirement lines.

Run in-process against this development environment, with fake installed plugins (the
``fake_site`` fixture); ``test_wheels.py`` rebuilds a real environment from the output.
"""

from __future__ import annotations

from forge_lm.cli._list_plugins import requirement_lines
from forge_lm.cli._main import main
from forge_lm.plugins import PluginInfo, PluginManager, PluginSettings, core_version

PLUGIN = 'FORGE_LM_PLUGIN_API = ">=1,<2"\n'


def _requirements(capsys, *args: str) -> list[str]:
    assert main(["list-plugins", "--requirements", *args]) == 0
    return capsys.readouterr().out.splitlines()


def test_core_comes_first_with_its_installed_extras_then_each_plugin_pinned(capsys):
    lines = _requirements(capsys)

    # The development set-up installs the core with every extra, and the six first-party plugins.
    assert lines[0] == f"forge-lm[hf,plot,s3,tensorboard]=={core_version()}"
    first_party = {
        "forge-float8==0.1.0",
        "forge-lm-eval==0.1.0",
        "forge-moe==0.1.0",
        "forge-optim-muon==0.1.0",
        "forge-prometheus==0.1.0",
        "forge-wandb==0.1.0",
    }
    assert first_party <= set(lines[1:])
    assert lines[1:] == sorted(lines[1:])


def test_every_installed_plugin_is_listed_whatever_its_status(capsys, fake_site):
    fake_site.install("forge-reqs-ok", PLUGIN, version="2.3")
    fake_site.install("forge-reqs-broken", "raise ImportError('no')\n", version="0.4")
    fake_site.install("forge-reqs-off", PLUGIN, version="1.0.post1")

    lines = _requirements(capsys, "--block-plugin", "off")

    assert {"forge-reqs-ok==2.3", "forge-reqs-broken==0.4", "forge-reqs-off==1.0.post1"} <= set(lines)


def test_a_distribution_with_several_plugins_is_listed_once(capsys, fake_site):
    module = fake_site.install(
        "forge-reqs-two", PLUGIN, version="1.1", entry_points={"first": "forge_reqs_two", "second": "forge_reqs_two_b"}
    )
    (fake_site.root / "forge_reqs_two_b.py").write_text(PLUGIN)
    fake_site.modules.append("forge_reqs_two_b")

    lines = _requirements(capsys)

    assert module == "forge_reqs_two"
    assert lines.count("forge-reqs-two==1.1") == 1


def test_an_extra_is_kept_only_when_everything_it_needs_is_installed(capsys, fake_site):
    fake_site.install("forge-reqs-extras", PLUGIN, version="0.2")
    metadata = fake_site.root / "forge_reqs_extras-0.2.dist-info" / "METADATA"
    metadata.write_text(
        metadata.read_text()
        + "Provides-Extra: present\nRequires-Dist: pluggy>=1; extra == 'present'\n"
        + "Provides-Extra: absent\nRequires-Dist: forge-reqs-nowhere>=1; extra == 'absent'\n"
        + "Provides-Extra: too-old\nRequires-Dist: pluggy>=99; extra == 'too-old'\n"
    )

    lines = _requirements(capsys)

    assert "forge-reqs-extras[present]==0.2" in lines  # not [absent] (missing) nor [too-old] (version)


def test_an_entry_point_without_distribution_metadata_becomes_a_comment():
    manager = PluginManager(PluginSettings(autoload=False))
    manager.plugins.append(PluginInfo("ghost", "<unknown distribution>", "?", "ghost_plugin"))

    lines = requirement_lines(manager)

    assert "# plugin 'ghost' (ghost_plugin): its distribution is unknown, pin it by hand" in lines
    assert not any("unknown distribution" in line for line in lines)


def test_requirements_and_json_exclude_each_other(capsys):
    assert main(["list-plugins", "--requirements", "--json"]) == 2
    assert "argument --json: not allowed with argument --requirements" in capsys.readouterr().err
