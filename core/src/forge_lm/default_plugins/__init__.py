"""The core's own components, registered through the same hooks as any third-party plugin.

Each module here is a plugin (``core.<module>`` in ``forge list-plugins``): option classes and
registration hooks only. Factories are named as ``"module:function"`` strings, so torch is
imported when a component is built, not when plugins are listed.
"""
