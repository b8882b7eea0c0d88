"""The held-out evaluation (evaluation.py, metrics.py) and its picture (pictures.py); what a run trained, used outside
it (export.py, predict.py)."""
