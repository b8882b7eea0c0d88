"""Several processes: their group and collectives (processes.py), the ways of sharing the model, each named once
(sharing.py, which the configuration reads without importing torch), and a class per way (sharding/)."""
