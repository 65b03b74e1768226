"""Config: one typed tree for a whole run, loaded from YAML with `key.sub=value` overrides.

Owns: the schema (every field, type, default and meaning, in `schema`), loading and validation
with errors that name the file, line or override, the field path, the bad value and what is
allowed (`loader`), and checking that a model directory is usable (`model_dir`). Does not own:
what the parts do with their sections.
"""

from slime_async.config.loader import ConfigError, load_config, parse_override, to_yaml
from slime_async.config.schema import Config

__all__ = ["Config", "ConfigError", "load_config", "parse_override", "to_yaml"]
