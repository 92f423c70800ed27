"""The core's own components, registered through the same hooks as any third-party plugin.

Each module here is a plugin (``core.<module>`` in ``forge list-plugins``): registration hooks
only. Factories are named as ``"module:function"`` strings, so torch is imported when a component
is built, not when plugins are listed; so are the options classes (in :mod:`.options`, one module
per plugin module, and :class:`forge_lm.config.LlamaOptions`), imported when a config is
validated: listing plugins neither imports nor defines any of them, and imports neither the config
schema nor :mod:`forge_lm.components`, which some of them build on.
"""
