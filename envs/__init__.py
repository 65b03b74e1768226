"""Bundled environments, named in configs as `envs.NAME:Class` (they land with the env API issue)."""
