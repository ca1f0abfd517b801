"""Training objectives: one module per kind (supervised, dft, preference, grpo), each one class behind the protocol
in base.py. The recipe's train.objective finds its class in the one table, table.py."""
