"""make train: a training run of the detector with one GIoU loss strategy, a package by concern.

- run/: the run and its loop (training_loop.py), entered by entry.py; the one step (step.py) that make profile times
  too; train.strategy=auto (auto.py).
- checkpoints/: saving and resuming behind one door (manager.py), the files and their checks, the format.
- distributed/: the processes and their collectives, and a class per way of sharing the model (sharding/).
- observe/: where the run's time and memory went, the log line, summary.json.
- evaluate/: the held-out evaluation, its picture, and what a run trained used outside it (export, predict).
- Beneath them all: optimizer.py (AdamW, clipping and the bf16 copies in one pass, which every way of sharing
  steps) and choice.py (train.strategy=auto's record and its rule, which summary.json holds).
"""
