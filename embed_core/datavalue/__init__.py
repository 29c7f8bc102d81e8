"""The data-value gate: before a training stage, short proxy trainings measure what each data
source and each synthetic strategy is worth on the stage's dev tasks, and the stage trains on what
earns its place (``gate``; the units ``units``, the proxy runs ``proxy``, the rule ``rule``)."""
