"""The search: proposers suggest strategies and patches, each becomes a validated, timed or estimated candidate in
runs/<run>/ (`loop`), the LLM agent's briefing (`briefing`), and the cost model's fit to GPU traces (`calibrate`)."""
