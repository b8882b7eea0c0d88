"""The command line, ``python -m detector <command>`` (`make <command>`): the commands and their arguments
(arguments.py, which imports no torch, so that every ``--help`` answers at once), ``main`` (main.py), which runs one
and ends its process in one line, and torchrun's launch of several processes (launch.py)."""
