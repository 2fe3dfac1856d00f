"""dflash-serve service: config, preflight, launcher."""
