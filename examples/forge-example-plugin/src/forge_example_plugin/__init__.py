"""forge-example-plugin: the smallest useful third-party Forge plugin."""
