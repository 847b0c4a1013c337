"""Measurement on the GPU outside the search, behind `synth bench` and `synth generate`: the decode step timed for the
PyTorch baselines and the megakernel side by side, with the bandwidth floor.

`bench` runs it (schedule loading, the ratios against the best PyTorch step, the JSON document); `variants` holds
what is timed; `torch_step` the plain bf16 PyTorch step, the HF model and the check against the fp32 reference;
`compile` the torch.compile child process; `timing` the harness and the byte accounting; `render` the table;
`options` the run's options and errors."""
