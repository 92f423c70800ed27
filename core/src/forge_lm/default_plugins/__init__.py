"""The core's own components, registered through the same hooks as any third-party plugin.

Each module here is a plugin (``core.<module>`` in ``forge list-plugins``): option classes and
registration hooks only. Factories are named as ``"module:function"`` strings, so torch is
imported when a component is built, not when plugins are listed; so are the options classes
that need more than attrs and :mod:`forge_lm.validators` (``*_options`` modules here, and
:class:`forge_lm.config.LlamaOptions`), so that listing imports neither the config schema nor
:mod:`forge_lm.components`.
"""
