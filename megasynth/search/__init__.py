"""The search: proposers suggest strategies and patches (`proposers/`); the loop turns each into a candidate of an
Optuna study (`loop`, with its settings in `config`), claimed in the study's database so that processes and machines
sharing it split the work (`claims`, over the storage bookkeeping of `megasynth.runs.study`); the evaluator lowers,
validates and times or estimates it into runs/<run>/ (`evaluate`), worker processes can prepare candidates ahead
(`pool`). Also the LLM agent's briefing (`briefing`) and the cost model's fit to GPU
traces of earlier runs (`calibrate`)."""
