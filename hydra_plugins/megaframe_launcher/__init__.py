"""megaframe's Hydra plugins (Hydra discovers launchers only under the hydra_plugins package)."""
