"""The CPU back end: the integer kernel compiled on the machine (`native`, its C sources in `csrc/`),
torch's int4 product (`int4`), an AR step's small operations and whole blocks in one library call
(`steps`), the forms a few-row product takes (`forms`) and the rule that gives them (`choice`),
the DiT's compute dtype (`bf16`) and the CPU's matrix-product forms and scratch buffer (`matmul`)."""
