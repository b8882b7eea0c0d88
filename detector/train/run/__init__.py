"""The run and its loop (training_loop.py), entered by entry.py; the one step (step.py), its options and its data; the
strategy train.strategy=auto chooses (auto.py; its record and rule: ../choice.py)."""
