from forge_lm.plugins import PluginManager, PluginSettings, PluginStatus


def test_fake_site_plugin_is_discovered_through_its_entry_point(fake_site):
    fake_site.install(
        "forge-fake",
        """
        from forge_lm import hookimpl
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_register_losses(register):
            register("fake_loss", "forge_fake:build", description="A fake loss")
        """,
    )
    manager = PluginManager(PluginSettings(allow=("fake",)))
    plugin = manager.plugin("fake")
    assert (plugin.status, plugin.distribution, plugin.version) == (PluginStatus.OK, "forge-fake", "1.0")
    assert manager.registry.resolve("losses", "fake_loss").plugin is plugin
