"""dflash-serve SGLang plugin. Importing this package has no side effects; see plugin.register()."""
