"""A plugin whose import fails, as when its runtime is broken."""

raise ImportError("libascendcl.so: cannot open shared object file")
