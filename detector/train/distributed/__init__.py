"""Several processes: their group and collectives (processes.py), and a class per way of sharing the model
(sharding/), each way named once in detector/config/sharing.py, which the configuration reads without importing
torch or this package."""
