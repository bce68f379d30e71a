"""An explicit-state model checker for the sans-IO push protocol (`kvpush.protocol`).

`model` is the world (endpoints, engines that reuse blocks at once, a faulty network, a
data plane that copies late), `checker` the breadth-first search, `scopes` what is
explored, `loader` which protocol (the working tree's or a git revision's). Run it:

    PYTHONPATH=src .venv/bin/python -m tests.protocol_model --scope ci
"""
