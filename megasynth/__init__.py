"""megasynth: megakernel schedules for LLM decode, synthesized, proven race- and deadlock-free, and timed on the GPU.

Packages, each depending only on those before it: `ir` (the schedule format, model config, op catalogue and the
resolved program), `validator` (the proofs), `kernels` (execution: the reference, the CPU executor, the GPU
interpreters), `lowering` (model spec + strategy -> schedule, the cost model), `search`, `runs`, `measure`, and the
CLI (`cli`, `commands`). Importing this package imports nothing else.
"""
