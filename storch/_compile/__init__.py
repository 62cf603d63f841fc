"""The parts of `storch.compile_step` (the public module is `storch.compiled_step`).

``inputs``: the step's arguments, its modules' state and the key of a trace; ``trace``: the step
run under ``make_fx``; ``checks``: the checks of eager mode a replay keeps; ``refusals``: what a replay
cannot reproduce; ``passes``: the graph simplified with torch's FX passes; ``replay``: running the
graph and checking that it reproduces the traced step. Nothing in the storch engine imports these.
"""
