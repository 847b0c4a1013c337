"""Schedule synthesis: model specs, lowering, search, the LLM agent, the CLI and runs/."""
