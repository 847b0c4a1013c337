"""Measurement on the GPU outside the search: the decode step timed for every baseline and the megakernel side by
side, with the bandwidth floor (`bench`, behind `synth bench` and `synth generate`)."""
