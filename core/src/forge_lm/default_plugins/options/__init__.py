"""The options classes of the core's own components, one module per built-in plugin module.

The plugin modules name them by import path (``"forge_lm.default_plugins.options.losses:CrossEntropyOptions"``):
they are imported when a config is validated, never when plugins are listed.
"""
