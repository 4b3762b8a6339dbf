"""Small vendor plugins for the plugin-manager tests, loaded through faked
entry points."""
