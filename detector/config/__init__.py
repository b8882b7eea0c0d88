"""The configuration: every default once, typed (schema.py, whose ``load_config`` merges the presets, an experiment
and the overrides), YAML files and key=value overrides read as text with each value checked by its field's rule
(reading.py), the device a run runs on and the name records give it (device.py), and the ways of sharing the
model, each named once with the class in detector/train/distributed/sharding/ that a run of it takes (sharing.py)."""
